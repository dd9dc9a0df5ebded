"""runs.py reads run directories as well as writing them: the one best-head rule, `open_for_resume`, `newest_run`,
the options config.json keeps; and run directories written by older code (tests/fixtures/) still resume and
report."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from linear_support import quiet

from spml_cache import report, runs
from spml_cache.linear import run_linear
from spml_cache.linear.settings import stored_options
from spml_cache.runtime.errors import SpmlError

FIXTURE = Path(__file__).parent / "fixtures" / "runs_a4ce30b"
FINISHED, CUT = "linear-bce+an+role-20261124-141816", "linear-an+role-20261124-141816"


def fake_linear_run(run_dir: Path, val_maps: dict[str, float], stage: str = "linear") -> Path:
    """A finished run as `finish_run` lays it out: results.json with each loss's val mAP, best.pt with a head per
    loss whose bias says which loss it is."""
    run_dir.mkdir(parents=True)
    losses = {name: {"val_map": value, "selected": {"hparams": {}}} for name, value in val_maps.items()}
    heads = {name: {"head": {"weight": torch.zeros(2, 3), "bias": torch.full((2,), float(i))}, "lr": 0.01}
             for i, name in enumerate(val_maps)}
    torch.save(heads, run_dir / "best.pt")
    (run_dir / "config.json").write_text(json.dumps({"stage": stage, "cache_id": "c0ffee"}))
    (run_dir / "results.json").write_text(json.dumps({"stage": stage, "cache_id": "c0ffee", "complete": True,
                                                       "losses": losses}))
    return run_dir


def test_the_best_head_of_a_run_is_never_an_oracle_unless_asked_by_name(tmp_path):
    # bce and iun read the full labels: their val mAP beats every single-positive loss, and means nothing for SPML
    run = fake_linear_run(tmp_path / "run", {"bce": 95.0, "an": 70.0, "role": 80.0, "iun": 99.0, "epr": None})
    head = runs.read_linear_head(run, None)
    assert head.loss == "role" and head.val_map == 80.0 and head.bias.tolist() == [2.0, 2.0]
    assert runs.read_linear_head(run, "bce").loss == "bce"  # an oracle's head, when asked for by name


def test_a_run_of_oracles_only_has_no_best_head_without_a_loss(tmp_path):
    run = fake_linear_run(tmp_path / "run", {"bce": 95.0, "an": None})
    with pytest.raises(SpmlError, match=r"no single-positive head with a val mAP .*pass --loss NAME"):
        runs.read_linear_head(run, None)


def test_open_for_resume_takes_only_an_interrupted_run_of_its_stage(tmp_path):
    finished = fake_linear_run(tmp_path / "linear-an-20260101-000000", {"an": 70.0})
    with pytest.raises(SpmlError, match="already complete"):
        runs.open_for_resume(finished, "linear")
    (finished / "results.json").unlink()
    assert runs.open_for_resume(finished, "linear")["cache_id"] == "c0ffee"
    with pytest.raises(SpmlError, match=f"a linear run; resume it with spml-cache linear --resume {finished}"):
        runs.open_for_resume(finished, "finetune")
    with pytest.raises(SpmlError, match=r"not a run directory \(no config.json\)"):
        runs.open_for_resume(tmp_path, "linear")


def test_newest_run_is_the_newest_finished_one_of_that_loss_and_cache(tmp_path):
    voc = tmp_path / "voc"
    older = fake_linear_run(voc / "linear-an-20260101-000000", {"an": 70.0})
    newer = fake_linear_run(voc / "linear-an-20260101-000000-2", {"an": 60.0})
    fake_linear_run(voc / "linear-role-20260102-000000", {"role": 80.0})  # newest, but another loss
    unfinished = fake_linear_run(voc / "linear-an-20260103-000000", {"an": 90.0})
    (unfinished / "results.json").unlink()
    garbled = fake_linear_run(voc / "linear-an-20260104-000000", {"an": 90.0})
    (garbled / "results.json").write_text("{")
    assert runs.newest_run(tmp_path, "voc", "linear", loss="an") == newer
    assert runs.newest_run(tmp_path, "voc", "linear", loss="an", cache="c0ffee") == newer
    assert runs.newest_run(tmp_path, "voc", "linear", loss="an", cache="another") is None
    assert runs.newest_run(tmp_path, "coco", "linear", loss="an") is None
    (newer / "best.pt").unlink()  # no models: nothing to start from
    assert runs.newest_run(tmp_path, "voc", "linear", loss="an") == older


@pytest.fixture
def old_runs(tmp_path) -> Path:
    """A copy of the fixture, its config.json files naming the copy's cache (the one thing a moved folder changes)."""
    copy = tmp_path / "old"
    shutil.copytree(FIXTURE, copy, ignore=shutil.ignore_patterns("*.py"))
    for config in copy.glob("runs/voc/*/config.json"):
        data = json.loads(config.read_text())
        assert Path(data["cache"]).name == "voc-resnet50-448.h5"
        config.write_text(json.dumps({**data, "cache": str(copy / "cache" / "voc-resnet50-448.h5")}))
    return copy


