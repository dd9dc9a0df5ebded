"""The Python face (`import spml_cache as sc`, issue 53): the command line's results from Python, bit for bit, for the
same settings (linear, finetune, report and extract, the command line run from a subprocess as a user types it and
the Python door in this process on the same tiny data); every keyword of every door, misspelt and with a bad
value, refused in one line naming it (derived from the declarations, so a new option is tried too); quiet unless
asked; `import spml_cache` light.

Both sides run single-threaded (OMP_NUM_THREADS=1, torch.set_num_threads(1)), so that they do the same arithmetic;
each side runs under the same ATEN_CPU_CAPABILITY, whatever it is, so the equality holds under each."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torchvision
from cli_support import REPO, run_cli
from linear_support import write_synthetic_cache

import spml_cache as sc
from spml_cache.options import ExtractOptions, ExtractPlacement, FinetuneOptions, FinetunePlacement
from spml_cache.options import LinearOptions, LinearPlacement
from spml_cache.options.declared import ANY
from spml_cache.options.demo import DemoData
from spml_cache.options.experiments import RunOptions
from spml_cache.options.extract import ImportOptions
from spml_cache.options.keywords import keyword_options
from spml_cache.options.report import MAP, RANKINGS, ReportOptions
from spml_cache.runtime.errors import SpmlError

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# Each door, its declarations and what it needs beside the keyword tried (its required argument).
DOORS = {
    "extract": ((ExtractOptions, ExtractPlacement), {"dataset": "voc"}),
    "import_features": ((ImportOptions,), {"folder": "features"}),
    "linear": ((LinearOptions, LinearPlacement), {}),
    "finetune": ((FinetuneOptions, FinetunePlacement), {}),
    "report": ((ReportOptions,), {}),
    "make_demo_data": ((DemoData,), {"folder": "data"}),
    "run": ((RunOptions,), {"file": "experiment.toml"}),
}
EVERY_KEYWORD = [(door, keyword) for door, (types, _) in DOORS.items() for keyword in keyword_options(*types)]

# A bad value of each keyword whose declaration checks more than the type (a check, a reader, a number): what the
# flag takes, wrong. A new option of that sort fails `test_every_checked_keyword_has_a_bad_value_here` until it
# has one.
BAD = {
    "extract": dict(resolution="16", crops="two", features="pool", precision="fp8", decode="gpux", limit=0,
                    on_bad_image="ignore", observe="singel", labels="csr", batch_size=0, workers=-1),
    "import_features": {},
    "linear": dict(loss="rolee", lr="abc", wd="-1", batch_size="8,x", epochs=0, seeds="0", hp="delta", val_labels="noisy",
                   fidelity="paper", hp_grid="papers", observe="entry:2", memory_budget="lots", chunk_rows=0,
                   workers=-1, log="tensorbord"),
    "finetune": dict(init="worst", loss="rolee", epochs=0, lr="x", batch_size=0, resolution=16, seeds=0,
                     hp={"k": [1, 2]}, head_lr_mult=0, fidelity="x", decode="x", workers=-1, log=["mlflow", "x"]),
    "report": dict(format="xls", figure_format="gif", figure_width="wide", dpi=20, compare="an", pivot="dataset",
                   metric="auc", resamples=10),
    "make_demo_data": dict(train=0, test=0, size=8, seed="x"),
    "run": dict(log="tensorbord"),
}


def checked_keywords(types) -> set[str]:
    return {keyword for keyword, (_, option) in keyword_options(*types).items()
            if option.valid is not ANY.valid or option.read is not None or option.kind in (int, float)}


def refusal(door: str, **keywords) -> str:
    """The one line `sc.<door>(**keywords)` is refused with (never a bare TypeError, never any work)."""
    with pytest.raises(SpmlError) as refused:
        getattr(sc, door)(**keywords)
    line = str(refused.value)
    assert "\n" not in line, line
    return line


# --- the keywords --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("door, keyword", EVERY_KEYWORD)
def test_a_misspelt_keyword_is_one_line_naming_the_door_and_the_keyword_meant(door, keyword, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    misspelt = keyword[:-1] + keyword[-1] * 2  # `lrr`, `batch_sizee`
    line = refusal(door, **DOORS[door][1], **{misspelt: 1})
    assert line.startswith(f"sc.{door}: no keyword {misspelt!r}; did you mean {keyword}?"), line


FIELD_NAMED = [(door, option.name, keyword) for door, (types, _) in DOORS.items()
               for keyword, (_, option) in keyword_options(*types).items() if option.name != keyword]


@pytest.mark.parametrize("door, field, keyword", FIELD_NAMED)
def test_an_options_field_name_is_one_line_naming_its_keyword(door, field, keyword, tmp_path, monkeypatch):
    """The fields of LinearOptions and the rest (`lrs`, `batch_sizes`, `hparams`, `trackers`), which the issue's user
    tried first: the keyword meant is the field's own, not the nearest spelling (`trackers` is `log`, not `workers`)."""
    monkeypatch.chdir(tmp_path)
    line = refusal(door, **DOORS[door][1], **{field: 1})
    assert line.startswith(f"sc.{door}: no keyword {field!r}; did you mean {keyword}?"), line


