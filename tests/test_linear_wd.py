"""`linear --wd`: weight decay as a grid axis beside the lrs, selected on val like the rest, recorded in every
config, metrics line, config.json and results.json, kept by `--resume`; the papers' grid (0 alone) unchanged."""

import json

import numpy as np
import pytest
from cli_support import one_error_line, run_cli
from linear_support import interrupted_run, quiet, write_synthetic_cache

from spml_cache.linear import run_linear
from spml_cache.runs import read_linear_head

GRID = dict(lrs=[1e-1, 1e-2], batch_sizes=[4, 8], epochs=3)
WDS = [0.0, 0.05, 2.0]


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    return write_synthetic_cache(tmp_path_factory.mktemp("cache") / "voc-resnet50-448.h5", train=48, val=24, test=30)


def lines_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_wd_axis_is_trained_selected_and_recorded(tmp_path, tiny_cache):
    run = run_linear(cache=tiny_cache, losses=["an", "role"], wds=WDS, out=tmp_path, console=quiet(), seeds=2, **GRID)
    for name, result in run.results["losses"].items():
        configs = result["configs"]
        assert len(configs) == 2 * 3 * 2 * 2 and {c["wd"] for c in configs} == set(WDS)
        mean_val = {}  # selection restated: the config with the best val mAP averaged over seeds, first on ties
        for c in configs:
            mean_val.setdefault((c["lr"], c["wd"], c["batch_size"]), []).append(c["val_map"])
        best = max(mean_val, key=lambda key: np.mean(mean_val[key]))
        selected = result["selected"]
        assert (selected["lr"], selected["wd"], selected["batch_size"]) == best
        assert read_linear_head(run.run_dir, name).settings["lr"] == best[0]
    assert {line["wd"] for line in lines_of(run.run_dir)} == set(WDS)
    config = json.loads((run.run_dir / "config.json").read_text())
    assert config["wds"] == WDS and config["lrs"] == GRID["lrs"]
    # a head is the head of a run with that weight decay alone: one stack, each head as if alone
    alone = run_linear(cache=tiny_cache, losses="an", wds=[0.0, 2.0], out=tmp_path / "alone", console=quiet(),
                       seeds=2, **GRID)
    for config in alone.results["losses"]["an"]["configs"]:
        mine = next(c for c in run.results["losses"]["an"]["configs"]
                    if all(c[key] == config[key] for key in ("lr", "wd", "batch_size", "seed")))
        assert mine["val_map"] == pytest.approx(config["val_map"], abs=1e-4)


def test_the_papers_grid_names_no_weight_decay(tmp_path, tiny_cache):
    run = run_linear(cache=tiny_cache, losses="an", out=tmp_path, console=quiet(), **GRID)
    zero = run_linear(cache=tiny_cache, losses="an", wds=[0], out=tmp_path / "zero", console=quiet(), **GRID)
    for done in (run, zero):
        assert json.loads((done.run_dir / "config.json").read_text())["wds"] == [0.0]
        assert not any("wd" in c for c in done.results["losses"]["an"]["configs"])
        assert "wd" not in done.results["losses"]["an"]["selected"]
        assert not any("wd" in line for line in lines_of(done.run_dir))
    assert [c["val_map"] for c in run.results["losses"]["an"]["configs"]] == \
        [c["val_map"] for c in zero.results["losses"]["an"]["configs"]]


def test_resume_keeps_the_wd_axis(tmp_path, tiny_cache, monkeypatch):
    whole = run_linear(cache=tiny_cache, losses=["an", "role"], wds=WDS, out=tmp_path / "whole", console=quiet(),
                       **GRID)
    run_dir = interrupted_run(tmp_path / "cut", tiny_cache, monkeypatch, parts=2, losses=["an", "role"], wds=WDS,
                              workers=1, **GRID)
    resumed = run_linear(resume=run_dir, console=quiet())
    for name in ("an", "role"):
        assert resumed.results["losses"][name]["selected"] == whole.results["losses"][name]["selected"]
        for mine, theirs in zip(resumed.results["losses"][name]["configs"], whole.results["losses"][name]["configs"]):
            assert {k: mine[k] for k in ("lr", "wd", "batch_size")} == {k: theirs[k] for k in ("lr", "wd", "batch_size")}
            assert mine["val_map"] == pytest.approx(theirs["val_map"], abs=1e-4)


def test_the_command_line_trains_the_wd_axis(tmp_path, tiny_cache):
    done = run_cli("linear", "--cache", str(tiny_cache), "--loss", "an", "--lr", "0.1", "--batch-size", "8",
                   "--epochs", "2", "--wd", "0,1e-3", "--out", str(tmp_path / "runs"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    results = json.loads((run_dir / "results.json").read_text())
    assert [c["wd"] for c in results["losses"]["an"]["configs"]] == [0.0, 1e-3]
    assert "wd" in done.stdout  # the summary table names the selected weight decay


BAD = [(["--wd", "-1e-4"], "--wd -0.0001: every weight decay must be 0 or more"),
       (["--wd", ","], "--wd is empty"), (["--wd", "nan"], "every weight decay must be 0 or more"),
       (["--wd", "heavy"], "--wd 'heavy': expected a comma list of numbers")]


@pytest.mark.parametrize("args, message", BAD, ids=[m for _, m in BAD])
def test_a_bad_wd_is_one_line_and_writes_nothing(tmp_path, tiny_cache, args, message, monkeypatch, capsys):
    line = one_error_line(["linear", "--cache", str(tiny_cache), "--loss", "an", *args], cwd=tmp_path,
                          subprocess_too=args == BAD[0][0], monkeypatch=monkeypatch, capsys=capsys)
    assert message in line, line
    assert not (tmp_path / "runs").exists()


def test_the_report_curves_follow_the_selected_weight_decay(tmp_path, tiny_cache):
    from spml_cache.report import collect, val_curves

    run = run_linear(cache=tiny_cache, losses="an", wds=[0.0, 2.0], out=tmp_path, console=quiet(), **GRID)
    selected = run.results["losses"]["an"]["selected"]
    mine = [line["val_map"] for line in lines_of(run.run_dir)
            if all(line[key] == selected[key] for key in ("lr", "wd", "batch_size"))]
    (found,) = collect.collect_runs([tmp_path])
    _, curve, _ = val_curves.read_curves({"an": found})["an"]
    assert curve == pytest.approx(mine)  # one seed: the selected head's own line, not the other weight decay's