def without_seconds(results: dict) -> dict:
    return {name: {k: v for k, v in entry.items() if k != "seconds"} for name, entry in results["losses"].items()}


def test_an_old_interrupted_run_resumes_to_what_a_whole_run_gives(old_runs, tmp_path):
    config = json.loads((old_runs / "runs" / "voc" / CUT / "config.json").read_text())
    assert "options" not in config  # the oldest shape: the grid and the stage extras alone
    grid = stored_options(config, Path("config.json"))
    assert (grid.losses, grid.lrs, grid.batch_sizes, grid.epochs, grid.seeds) == (["an", "role"], [0.01], [4, 8], 2, 1)
    assert grid.fidelity == "exact" and grid.val_labels == "clean" and grid.wds == [0.0]
    resumed = run_linear(resume=old_runs / "runs" / "voc" / CUT, console=quiet())
    whole = run_linear(cache=config["cache"], losses=grid.losses, lrs=grid.lrs, batch_sizes=grid.batch_sizes,
                       epochs=grid.epochs, out=tmp_path / "whole", console=quiet())
    assert without_seconds(resumed.results) == without_seconds(whole.results)


def test_an_old_finished_run_reports_and_hands_over_its_best_head(old_runs):
    finished = old_runs / "runs" / "voc" / FINISHED
    stored = json.loads((finished / "results.json").read_text())["losses"]
    table = report.build_table(report.collect_runs([old_runs / "runs"]))
    cells = {loss: cells for loss, cells in table.rows}
    assert set(cells) == {"bce", "an", "role"} and [run.path.name for run in table.incomplete] == [CUT]
    (column,) = table.columns
    assert cells["role"][column.label].mean == pytest.approx(stored["role"]["test_map"])
    best = max((name for name in stored if name != "bce"), key=lambda name: stored[name]["val_map"])
    assert runs.read_linear_head(finished, None).loss == best


def test_run_directories_name_the_backbone_and_old_names_still_read(old_runs):
    """Four runs of one loss on four caches were four `linear-an-<time>`: each now names its cache's backbone and
    feature kind, and a run directory named the old way is found and reported beside them, by its files."""
    import h5py

    source = old_runs / "cache" / "voc-resnet50-448.h5"
    last4 = shutil.copy(source, old_runs / "cache" / "voc-timm_vit_base_patch14_dinov2.lvd142m_last4-448.h5")
    with h5py.File(last4, "r+") as file:
        file.attrs.update(backbone="timm:vit_base_patch14_dinov2.lvd142m", features="last4")
    made = [run_linear(cache=path, losses=["role"], lrs=[1e-2], batch_sizes=[4], epochs=1, out=old_runs / "runs",
                       console=quiet()).run_dir for path in (source, last4)]
    assert [re.sub(r"-\d{8}-\d{6}(-\d+)?$", "", path.name) for path in made] == [
        "linear-resnet50-role", "linear-timm_vit_base_patch14_dinov2.lvd142m_last4-role"]
    table = report.build_table(report.collect_runs([old_runs / "runs"]))
    assert [column.label for column in table.columns] == ["VOC linear",
                                                          "VOC linear [timm:vit_base_patch14_dinov2.lvd142m+last4]"]
    cells = dict(table.rows)
    assert cells["role"]["VOC linear"].run == made[0] and cells["an"]["VOC linear"].run.name == FINISHED  # old name
    assert any(f"older: {old_runs / 'runs' / 'voc' / FINISHED}" in note for note in table.notes)
    resnet = json.loads((made[0] / "results.json").read_text())["cache_id"]
    assert runs.newest_run(old_runs / "runs", "voc", "linear", loss="role", cache=resnet) == made[0]
    assert runs.newest_run(old_runs / "runs", "voc", "linear", loss="an", cache=resnet).name == FINISHED
