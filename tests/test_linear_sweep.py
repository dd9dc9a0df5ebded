"""Sweeps: `--hp key=v1,v2` trains every value beside every (lr, batch size); heads that differ only in a
hyperparameter the loss takes per head share a stack, and each equals the head of a run with that value alone."""

import json

import pytest
import torch
from cli_support import one_error_line
from linear_support import quiet, reordering_step, write_synthetic_cache

from spml_cache import cache
from spml_cache.linear import run_linear
from spml_cache.linear.engine import LinearData, SeedGrid, SeedRun
from spml_cache.losses.overrides import Combination
from spml_cache.runs import newest_run, read_linear_head
from spml_cache.runtime.errors import SpmlError
from spml_cache.selection import HeadRecord

GRID = dict(lrs=[1e-1, 1e-2], batch_sizes=[4, 8], epochs=3)



@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    return write_synthetic_cache(tmp_path_factory.mktemp("cache") / "voc-resnet50-448.h5", train=48, val=24, test=30)


def without_time(entry: dict) -> dict:
    return {key: value for key, value in entry.items() if key != "seconds"}


@pytest.mark.parametrize("name, key, values", [("ll_r", "delta", [0.01, 0.05, 0.1]), ("gr", "wT", [2.0, 10.0]),
                                                 ("em_apl", "warmup", [1, 2])])