def test_the_fields_named_otherwise_include_the_issues():
    assert {("linear", "lrs", "lr"), ("linear", "batch_sizes", "batch_size"), ("linear", "hparams", "hp"),
            ("linear", "trackers", "log"), ("finetune", "trackers", "log")} <= set(FIELD_NAMED)


@pytest.mark.parametrize("door, keyword", EVERY_KEYWORD)
def test_a_value_of_no_kind_the_keyword_takes_is_one_line_naming_it(door, keyword, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = refusal(door, **{**DOORS[door][1], keyword: object()})
    assert line.startswith(f"{keyword} <object object at "), line
    assert ": give " in line or ": use " in line, line  # and what it takes


@pytest.mark.parametrize("door, keyword", [(door, keyword) for door, table in BAD.items() for keyword in table])
def test_a_bad_value_is_one_line_naming_the_keyword_before_any_work(door, keyword, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = refusal(door, **{**DOORS[door][1], keyword: BAD[door][keyword]})
    assert keyword == "loss" and "loss" in line.split(":")[0] or line.startswith(f"{keyword} "), line
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_every_checked_keyword_has_a_bad_value_here():
    for door, (types, _) in DOORS.items():
        assert set(BAD[door]) == checked_keywords(types), door


def test_keywords_are_the_flags_names_and_take_the_flags_text_or_python_values(tmp_path):
    """`--batch-size` -> `batch_size`, `--from` -> `from_run`, `--no-graphs` -> `graphs`, `--format` -> `format`;
    the flag's text (`epochs="3"`, `lr="1e-3,1e-4"`) or Python values, and an `hp` mapping's text read as the
    flag reads it (`{"ll_r.delta": "0.001,0.002"}` gave 'TypeError must be real number, not str')."""
    assert list(inspect.signature(sc.linear).parameters)[:5] == ["loss", "cache", "dataset", "lr", "wd"]
    assert {"batch_size", "from_run", "graphs", "compile", "hp"} <= set(inspect.signature(sc.linear).parameters)
    assert {"format", "out", "plots", "runs"} <= set(inspect.signature(sc.report).parameters)
    from spml_cache.options import from_flag_keywords

    texts, values = (from_flag_keywords("t", keywords, LinearOptions, LinearPlacement) for keywords in (
        {"loss": "an,ll_r", "epochs": "3", "lr": "1e-3,1e-4", "batch_size": "8", "hp": ["ll_r.delta=0.001,0.002"]},
        {"loss": ["an", "ll_r"], "epochs": 3, "lr": [1e-3, 1e-4], "batch_size": 8,
         "hp": {"ll_r.delta": "0.001,0.002"}}))
    assert texts == values
    assert values[0].hparams == {"ll_r.delta": [0.001, 0.002]} and values[0].epochs == 3
    assert from_flag_keywords("t", {"hp": {"delta": [1e-3, 2e-3]}}, LinearOptions)[0].hparams == {"delta": [1e-3, 2e-3]}
    assert refusal("linear", hp={"delta": "abc"}) == "hp 'delta=abc': 'abc' is not a number (a comma list sweeps values)"
    assert refusal("linear", hp={"delta": None}).startswith("hp delta=None: give a number, a list of numbers")


def test_positional_arguments_missing_ones_and_progress_are_one_line_each(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert refusal("linear").startswith("sc.linear: loss is missing: give a loss")
    assert refusal("extract").startswith("sc.extract: dataset is missing: ")
    assert refusal("import_features").startswith("sc.import_features: folder is missing: Folder with")
    with pytest.raises(SpmlError, match=r"^sc.linear: 1 positional argument too many \('c.h5'\): give every option"):
        sc.linear("c.h5")
    with pytest.raises(SpmlError, match=r"^sc.extract: 1 positional argument too many"):
        sc.extract("voc", "data")
    assert refusal("linear", loss="an", progress="yes") == "progress 'yes': give True or False"
    monkeypatch.delenv("SPML_DATA", raising=False)
    assert refusal("extract", dataset="voc") == ("sc.extract: no data root: give root=DIR (the dataset's folder) or"
                                                 " set SPML_DATA")


def test_every_door_has_its_keywords_in_its_signature_and_docstring():
    for door, (types, _) in DOORS.items():
        function = getattr(sc, door)
        parameters = inspect.signature(function).parameters
        for keyword, (_, option) in keyword_options(*types).items():
            assert keyword in parameters, (door, keyword)
            assert f"\n{keyword} : " in function.__doc__ and option.help in function.__doc__, (door, keyword)


# --- the package --------------------------------------------------------------------------------------------


def run_python(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=300)


def test_import_spml_cache_imports_no_stage_and_every_public_name_resolves(tmp_path):
    done = run_python("import sys, spml_cache as sc\n"
                      "print(sorted(m for m in sys.modules if m.startswith(('torch', 'spml_cache.'))))\n"
                      "print([name for name in sc.__all__ if getattr(sc, name) is None])\n"
                      "print(sc.linear is sys.modules['spml_cache.linear'], callable(sc.report))", tmp_path)
    assert done.returncode == 0, done.stderr
    imported, missing, same = done.stdout.splitlines()
    assert imported == "['spml_cache.runtime', 'spml_cache.runtime.errors']"
    assert missing == "[]" and same == "True True"


def test_a_stage_imported_first_is_still_the_door(tmp_path):
    """Python puts an imported stage's package on `spml_cache` whatever was there: the package is the door."""
    done = run_python("from spml_cache.linear import run_linear\nfrom spml_cache import report\nimport spml_cache as sc\n"
                      "try:\n    sc.linear(lrr=1)\nexcept sc.SpmlError as error:\n    print(error)\n"
                      "print(callable(sc.report), sc.report is report)", tmp_path)
    assert done.stdout.startswith("sc.linear: no keyword 'lrr'; did you mean lr?"), done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "True True"


# --- the same results as the command line ----------------------------------------------------------------------


def same_results(first: dict, second: dict) -> None:
    """results.json of two runs of the same settings: equal but for the seconds each loss took."""
    for results in (first, second):
        for entry in results["losses"].values():
            entry.pop("seconds")
    assert first == second


def same_files(first: Path, second: Path) -> None:
    """best.pt, the stored scores and labels of two runs: equal tensor for tensor, bit for bit."""
    left, right = torch.load(first / "best.pt", weights_only=False), torch.load(second / "best.pt", weights_only=False)
    assert left.keys() == right.keys()
    for key in left:
        for name, value in left[key].items():
            if isinstance(value, dict):
                assert value.keys() == right[key][name].keys()
                assert all(torch.equal(value[k], right[key][name][k]) for k in value if torch.is_tensor(value[k]))
            else:
                assert value == right[key][name], (key, name)
    for npz in sorted(first.rglob("*.npz")):
        a, b = np.load(npz), np.load(second / npz.relative_to(first))
        assert a.files == b.files and all(np.array_equal(a[name], b[name]) for name in a.files), npz


def only_run(folder: Path, stage: str) -> Path:
    (found,) = folder.rglob(f"{stage}-*")
    return found


@pytest.fixture(scope="module")
def world(tmp_path_factory, one_thread):
    """A tiny VOC-layout dataset and its cache, made by the command line and by Python (which must agree) from one
    saved random ResNet-50 (zero-initialised residual branches keep it well conditioned at 32 px)."""
    base = tmp_path_factory.mktemp("face")
    sc.make_demo_data(base / "data", train=16, test=8, size=32)
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet50(zero_init_residual=True).state_dict(), base / "resnet50.pth")
    done = run_cli("extract", "voc", "--root", "data", "--weights", "resnet50.pth", "--resolution", "32", "--device",
                   "cpu", "--workers", "0", "--batch-size", "8", "--out", "cli/voc.h5", cwd=base, env=ONE_THREAD)
    assert done.returncode == 0, done.stderr
    made = sc.extract("voc", root=base / "data", weights=str(base / "resnet50.pth"), resolution="32", device="cpu",
                      workers=0, batch_size=8, out=base / "py" / "voc.h5")
    assert made.status == "written" and made.counts == {"train": 13, "val": 3, "test": 8}
    return SimpleNamespace(base=base, cli_cache=base / "cli" / "voc.h5", cache=made.path, root=base / "data")


def test_extract_from_python_writes_the_command_lines_cache(world):
    cli, py = sc.load_cache(world.cli_cache), sc.load_cache(world.cache)
    for split in ("train", "val", "test"):
        assert np.array_equal(getattr(cli, split).features, getattr(py, split).features)
        assert np.array_equal(getattr(cli, split).labels, getattr(py, split).labels)
        assert getattr(cli, split).ids == getattr(py, split).ids
    assert cli.attrs["content_hash"] == py.attrs["content_hash"]


def test_linear_from_python_is_the_command_line_bit_for_bit(tmp_path, one_thread):
    cache = write_synthetic_cache(tmp_path / "c.h5")
    done = run_cli("linear", "--cache", "c.h5", "--loss", "an,role,ll_r", "--lr", "1e-2,1e-3", "--batch-size", "8,16",
                   "--epochs", "3", "--seeds", "2", "--hp", "ll_r.delta=0.001,0.002", "--device", "cpu", "--out", "cli",
                   cwd=tmp_path, env=ONE_THREAD)
    assert done.returncode == 0, done.stderr
    run = sc.linear(cache=cache, loss=["an", "role", "ll_r"], lr=[1e-2, 1e-3], batch_size="8,16", epochs=3, seeds=2,
                    hp={"ll_r.delta": "0.001,0.002"}, device="cpu", out=tmp_path / "py")
    cli_run = only_run(tmp_path / "cli", "linear")
    same_results(json.loads((cli_run / "results.json").read_text()), json.loads(json.dumps(run.results)))
    same_files(cli_run, run.run_dir)
    # typed: what results.json says, per loss
    ll_r = run.losses["ll_r"]
    assert (ll_r.key, ll_r.loss, ll_r.rule) == ("ll_r", "ll_r", "single") and ll_r.raw is run.results["losses"]["ll_r"]
    assert (ll_r.val_map, ll_r.test_map, ll_r.test_map_std) == tuple(
        run.results["losses"]["ll_r"][key] for key in ("val_map", "test_map", "test_map_std"))
    assert ll_r.selected["hparams"]["delta"] in (0.001, 0.002) and len(ll_r.per_seed) == 2
    assert len(ll_r.configs) == 2 * 2 * 2 * 2  # lr x batch size x delta x seed
    assert torch.equal(ll_r.head()["head"]["weight"], torch.load(run.run_dir / "best.pt")["ll_r"]["head"]["weight"])
    assert sc.load_run(run.run_dir) == run and run.best in ("an", "role", "ll_r")
    with pytest.raises(SpmlError, match=r"unknown result 'rolee' \(did you mean role\?\)"):
        run["rolee"]


def test_finetune_from_python_is_the_command_line_bit_for_bit(world, tmp_path, monkeypatch):
    head = sc.linear(cache=world.cache, loss="an,role", lr=1e-3, batch_size=4, epochs=2, device="cpu",
                     out=tmp_path / "linear")
    weights = str(world.base / "resnet50.pth")  # the trunk that made the cache (which records its sha256 alone)
    settings = ["--from", str(head.run_dir), "--loss", "role", "--root", str(world.root), "--weights", weights,
                "--epochs", "2", "--lr", "1e-4", "--batch-size", "4", "--workers", "0", "--device", "cpu"]
    done = run_cli("finetune", *settings, "--out", "cli", cwd=tmp_path, env=ONE_THREAD)
    assert done.returncode == 0, done.stderr
    run = sc.finetune(from_run=head.run_dir, loss="role", root=world.root, weights=weights, epochs="2", lr=1e-4,
                      batch_size=[4],
                      workers=0, device="cpu", out=tmp_path / "py")
    cli_run = only_run(tmp_path / "cli", "finetune")
    same_results(json.loads((cli_run / "results.json").read_text()), json.loads(json.dumps(run.results)))
    same_files(cli_run, run.run_dir)
    assert run.init["run"] == str(head.run_dir) and run["role"].start["val_map"] == run.results["losses"]["role"][
        "start"]["val_map"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A folder of two linear runs (two caches), for the report."""
    base = tmp_path_factory.mktemp("report")
    for seed, losses in ((0, "an,role"), (1, "an,bce")):
        cache = write_synthetic_cache(base / f"c{seed}.h5", seed=seed)
        sc.linear(cache=cache, loss=losses, lr=1e-2, batch_size=16, epochs=2, seeds=2, device="cpu", out=base / "runs")
    return base


@pytest.mark.parametrize("fmt, render", [("csv", "to_csv"), ("md", "to_markdown"), ("json", "to_json"),
                                         ("tex", "to_latex")])
def test_the_report_from_python_is_the_command_lines_table(two_runs, fmt, render, monkeypatch):
    done = run_cli("report", "runs", "--format", fmt, "--metric", "cf1", cwd=two_runs)
    assert done.returncode == 0, done.stderr
    monkeypatch.chdir(two_runs)
    table = sc.report("runs", metric="cf1")
    assert getattr(table, render)() == done.stdout


def test_the_report_tables_rows_are_its_cells_as_plain_data(two_runs, tmp_path, monkeypatch):
    done = run_cli("report", "--runs", "runs", "--format", "json", "--ci", "--resamples", "200", cwd=two_runs)
    monkeypatch.chdir(two_runs)
    table = sc.report(runs="runs", ci=True, resamples="200", out=tmp_path / "table.md")
    cells = [(row["loss"], label, cell) for row in json.loads(done.stdout)["rows"] for label, cell in row["cells"].items()]
    assert [(row["loss"], row["column"]) for row in table.rows] == [(loss, label) for loss, label, _ in cells]
    for row, (_, _, cell) in zip(table.rows, cells):
        assert {key: row[key] for key in cell} == cell and row["interval"] is not None
        assert row["dataset"] == "voc" and row["stage"] == "linear"
    assert json.loads(json.dumps(table.rows)) == table.rows  # plain data
    assert (tmp_path / "table.md").read_text() == table.to_markdown()  # out=: written as --out writes it
    assert table.notes[0].startswith("best single-positive loss per column")
    assert table._repr_markdown_() == table.to_markdown()


def test_the_report_tables_cells_and_each_runs_rankings_and_f1_family_agree(two_runs, monkeypatch):
    monkeypatch.chdir(two_runs)
    table = sc.report("runs")
    for row in table.rows:
        result = sc.load_run(row["run"])[row["key"]]
        assert row["mean"] == result.test_map
        family, rankings = result.f1_family(), result.rankings()
        assert {name: list(value) for name, value in family.items()} == {
            name: value for name, value in row["metrics"].items() if name not in (MAP, *RANKINGS)}
        assert set(rankings) == set(RANKINGS)
        assert {name: list(value) for name, value in rankings.items()} == {
            name: row["metrics"][name] for name in RANKINGS}


def test_the_report_as_a_dataframe(two_runs):
    table = sc.report(two_runs / "runs")
    try:
        import pandas  # noqa: F401
    except ImportError:
        with pytest.raises(SpmlError, match="to_pandas needs pandas: pip install pandas"):
            table.to_pandas()
        return
    frame = table.to_pandas()
    assert len(frame) == len(table.rows) and {"loss", "column", "mean", "std", "cf1", "cf1 std"} <= set(frame.columns)
    wide = frame.pivot(index="loss", columns="column", values="mean")
    assert wide.loc["an"].notna().sum() == 2


def test_the_report_plots_are_the_command_lines(two_runs, tmp_path):
    pytest.importorskip("matplotlib")
    done = run_cli("report", "runs", "--plots", str(tmp_path / "cli"), cwd=two_runs)
    assert done.returncode == 0, done.stderr
    written = sc.report(two_runs / "runs").plots(tmp_path / "py", figure_format="svg")
    assert sorted(path.stem for path in written) == sorted(path.stem for path in (tmp_path / "cli").iterdir())
    assert all(path.suffix == ".svg" for path in written)
    with pytest.raises(SpmlError, match=r"^dpi 5: "):
        sc.report(two_runs / "runs").plots(tmp_path / "x", dpi=5)
    with pytest.raises(SpmlError, match=r"^figure_width 1: use 2 to 24 inches"):
        sc.report(two_runs / "runs").plots(tmp_path / "x", figure_width=1)
    column = sc.report(two_runs / "runs").plots(tmp_path / "column", figure_format="svg", figure_width="column")
    assert all(f'width="{3.3 * 72:g}pt"' in path.read_text()[:2000] for path in column)  # as printed: 3.3 in


# --- quiet unless asked --------------------------------------------------------------------------------------


def test_python_is_quiet_unless_asked_and_the_command_line_prints_as_before(tmp_path, capfd):
    cache = write_synthetic_cache(tmp_path / "c.h5")
    capfd.readouterr()
    sc.linear(cache=cache, loss="an", lr=1e-2, batch_size=16, epochs=2, device="cpu", out=tmp_path / "quiet")
    quiet = capfd.readouterr()
    assert (quiet.out, quiet.err) == ("", "")
    sc.linear(cache=cache, loss="an", lr=1e-2, batch_size=16, epochs=2, device="cpu", out=tmp_path / "shown",
              progress=True)
    shown = capfd.readouterr()
    assert "an: done" in shown.err and shown.out == ""
