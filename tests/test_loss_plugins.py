"""Losses from outside the package (docs/your-own-loss.md): a file, a module, an entry point; recorded in
config.json with their origin, loaded again by --resume (refused when the file changed), fine-tuned, reported."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from cli_support import REPO, run_cli, run_main
from linear_support import interrupted_run, quiet, write_synthetic_cache

from spml_cache import losses
from spml_cache.linear import run_linear
from spml_cache.linear.settings import resolve_losses
from spml_cache.losses import Overrides, plugins
from spml_cache.report.plots import parse_compare
from spml_cache.runtime.errors import SpmlError

EXAMPLE = REPO / "examples" / "masked_focal.py"
SPEC = "masked_focal.py:MaskedFocal"
GRID = {"lrs": [1e-2], "batch_sizes": [8], "epochs": 2}


@pytest.fixture(autouse=True)
def no_plugins_loaded(monkeypatch):
    """Each test starts with no plugin loaded in this process (the registry of plugins is per process)."""
    monkeypatch.setattr(plugins, "_LOADED", {})


@pytest.fixture
def beside(tmp_path, monkeypatch):
    """The worked example copied into a fresh folder, the current directory."""
    shutil.copy(EXAMPLE, tmp_path / "masked_focal.py")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_cli_module(*args: str, cwd) -> subprocess.CompletedProcess:
    """`python -m ARGS` with this checkout importable (for torchrun)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SPML_")}
    env.update(PYTHONPATH=str(REPO), COLUMNS="400")
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def without_seconds(results: dict) -> dict:
    """A run's results less what differs between two runs of the same grid (wall times, the run directory)."""
    entries = {name: {k: v for k, v in entry.items() if k != "seconds"} for name, entry in results["losses"].items()}
    return {key: value for key, value in results.items() if key not in ("seconds", "run_dir")} | {"losses": entries}


def test_a_file_plugin_is_known_by_its_name_and_its_origin_is_recorded(beside):
    write_synthetic_cache(beside / "voc.h5")
    run = run_linear(cache=beside / "voc.h5", losses=["an", SPEC], out=beside / "runs", console=quiet(), **GRID)
    config = json.loads((run.run_dir / "config.json").read_text())
    assert config["losses"] == ["an", "masked_focal"] and set(run.results["losses"]) == {"an", "masked_focal"}
    digest = hashlib.sha256((beside / "masked_focal.py").read_bytes()).hexdigest()
    path = beside / "masked_focal.py"
    assert config["plugins"] == {"masked_focal": {"kind": "file", "path": str(path), "sha256": digest,
                                                  "spec": f"{path}:MaskedFocal"}}
    assert run.run_dir.name.startswith("linear-resnet50-an+masked_focal-")
    assert resolve_losses(["all", SPEC]) == [*losses.names(), "masked_focal"]  # beside --loss all
    # --hp and report's --compare take the spec too, and mean the plugin's name
    given = Overrides.given(["an", "masked_focal"], {f"{SPEC}.w": 0.3})
    assert given.per_loss == {"an": {}, "masked_focal": {"w": 0.3}}
    assert parse_compare(f"an,{SPEC}") == ("an", "masked_focal")


def test_a_resumed_plugin_run_equals_the_uninterrupted_one_and_a_changed_file_is_refused(beside, monkeypatch):
    write_synthetic_cache(beside / "voc.h5")
    grid = {**GRID, "batch_sizes": [4, 8], "losses": [SPEC, "an"], "hparams": {"masked_focal.w": [0.25, 0.5]}}
    whole = run_linear(cache=beside / "voc.h5", out=beside / "whole", console=quiet(), **grid)
    run_dir = interrupted_run(beside / "cut", beside / "voc.h5", monkeypatch, parts=1, **grid)
    before = sorted(path.name for path in run_dir.rglob("*"))
    (beside / "masked_focal.py").write_text(EXAMPLE.read_text() + "# edited\n")
    refused = run_cli("linear", "--resume", str(run_dir), cwd=beside)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert f"--resume {run_dir}: the loss plugin masked_focal changed since the run began" in line
    assert "restore it, or start a new run" in line and str(beside / "masked_focal.py") in line
    assert sorted(path.name for path in run_dir.rglob("*")) == before  # nothing written
    shutil.copy(EXAMPLE, beside / "masked_focal.py")
    done = run_cli("linear", "--resume", str(run_dir), cwd=beside)  # a new process: loaded from config.json
    assert done.returncode == 0, done.stderr
    resumed = json.loads((run_dir / "results.json").read_text())
    assert without_seconds(resumed) == without_seconds(whole.results)