def test_each_swept_head_is_the_head_of_a_run_with_that_value(tmp_path, tiny_cache, name, key, values):
    """ll_r's delta and gr's wT share a stack (per-head values); em_apl's warmup gets a stack per value.

    A head in the sweep's stack of 2 lrs x N values against the head of a run's stack of 2: the same math on other
    shapes, so float32 rounding apart (linear_support.reordering_step), and their val mAPs within 1e-6 points,
    below the 1.5e-3 a reordering of two val scores makes on 24 rows of 5 classes: the same rankings, so the same
    best epochs."""
    assert 1e-6 < reordering_step(24, 5)
    swept = run_linear(cache=tiny_cache, losses=name, hparams={key: values}, out=tmp_path / "sweep", console=quiet(),
                       **GRID)
    configs = swept.results["losses"][name]["configs"]
    assert len(configs) == 2 * 2 * len(values) and {c["hparams"][key] for c in configs} == set(values)
    best = max(values, key=lambda v: max(c["val_map"] for c in configs if c["hparams"][key] == v))
    for value in values:
        alone = run_linear(cache=tiny_cache, losses=name, hparams={key: value}, out=tmp_path / f"{value}",
                           console=quiet(), **GRID)
        for config in alone.results["losses"][name]["configs"]:
            mine = next(c for c in configs if c["hparams"][key] == value and c["lr"] == config["lr"]
                        and c["batch_size"] == config["batch_size"])
            assert mine["best_epoch"] == config["best_epoch"]
            assert mine["val_map"] == pytest.approx(config["val_map"], abs=1e-6)
    selected = swept.results["losses"][name]["selected"]
    assert selected["swept"] == {key: best} and selected["hparams"][key] == best
    lines = [json.loads(line) for line in (swept.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {line["hparams"][key] for line in lines} == set(values)
    config = json.loads((swept.run_dir / "config.json").read_text())
    assert config["hparams"][name][key] == values
    assert read_linear_head(swept.run_dir, name).hparams[key] == best  # what finetune --init best starts from
    assert newest_run(tmp_path / "sweep", "voc", "linear", loss=name) == swept.run_dir


def test_per_head_values_share_one_stack(tiny_cache):
    data = LinearData.from_features(cache.load(tiny_cache), torch.device("cpu"))
    combos = [{"delta": d} for d in (0.01, 0.02, 0.03)]
    run = SeedRun("ll_r", combos, 0, SeedGrid([1e-2, 1e-3], [8], 1), data)
    (stack,) = run.stacks
    assert stack.num_heads == 6 and [r.hparams for r in stack.records][:2] == [{"delta": 0.01}, {"delta": 0.01}]
    per_stack = SeedRun("em_apl", [{"warmup": 1}, {"warmup": 2}], 0, SeedGrid([1e-2], [8], 1), data)
    assert len(per_stack.stacks) == 2


def test_a_combination_is_known_by_its_swept_values():
    """The swept keys are found once for a loss's combinations; a combination hashes and compares by its swept
    values alone (what a head record names), so selection finds it from a record's `hparams`."""
    resolved = [{"delta": d, "mode": "x", "table": [1, 2]} for d in (0.01, 0.02)]
    combos = Combination.of(resolved)
    assert [combo.swept for combo in combos] == [(("delta", 0.01),), (("delta", 0.02),)]
    assert [combo.values for combo in combos] == resolved  # every value kept, unhashable ones included
    record = HeadRecord(loss="ll_r", lr=1e-2, batch_size=8, seed=0, hparams={"delta": 0.02})
    assert {combo: index for index, combo in enumerate(combos)}[Combination(record.swept, {})] == 1
    (alone,) = Combination.of([{"delta": 0.01}])  # no sweep: nothing swept, records name nothing
    assert alone.swept == () and alone.swept_values == {}


def test_the_papers_grid_sweeps_what_a_paper_states(tmp_path, tiny_cache):
    run = run_linear(cache=tiny_cache, losses=["ll_ct", "an"], hp_grid="paper", lrs=[1e-2], batch_sizes=[8], epochs=1,
                     hparams={"ll_ct.delta": [0.002, 0.004]}, out=tmp_path, console=quiet())
    configs = run.results["losses"]["ll_ct"]["configs"]
    assert [c["hparams"]["delta"] for c in configs] == [0.002, 0.004]  # the command line wins over the paper
    assert "hparams" not in run.results["losses"]["an"]["configs"][0]  # no paper grid: its defaults
    grid = run_linear(cache=tiny_cache, losses="ll_r", hp_grid="paper", lrs=[1e-2], batch_sizes=[8], epochs=1,
                      out=tmp_path / "paper", console=quiet())
    assert [c["hparams"]["delta"] for c in grid.results["losses"]["ll_r"]["configs"]] == [0.001, 0.002, 0.003, 0.004,
                                                                                          0.005]


BAD_SWEEPS = [
    (["--hp", "ll_r.delta="], "no value"),
    (["--hp", "ll_r.delta=0.1,fast"], "'fast' is not a number"),
    (["--hp", "ll_r.delta=0.1,1.5"], r"--hp ll_r.delta=1.5: outside its valid range \(0, 1\)"),
    (["--hp", "ll_r.alpha=0.1,0.2"], "has no hyperparameter alpha"),
    (["--hp", "ll_r.delta=" + ",".join(f"0.{i:04d}" for i in range(1, 700)), "--seeds", "3"], "more than 10,000"),
    (["--hp-grid", "everything"], "--hp-grid 'everything'"),
]


@pytest.mark.parametrize("args, message", BAD_SWEEPS, ids=[m for _, m in BAD_SWEEPS])
def test_a_bad_sweep_is_one_line_and_writes_nothing(tmp_path, tiny_cache, args, message, monkeypatch, capsys):
    # one from a subprocess, as a user types it; the others in this process
    line = one_error_line(["linear", "--cache", str(tiny_cache), "--loss", "ll_r", *args], cwd=tmp_path,
                          subprocess_too=args == BAD_SWEEPS[0][0], monkeypatch=monkeypatch, capsys=capsys)
    assert __import__("re").search(message, line), line
    assert not (tmp_path / "runs").exists()


def test_the_python_api_refuses_an_empty_sweep(tmp_path, tiny_cache):
    with pytest.raises(SpmlError, match="the list is empty"):
        run_linear(cache=tiny_cache, losses="ll_r", hparams={"delta": []}, out=tmp_path, console=quiet())


def test_the_report_shows_the_chosen_values_and_a_figure_per_loss_and_key(tmp_path, tiny_cache):
    from spml_cache import report
    from spml_cache.report.plots import sweep_curves

    run = run_linear(cache=tiny_cache, losses=["ll_r", "an"], hparams={"ll_r.delta": [0.01, 0.1]},
                     out=tmp_path / "runs", console=quiet(), **GRID)
    table = report.build_table(report.collect_runs([tmp_path / "runs"]))
    cells = {loss: cells["VOC linear"] for loss, cells in table.rows}
    chosen = run.results["losses"]["ll_r"]["selected"]["swept"]["delta"]
    assert report.cell_text(cells["ll_r"]).endswith(f"(delta={chosen:g})") and "(" not in report.cell_text(cells["an"])
    (run_record,) = report.collect_runs([run.run_dir])
    curves = sweep_curves({"ll_r": run_record})
    values, maps, selected = curves[("ll_r", "delta")]
    configs = run.results["losses"]["ll_r"]["configs"]
    assert values == [0.01, 0.1] and selected == chosen
    assert maps == [max(c["val_map"] for c in configs if c["hparams"]["delta"] == v) for v in values]
    written = report.write_plots([tmp_path / "runs"], tmp_path / "figures")
    assert tmp_path / "figures" / "voc_linear-sweeps.png" in written
