"""Plugins under fault (issue 48): an import that never returns stops on the first Ctrl-C or SIGTERM; a plugin that
exits or raises KeyboardInterrupt at import, two distributions claiming one name, a broken entry point among good
ones, a loss that fails while it trains, a changed file under finetune and a name too long for a file name: each one
line naming the plugin and the fix, as a user meets it."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_support import REPO, run_cli, run_main
from linear_support import quiet, write_synthetic_cache
from rich.console import Console

from spml_cache import losses
from spml_cache.linear import run_linear
from spml_cache.losses import plugins
from spml_cache.losses.assume_negative import AssumeNegative
from spml_cache.losses.contract import run_checks

EXAMPLE = REPO / "examples" / "masked_focal.py"
STOPS_WITHIN = 5.0  # seconds: generous for a loaded CI machine; the goal is 2 (tests/test_stopping.py)
TINY = ["--lr", "1e-2", "--batch-size", "8", "--epochs", "1"]


@pytest.fixture(autouse=True)
def no_plugins_loaded(monkeypatch):
    monkeypatch.setattr(plugins, "_LOADED", {})


def write_distribution(site: Path, name: str, module: str, entry_points: str) -> None:
    """An installed distribution as pip leaves it: its module and a dist-info folder with its entry_points.txt."""
    (site / f"{name}.py").write_text(module)
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)


# --- an import that never returns (2), one that exits or raises KeyboardInterrupt (7) ---------------------------

LOOPER = """
import time
from pathlib import Path

Path("importing").touch()  # the test signals once the import is under way
while True:
    time.sleep(0.05)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and signals as a Linux terminal")
@pytest.mark.parametrize("command, signum", [("linear", signal.SIGINT), ("linear", signal.SIGTERM),
                                             ("check-loss", signal.SIGINT)])
def test_a_plugin_import_that_never_returns_stops_on_the_first_signal_with_the_line(tmp_path, command, signum):
    (tmp_path / "pl").mkdir()
    (tmp_path / "pl" / "looper.py").write_text(LOOPER)
    write_synthetic_cache(tmp_path / "voc.h5", train=24, val=8, test=8)
    args = {"linear": ["linear", "--cache", "voc.h5", "--loss", "an,pl/looper.py:P", *TINY],
            "check-loss": ["check-loss", "pl/looper.py:P"]}[command]
    env = {key: value for key, value in os.environ.items() if not key.startswith("SPML_")}
    env.update(PYTHONPATH=str(REPO), COLUMNS="400")
    process = subprocess.Popen([sys.executable, "-m", "spml_cache", *args], cwd=tmp_path, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "importing").exists():
            assert process.poll() is None and time.monotonic() < deadline, "the plugin's import never began"
            time.sleep(0.02)
        time.sleep(0.2)
        began = time.monotonic()
        if signum == signal.SIGINT:
            os.killpg(process.pid, signum)  # Ctrl-C: the terminal signals the whole group, once
        else:
            process.send_signal(signum)
        _, stderr = process.communicate(timeout=60)
        took = time.monotonic() - began
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 128 + signum, stderr
    assert took < STOPS_WITHIN, f"took {took:.1f} s to stop"
    (line,) = stderr.strip().splitlines()
    named = "--loss pl/looper.py:P" if command == "linear" else "pl/looper.py:P"  # as the user gave it
    assert line == (f"interrupted: nothing was written ({named} was being imported); go on with:"
                    f" spml-cache {' '.join(args)}")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("body, raised", [("import sys\nsys.exit(3)\n", "SystemExit: 3"),
                                          ("raise KeyboardInterrupt\n", "KeyboardInterrupt")])