def test_a_module_plugin_and_an_entry_point_plugin_with_their_origins(tmp_path, monkeypatch):
    package = tmp_path / "site" / "spmlplug"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(EXAMPLE.read_text().replace('"masked_focal"', '"plug_focal"'))
    info = tmp_path / "site" / "spmlplug-1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: spmlplug\nVersion: 1.2\n")
    (info / "entry_points.txt").write_text("[spml_cache.losses]\nplug_focal = spmlplug:MaskedFocal\n")
    (info / "top_level.txt").write_text("spmlplug\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert "plug_focal" in plugins.installed()
    cls = losses.get("plug_focal")  # by the entry point's name alone
    assert cls.name == "plug_focal" and cls.__module__ == "spmlplug"
    digest = hashlib.sha256((package / "__init__.py").read_bytes()).hexdigest()
    assert plugins.origin("plug_focal") == {"kind": "entry_point", "spec": "plug_focal",
                                            "value": "spmlplug:MaskedFocal", "path": str(package / "__init__.py"),
                                            "sha256": digest, "distribution": "spmlplug", "version": "1.2"}
    env = {"PYTHONPATH": f"{REPO}:{tmp_path / 'site'}"}
    listed = run_cli("losses", "--json", cwd=tmp_path, env=env)
    assert listed.returncode == 0, listed.stderr
    row = {row["name"]: row for row in json.loads(listed.stdout)}["plug_focal"]
    assert (row["origin"]["distribution"], row["origin"]["version"]) == ("spmlplug", "1.2")
    assert all(row["origin"] is None for row in json.loads(listed.stdout) if row["name"] in losses.names())
    write_synthetic_cache(tmp_path / "voc.h5")
    shutil.copy(EXAMPLE, tmp_path / "mylosses.py")  # package.module:Class, from the current directory
    trained = run_cli("linear", "--cache", "voc.h5", "--loss", "plug_focal,mylosses:MaskedFocal", "--lr", "1e-2",
                      "--batch-size", "8", "--epochs", "1", cwd=tmp_path, env=env)
    assert trained.returncode == 0, trained.stderr
    (config_path,) = tmp_path.glob("runs/voc/*/config.json")
    config = json.loads(config_path.read_text())
    recorded = config["plugins"]
    assert recorded["plug_focal"]["version"] == "1.2" and recorded["masked_focal"]["spec"] == "mylosses:MaskedFocal"
    assert recorded["masked_focal"]["sha256"] == hashlib.sha256(EXAMPLE.read_bytes()).hexdigest()
    # the run as the code before the one loader recorded it (kind "entry point"), stopped before any part was kept
    recorded["plug_focal"]["kind"] = "entry point"
    config_path.write_text(json.dumps(config))
    (config_path.parent / "results.json").unlink()
    resumed = run_cli("linear", "--resume", str(config_path.parent), cwd=tmp_path, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert set(json.loads((config_path.parent / "results.json").read_text())["losses"]) == {"plug_focal",
                                                                                            "masked_focal"}


BAD = {
    "missing.py:Loss": ("no file missing.py", "give the path of a .py file"),
    "notaloss.py:Thing": ("Thing is not a loss", "subclass spml_cache.losses.Loss"),
    "clash.py:Clash": ("its name 'an' is a built-in loss's", "give the plugin another name"),
    "broken.py:Broken": ("importing it raised ZeroDivisionError: division by zero", "fix the plugin"),
    "notaloss.py:Absent": ("notaloss.py defines no Absent", "name a class it defines"),
    "no_such_module:Loss": ("no module no_such_module on the Python path", "install its package"),
    "nameless.py:Nameless": ("set the class attribute name", "letters, digits and _"),
}


@pytest.mark.parametrize("spec", list(BAD))
def test_bad_plugins_are_one_line_naming_the_spec_and_the_fix_and_nothing_is_written(spec, tmp_path, monkeypatch,
                                                                                       capsys):
    base = "from spml_cache.losses import Loss\nfrom spml_cache.losses.assume_negative import AssumeNegative\n"
    (tmp_path / "notaloss.py").write_text("class Thing:\n    name = 'thing'\n")
    (tmp_path / "clash.py").write_text(base + "class Clash(AssumeNegative):\n    name = 'an'\n")
    (tmp_path / "broken.py").write_text(base + "1 / 0\n")
    (tmp_path / "nameless.py").write_text(base + "class Nameless(AssumeNegative):\n    pass\n")
    write_synthetic_cache(tmp_path / "voc.h5")
    # each named as the user gave it: after --loss for linear, as the argument for check-loss and losses
    for command, named in ((["linear", "--cache", "voc.h5", "--loss", f"an,{spec}"], f"--loss {spec}"),
                           (["check-loss", spec], spec), (["losses", spec], spec)):
        code, err = run_main(*command, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
        (line,) = err.strip().splitlines()
        seen, fix = BAD[spec]
        assert code == 1 and line.startswith(f"error: {named}: ") and seen in line and fix in line, line
        assert command[0] == "linear" or "--loss" not in line, line  # no flag the user never gave
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        ["notaloss.py", "clash.py", "broken.py", "nameless.py", "voc.h5"])  # no runs/ folder


def test_a_plugin_fine_tunes_from_its_linear_head_and_appears_in_the_report(tmp_path):
    shutil.copy(EXAMPLE, tmp_path / "masked_focal.py")
    data = run_cli("make-demo-data", "data", "--train", "16", "--test", "8", "--size", "32", cwd=tmp_path)
    assert data.returncode == 0, data.stderr
    steps = [
        ["extract", "voc", "--root", "data", "--backbone", "resnet18", "--weights", "none", "--resolution", "32",
         "--workers", "0"],
        ["linear", "--dataset", "voc", "--loss", f"an,{SPEC}", "--lr", "1e-2", "--batch-size", "8", "--epochs", "2"],
        # by its name alone: the linear run's config.json says where the plugin came from
        ["finetune", "--dataset", "voc", "--loss", "masked_focal", "--root", "data", "--lr", "1e-4", "--batch-size",
         "4", "--epochs", "1", "--workers", "0", "--device", "cpu"],
        ["report", "--format", "json"],
    ]
    for args in steps:
        done = run_cli(*args, cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, (args, done.stderr)
    (finetuned,) = tmp_path.glob("runs/voc/finetune-*/results.json")
    results = json.loads(finetuned.read_text())
    assert list(results["losses"]) == ["masked_focal"] and np.isfinite(results["losses"]["masked_focal"]["test_map"])
    config = json.loads((finetuned.parent / "config.json").read_text())
    assert config["plugins"]["masked_focal"]["sha256"] == hashlib.sha256(EXAMPLE.read_bytes()).hexdigest()
    report = json.loads(done.stdout)
    rows = json.dumps(report)
    assert "masked_focal" in rows and "an" in rows


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun's CPU processes, as CI runs them")
def test_under_torchrun_every_process_loads_the_plugin_and_the_results_are_one_processs(beside):
    write_synthetic_cache(beside / "voc.h5", train=40, val=16, test=20)
    done = run_cli_module("torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "spml_cache",
                          "linear", "--cache", "voc.h5", "--loss", f"an,{SPEC}", "--lr", "1e-2", "--batch-size", "4,8",
                          "--epochs", "2", "--device", "cpu", "--out", "two", cwd=beside)
    assert done.returncode == 0, done.stderr
    (run_dir,) = (beside / "two" / "voc").iterdir()
    whole = run_linear(cache=beside / "voc.h5", out=beside / "one", console=quiet(), losses=["an", SPEC],
                       lrs=[1e-2], batch_sizes=[4, 8], epochs=2)
    assert without_seconds(json.loads((run_dir / "results.json").read_text())) == without_seconds(whole.results)


def test_spawned_worker_processes_load_the_plugin_again(beside, monkeypatch):
    """Where workers are spawned (macOS's CPU, any GPU), they start without the parent's plugins."""
    write_synthetic_cache(beside / "voc.h5")
    grid = {"losses": [SPEC], "lrs": [1e-2], "batch_sizes": [4, 8], "epochs": 2}
    whole = run_linear(cache=beside / "voc.h5", out=beside / "one", console=quiet(), **grid)
    monkeypatch.setattr(sys, "platform", "darwin")  # jobs.py forks only on Linux
    spawned = run_linear(cache=beside / "voc.h5", out=beside / "two", console=quiet(), workers=2, **grid)
    assert without_seconds(spawned.results) == without_seconds(whole.results)


def test_an_entry_point_plugin_is_loaded_again_by_its_record_and_refused_once_its_version_changed(tmp_path,
                                                                                                 monkeypatch):
    site = tmp_path / "site"
    (site / "otherplug").mkdir(parents=True)
    (site / "otherplug" / "__init__.py").write_text(EXAMPLE.read_text().replace('"masked_focal"', '"other_focal"'))
    info = site / "otherplug-2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: otherplug\nVersion: 2.0\n")
    (info / "entry_points.txt").write_text("[spml_cache.losses]\nother_focal = otherplug:MaskedFocal\n")
    monkeypatch.syspath_prepend(str(site))
    recorded = plugins.records([losses.get("other_focal").name])  # what config.json keeps
    monkeypatch.setattr(plugins, "_LOADED", {})  # a new process: nothing loaded
    plugins.load_recorded(recorded, run_dir="RUN", strict=True)
    assert plugins.origin("other_focal") == recorded["other_focal"]
    earlier = {"other_focal": {**recorded["other_focal"], "kind": "entry point"}}  # the keys of the code before
    monkeypatch.setattr(plugins, "_LOADED", {})
    plugins.load_recorded(earlier, run_dir="RUN", strict=True)
    assert plugins.origin("other_focal") == recorded["other_focal"]
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: otherplug\nVersion: 2.1\n")
    monkeypatch.setattr(plugins, "_LOADED", {})
    with pytest.raises(SpmlError, match="--resume RUN: the loss plugin other_focal changed since the run began"
                                        r" \(version 2.0 then, 2.1 now"):
        plugins.load_recorded(recorded, run_dir="RUN", strict=True)
