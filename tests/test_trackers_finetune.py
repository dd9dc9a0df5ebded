"""`finetune --log tensorboard,mlflow,wandb`: each tracker holds the fine-tuning's epochs (epoch 0, the starting
model, included), its results and its files, as its run directory does. A small timm trunk at 32 px; MLflow to a
file store (MLFLOW_ALLOW_FILE_STORE), W&B offline."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console
from tracker_support import (
    assert_f1_family_is_sklearns, assert_mlflow_holds, assert_tensorboard_holds, assert_wandb_holds, epoch_values,
    result_values, wandb_folders,
)

from spml_cache import extract, finetune, linear, runs
from spml_cache.demo import data as demo_data

pytest.importorskip("mlflow")
pytest.importorskip("wandb")
pytest.importorskip("tensorboard")
pytestmark = pytest.mark.filterwarnings("ignore::spml_cache.backbones.checkpoints.RandomWeightsWarning")


@pytest.fixture(scope="module")
def linear_run(tmp_path_factory, one_thread):
    base = tmp_path_factory.mktemp("finetune-trackers")
    root = demo_data.make_demo_data(base / "data", num_train=12, num_test=4, size=40, seed=0)
    cache_path = extract.extract("voc", root, out=base, backbone="timm:resnet10t", weights="none", resolution=32,
                                 batch_size=8, workers=0, device="cpu").path
    linear.run_linear(cache=cache_path, losses=["an"], lrs=[1e-3], batch_sizes=[4], epochs=1, out=base / "runs",
                      device="cpu", console=Console(file=io.StringIO()))
    return base, root, cache_path


def test_finetune_logs_every_epoch_and_its_results_to_each_tracker(linear_run, tmp_path, monkeypatch):
    base, root, cache_path = linear_run
    store = (tmp_path / "mlruns").as_uri()
    for key, value in {**wandb_folders(tmp_path), "MLFLOW_TRACKING_URI": store, "MLFLOW_ALLOW_FILE_STORE": "true",
                       "MLFLOW_EXPERIMENT_NAME": "finetune"}.items():
        monkeypatch.setenv(key, value)
    lines = []
    results = finetune.finetune(init="best", cache=cache_path, root=root, loss="an", lrs=[1e-4, 1e-3],
                                batch_sizes=[4], epochs=2, workers=0, device="cpu", out=base / "runs",
                                trackers="tensorboard,mlflow,wandb", log=lines.append)
    run_dir = Path(results["run_dir"])
    where = sorted(line.split(":")[0] for line in lines if line.startswith(("tensorboard:", "mlflow:", "wandb:")))
    assert where == ["mlflow", "tensorboard", "wandb"], lines  # each says where its run is, once
    assert not [line for line in lines if line.startswith("--log")], lines
    assert {epoch for _, _, metric, epoch in epoch_values(run_dir) if metric == "val_map"} == {0, 1, 2}
    config = runs.read_json(run_dir / "config.json")
    assert_tensorboard_holds(run_dir, config)
    assert_mlflow_holds(run_dir, store, "finetune", config)
    assert_wandb_holds(run_dir, config, folders=1)
    assert_f1_family_is_sklearns(run_dir, result_values(run_dir))