def test_a_plugin_exiting_or_interrupting_at_import_is_one_line_for_every_command(tmp_path, monkeypatch, capsys,
                                                                                   body, raised):
    (tmp_path / "quits.py").write_text(body)
    write_synthetic_cache(tmp_path / "voc.h5", train=24, val=8, test=8)
    for args in (["check-loss", "quits.py:Loss"], ["losses", "quits.py:Loss"],
                 ["linear", "--cache", "voc.h5", "--loss", "an,quits.py:Loss", *TINY]):
        code, err = run_main(*args, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
        (line,) = err.strip().splitlines()
        named = "--loss quits.py:Loss" if args[0] == "linear" else "quits.py:Loss"  # as the user gave it
        assert code == 1 and line == (f"error: {named}: importing it raised {raised}; fix the plugin (run"
                                      " it with python to see the traceback)"), args
    assert not (tmp_path / "runs").exists()


# --- two distributions claiming one name (4), one broken entry point among good ones (8) ------------------------

def installed_site(tmp_path: Path) -> Path:
    """Four installed distributions: `dup` claimed by two with different maths, one that exits at import, and a good
    one."""
    site = tmp_path / "site"
    site.mkdir()
    focal = EXAMPLE.read_text()
    write_distribution(site, "dupone48", focal.replace('"masked_focal"', '"dup"'),
                       "[spml_cache.losses]\ndup = dupone48:MaskedFocal\n")
    write_distribution(site, "duptwo48", focal.replace('"masked_focal"', '"dup"').replace("gamma", "gamma * 2"),
                       "[spml_cache.losses]\ndup = duptwo48:MaskedFocal\n")
    write_distribution(site, "broken48", "import sys\nsys.exit(3)\n",
                       "[spml_cache.losses]\nbroken48 = broken48:Loss\n")
    write_distribution(site, "good48", focal.replace('"masked_focal"', '"good48"'),
                       "[spml_cache.losses]\ngood48 = good48:MaskedFocal\n")
    return site


def test_two_installed_distributions_naming_one_loss_are_refused_not_chosen_by_the_path_order(tmp_path):
    site = installed_site(tmp_path)
    write_synthetic_cache(tmp_path / "voc.h5", train=24, val=8, test=8)
    done = run_cli("linear", "--cache", "voc.h5", "--loss", "an,dup", *TINY, cwd=tmp_path,
                   env={"PYTHONPATH": f"{REPO}:{site}"})
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: --loss dup: 2 installed entry points of spml_cache.losses have this name (")
    assert "dupone48:MaskedFocal (dupone48 1.0)" in line and "duptwo48:MaskedFocal (duptwo48 1.0)" in line
    assert line.endswith("name one as --loss module:ClassName, or uninstall the other")
    assert not (tmp_path / "runs").exists()


def test_losses_lists_every_loss_and_marks_the_installed_ones_that_cannot_be_loaded(tmp_path, monkeypatch):
    site = installed_site(tmp_path)
    env = {"PYTHONPATH": f"{REPO}:{site}"}
    listed = run_cli("losses", "--json", cwd=tmp_path, env=env)
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert rows["an"]["error"] is None and rows["good48"]["error"] is None
    assert rows["good48"]["origin"]["distribution"] == "good48"
    assert rows["broken48"]["error"] == ("broken48 (entry point broken48:Loss of broken48 1.0): importing it"
                                         " raised SystemExit: 3; fix the plugin (run it with python to see the"
                                         " traceback)")
    assert rows["dup"]["error"].startswith("dup: 2 installed entry points of spml_cache.losses")  # no --loss given
    monkeypatch.syspath_prepend(str(site))  # the table of the same rows, in this process
    printed = Console(file=io.StringIO(), width=400)
    printed.print(losses.describe_table(losses.describe()))
    assert "cannot be loaded: --loss broken48" in printed.file.getvalue() and "good48" in printed.file.getvalue()


# --- a loss failing while it trains (6) ---------------------------------------------------------------------------

FAILING = """
from spml_cache.losses.assume_negative import AssumeNegative


class Raises(AssumeNegative):
    name = "raises"

    def forward(self, logits, observed, *, labels=None, index=None):
        raise ValueError("boom in forward")


class Shape(AssumeNegative):
    name = "shape"

    def forward(self, logits, observed, *, labels=None, index=None):
        return logits.sum(-1)


class Scalar(AssumeNegative):
    name = "scalar"

    def forward(self, logits, observed, *, labels=None, index=None):
        return 0.5


class Init(AssumeNegative):
    name = "initfails"

    def __init__(self, *args, **kwargs):
        raise AttributeError("no such thing")


class Later(AssumeNegative):
    name = "later"

    def start_epoch(self, epoch, num_epochs, train_logits=None):
        if epoch == 2 and num_epochs == 3:  # the contract's small problem trains 2 epochs: it never sees this
            raise RuntimeError("epoch two")
        super().start_epoch(epoch, num_epochs, train_logits)
"""


def contract_line(spec: str) -> str:
    """What check-loss says of the plugin: its first failing check's line."""
    return next(line for passed, line in run_checks(losses.get(str(spec))) if not passed)


def kept_parts(run_dir: Path) -> list[str]:
    return sorted(path.name for path in (run_dir / "jobs").glob("*.pt"))


def test_a_plugin_failing_in_training_is_one_line_and_goes_on_with_resume_once_fixed(tmp_path):
    (tmp_path / "failing.py").write_text(FAILING)
    write_synthetic_cache(tmp_path / "voc.h5", train=24, val=8, test=8)
    done = run_cli("linear", "--cache", "voc.h5", "--loss", "an,failing.py:Raises", *TINY, cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    line = done.stderr.strip().splitlines()[-1]
    spec = f"{tmp_path / 'failing.py'}:Raises"
    assert line == (f"error: --loss raises ({tmp_path / 'failing.py'}) failed: {contract_line(spec)};"
                    f" fix the plugin (spml-cache check-loss {tmp_path / 'failing.py'}:Raises checks it on a small"
                    f" problem); 1 of 2 parts are kept in runs/voc/{run_dir.name}: once it is fixed, go on with:"
                    f" spml-cache linear --resume runs/voc/{run_dir.name}")
    assert kept_parts(run_dir) == ["an-seed0-batch8.pt"]
    fixed = FAILING.replace('raise ValueError("boom in forward")',
                            "return super().forward(logits, observed, labels=labels, index=index)")
    (tmp_path / "failing.py").write_text(fixed)
    resumed = run_cli("linear", "--resume", f"runs/voc/{run_dir.name}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "none of its parts was kept, so it trains with the code found now" in resumed.stderr
    assert set(json.loads((run_dir / "results.json").read_text())["losses"]) == {"an", "raises"}
    recorded = json.loads((run_dir / "config.json").read_text())["plugins"]["raises"]
    assert recorded["sha256"] == hashlib.sha256(fixed.encode()).hexdigest()  # the code that trained it


@pytest.mark.parametrize("spec, seen", [
    ("failing.py:Shape", "returned shape (3, 8) for logits [K=3, B, C]; return one value per head"),
    ("failing.py:Scalar", "forward returned a float, not a tensor; return one value per head, a [K] tensor"),
    ("failing.py:Init", "the loss raised AttributeError: no such thing"),
])
def test_each_way_a_plugin_fails_says_what_check_loss_says(tmp_path, monkeypatch, capsys, spec, seen):
    (tmp_path / "failing.py").write_text(FAILING)
    write_synthetic_cache(tmp_path / "voc.h5", train=24, val=8, test=8)
    code, err = run_main("linear", "--cache", "voc.h5", "--loss", f"an,{spec}", *TINY, cwd=tmp_path,
                         monkeypatch=monkeypatch, capsys=capsys)
    line = err.strip().splitlines()[-1]
    name = plugins.lookup(spec).name
    assert code == 1 and seen in contract_line(spec), err
    assert line.startswith(f"error: --loss {name} ({tmp_path / 'failing.py'}) failed: {contract_line(spec)}; fix")
    if spec.endswith("Init"):  # refused while the grid is checked: nothing written
        assert line.endswith("checks it on a small problem)") and not (tmp_path / "runs").exists()
    else:
        (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
        assert line.endswith(f"1 of 2 parts are kept in runs/voc/{run_dir.name}: once it is fixed, go on with:"
                             f" spml-cache linear --resume runs/voc/{run_dir.name}")


def test_a_fault_the_contract_does_not_see_says_what_training_raised_and_a_kept_part_asks_a_new_run(
        tmp_path, monkeypatch, capsys):
    (tmp_path / "failing.py").write_text(FAILING)
    write_synthetic_cache(tmp_path / "voc.h5", train=24, val=8, test=8)
    grid = ["--lr", "1e-2", "--batch-size", "8", "--epochs", "3"]
    code, err = run_main("linear", "--cache", "voc.h5", "--loss", "failing.py:Later", *grid, cwd=tmp_path,
                         monkeypatch=monkeypatch, capsys=capsys)
    line = err.strip().splitlines()[-1]
    assert code == 1 and line.startswith(f"error: --loss later ({tmp_path / 'failing.py'}) failed: training it raised"
                                         " RuntimeError: epoch two; fix the plugin"), err
    # a seed whose part was kept before the fault: that code trained it, so --resume would refuse the fixed one
    shutil.rmtree(tmp_path / "runs")
    monkeypatch.setattr(plugins, "_LOADED", {})  # as a new process: the edited class takes the name again
    (tmp_path / "failing.py").write_text(FAILING.replace("num_epochs == 3:", "num_epochs == 3 and self.seed == 1:"))
    code, err = run_main("linear", "--cache", "voc.h5", "--loss", "failing.py:Later", *grid, "--seeds", "2",
                         cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    assert code == 1 and kept_parts(run_dir) == ["later-seed0-batch8.pt"], err
    assert err.strip().splitlines()[-1].endswith(f"1 of 2 parts are kept in runs/voc/{run_dir.name}, 1 of them"
                                                 " trained by this code of later: once it is fixed, start a new run")


def test_a_built_in_loss_failing_the_same_way_is_a_bug_named_by_the_loss(tmp_path, monkeypatch, capsys):
    def broken(self, logits, observed, *, labels=None, index=None):
        raise RuntimeError("a bug")

    monkeypatch.setattr(AssumeNegative, "forward", broken)
    monkeypatch.setattr(AssumeNegative, "loss_and_grad", broken)  # what a step runs: an's closed form
    write_synthetic_cache(tmp_path / "voc.h5", train=24, val=8, test=8)
    code, err = run_main("linear", "--cache", "voc.h5", "--loss", "an", *TINY, cwd=tmp_path, monkeypatch=monkeypatch,
                         capsys=capsys)
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    (line,) = err.strip().splitlines()
    assert code == 1 and line == (
        "error: --loss an failed: finite: the loss raised RuntimeError: a bug; see docs/your-own-loss.md for what"
        " forward receives; a bug in spml-cache's an: please report it with the traceback (--debug); 0 of 1 parts"
        f" are kept in runs/voc/{run_dir.name}: once it is fixed, go on with: spml-cache linear --resume"
        f" runs/voc/{run_dir.name}")


# --- finetune after the plugin file was edited (14) ----------------------------------------------------------------

def test_finetune_refuses_a_loss_plugin_edited_since_its_linear_run(tmp_path, monkeypatch, capsys):
    shutil.copy(EXAMPLE, tmp_path / "masked_focal.py")
    monkeypatch.chdir(tmp_path)
    write_synthetic_cache(tmp_path / "voc.h5", train=24, val=8, test=8)
    linear = run_linear(cache=tmp_path / "voc.h5", losses=["masked_focal.py:MaskedFocal"], lrs=[1e-2],
                        batch_sizes=[8], epochs=1, out=tmp_path / "runs", console=quiet())
    source = tmp_path / "masked_focal.py"
    before = hashlib.sha256(source.read_bytes()).hexdigest()
    source.write_text(EXAMPLE.read_text() + "# edited\n")
    now = hashlib.sha256(source.read_bytes()).hexdigest()
    for loss in ("masked_focal", "masked_focal.py:MaskedFocal"):  # by its name (the run's record) or its spec
        monkeypatch.setattr(plugins, "_LOADED", {})
        code, err = run_main("finetune", "--cache", "voc.h5", "--loss", loss, "--root", ".", "--device", "cpu",
                             cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
        (line,) = err.strip().splitlines()
        assert code == 1 and line == (
            f"error: --loss masked_focal: the loss plugin changed since linear run runs/voc/{linear.run_dir.name}"
            f" trained its head (sha256 {before[:16]} then, {now[:16]} now: {source}); restore it, or train a new"
            " linear run with it")
    shutil.copy(EXAMPLE, source)  # restored: the head's own code, and fine-tuning goes on (to the images)
    monkeypatch.setattr(plugins, "_LOADED", {})
    code, err = run_main("finetune", "--cache", "voc.h5", "--loss", "masked_focal", "--root", ".", "--device", "cpu",
                         cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and "the image root . holds none of the cache's" in err and "plugin" not in err


# --- a name too long for a file name (15) ----------------------------------------------------------------------

def test_a_name_longer_than_64_characters_is_refused_and_four_long_names_make_a_short_run_directory(
        tmp_path, monkeypatch, capsys):
    base = "from spml_cache.losses.assume_negative import AssumeNegative\n"
    (tmp_path / "long.py").write_text(base + f"class Long(AssumeNegative):\n    name = '{'l' * 300}'\n")
    names = [letter * 64 for letter in "wxyz"]
    (tmp_path / "four.py").write_text(base + "".join(f"class {name[0].upper()}(AssumeNegative):\n    name = '{name}'\n"
                                                     for name in names))
    write_synthetic_cache(tmp_path / "voc.h5", train=24, val=8, test=8)
    code, err = run_main("linear", "--cache", "voc.h5", "--loss", "an,long.py:Long", *TINY, cwd=tmp_path,
                         monkeypatch=monkeypatch, capsys=capsys)
    (line,) = err.strip().splitlines()
    assert code == 1 and line == (f"error: --loss long.py:Long: its name is 300 characters ({'l' * 16}...); give it"
                                  " at most 64 (it is part of file names, which filesystems cap at 255 bytes)")
    assert not (tmp_path / "runs").exists()
    specs = ",".join(f"four.py:{name[0].upper()}" for name in names)  # 64 is allowed, four of them together too
    code, err = run_main("linear", "--cache", "voc.h5", "--loss", specs, *TINY, cwd=tmp_path, monkeypatch=monkeypatch,
                         capsys=capsys)
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    assert code == 0, err
    assert run_dir.name.startswith(f"linear-resnet50-{names[0]}+3_more-") and len(run_dir.name) < 255
    assert set(json.loads((run_dir / "results.json").read_text())["losses"]) == set(names)


MODULE_LOSS = '''
import torch

from spml_cache.losses import Loss
from spml_cache.losses.base import mean_over_entries, neg_log_1mp, neg_log_p


class Beside(Loss):
    name = "beside"
    description = "assume negative, from a module in the folder the run began in"
    reference = "tests/test_plugin_faults.py"
    observed_negative = "a known 0"

    def forward(self, logits, observed, *, labels=None, index=None):
        return mean_over_entries(torch.where(observed == 1, neg_log_p(logits), neg_log_1mp(logits)))
'''


def test_a_module_plugin_from_the_folder_a_run_began_in_resumes_from_any_folder(tmp_path):
    """`--loss mod:Class` finds mod.py in the current folder; config.json records that file and its hash, and
    --resume loads the plugin from there in any folder (issue 56: "no module mod on the Python path")."""
    began, elsewhere = tmp_path / "began", tmp_path / "elsewhere"
    began.mkdir(), elsewhere.mkdir()
    (began / "beside_loss.py").write_text(MODULE_LOSS)
    cache_path = write_synthetic_cache(tmp_path / "voc.h5", train=40, val=16, test=20)
    done = run_cli("linear", "--cache", str(cache_path), "--loss", "beside_loss:Beside", *TINY, cwd=began)
    assert done.returncode == 0, done.stderr
    (run_dir,) = (began / "runs" / "voc").iterdir()
    record = json.loads((run_dir / "config.json").read_text())["plugins"]["beside"]
    assert record["kind"] == "module" and record["path"] == str(began / "beside_loss.py")
    whole = json.loads((run_dir / "results.json").read_text())
    (run_dir / "results.json").unlink()  # as a run killed before it wrote its results
    done = run_cli("linear", "--resume", str(run_dir), cwd=elsewhere)
    assert done.returncode == 0 and "changed" not in done.stderr, done.stderr  # the recorded file, as recorded
    strip = lambda results: {key: {k: v for k, v in entry.items() if k != "seconds"}
                             for key, entry in results["losses"].items()}
    assert strip(json.loads((run_dir / "results.json").read_text())) == strip(whole)
