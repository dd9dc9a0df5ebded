"""The stages after the first on the real photos and features (realdata_support.py): stage three from the best
linear head at 224 px, the report's tables and figures on the real runs, the real cache exported and imported
back, and `--features last4` on the real model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from linear_support import reordering_step
from PIL import Image
from realdata_support import BACKBONE, FED_LIMIT, MODEL, NUM_CLASSES, photos

from spml_cache import cache

pytestmark = pytest.mark.realdata


def test_one_epoch_of_fine_tuning_starts_from_the_best_heads_val_map(realdata):
    """LinearInit: epoch 0 scores the trunk that made the cache under ROLE's selected linear head, before any step,
    so its val mAP is the head's (the photos decoded, resized and normalised again, the trunk run again). On the
    first 8 photos of each split (realdata_support.FED_LIMIT: one step of batch 8). Measured: equal to 3e-15; the
    bound is the least change a reordering of two of the 8 scores of a class makes."""
    start = json.loads((realdata.finetune / "results.json").read_text())["init"]
    linear = json.loads((realdata.finetune.parent / Path(start["run"]).name / "results.json").read_text())
    head = linear["losses"]["role"]
    assert (start["mode"], start["loss"], start["lr"], start["batch_size"], [start["epoch"]]) == (
        "best", "role", head["selected"]["lr"], head["selected"]["batch_size"], head["best_epoch"])
    lines = [json.loads(line) for line in (realdata.finetune / "metrics.jsonl").read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [0, 1]
    step = reordering_step(FED_LIMIT, NUM_CLASSES)
    assert lines[0]["val_map"] == pytest.approx(head["val_map"], abs=step)
    assert lines[0]["test_map"] == pytest.approx(head["test_map"], abs=step)
    assert math.isfinite(lines[1]["train_loss"]) and lines[1]["train_loss"] > 0
    assert math.isfinite(lines[1]["val_map"]) and math.isfinite(lines[1]["test_map"])
    options = json.loads((realdata.finetune / "config.json").read_text())  # each option under its own name
    assert (options["resolution"], options["decode"], options["epochs"]) == (224, "cpu", 1)  # the cache's own


def test_the_report_tables_and_figures_on_the_real_runs(realdata, tmp_path):
    """`report --ci --plots` over every loss's run on the real features: a row per loss with the run's test mAP
    and its bootstrap interval over the 128 test images, the best single-positive loss marked, and every figure
    drawn. Measured: intervals 4.4-9.6 points wide; a width outside 2-20 would be an interval not taken over these
    128 images."""
    out = tmp_path / "table.json"
    realdata.cli("report", str(realdata.linear_all), "--ci", "--format", "json", "--out", str(out), "--plots",
                 str(tmp_path / "figures"), "--dpi", "100")
    table = json.loads(out.read_text())
    found = json.loads((realdata.linear_all / "results.json").read_text())["losses"]
    (column,) = table["columns"]
    assert column["label"] == f"csv linear [{BACKBONE}]"
    cells = {row["loss"]: row["cells"][column["label"]] for row in table["rows"]}
    assert set(cells) == set(found)
    for loss, cell in cells.items():
        low, high = cell["interval"]
        assert cell["mean"] == pytest.approx(found[loss]["test_map"], abs=1e-9), loss
        assert low <= cell["mean"] <= high and 2 < high - low < 20, (loss, cell["interval"])
    oracles = {row["loss"] for row in table["rows"] if row["oracle"]}
    single_positive = {loss: entry["test_map"] for loss, entry in found.items() if loss not in oracles}
    assert [loss for loss, cell in cells.items() if cell["best"]] == [max(single_positive, key=single_positive.get)]
    figures = sorted((tmp_path / "figures").glob("*.png"))
    assert {path.stem.rsplit("-", 1)[1] for path in figures} == {"val_curves", "per_class_ap", "train_histograms",
                                                                 "label_recovery"}, figures
    for path in figures:
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("L"))
        assert min(pixels.shape) > 200 and len(np.unique(pixels)) > 16, path  # drawn, not blank


def test_the_real_cache_exported_and_imported_is_the_same_cache(realdata, tmp_path):
    """`export` then `import-features` of the export (their Python doors, which the commands call)."""
    from spml_cache.cache.embeddings import export
    from spml_cache.extract import import_features

    export(realdata.cache, tmp_path / "exported")
    import_features(tmp_path / "exported", out=tmp_path / "again.h5")
    original, again = cache.load(realdata.cache), cache.load(tmp_path / "again.h5")
    for name in cache.SPLITS:
        before, after = getattr(original, name), getattr(again, name)
        assert after.ids == before.ids
        np.testing.assert_array_equal(after.features, before.features)
        np.testing.assert_array_equal(after.labels, before.labels)
        if name == "test":
            assert before.observed is None and after.observed is None
        else:
            np.testing.assert_array_equal(after.observed, before.observed)
    kept = ("dataset", "classes", "backbone", "weights", "resolution", "resize", "feature_dim", "split_seed",
            "val_frac", "observe_seed", "num_pos", "num_neg", "expected_positives", "decoder")
    assert {key: str(again.attrs[key]) for key in kept} == {key: str(original.attrs[key]) for key in kept}


def test_last4_on_the_real_model_is_its_last_four_stages_pooled(realdata, tmp_path):
    """`--features last4` on EfficientNet-Lite0: its last four feature stages (timm's feature_info), each
    average-pooled, concatenated, restated here with forward hooks on those modules under timm's own evaluation
    transform. Measured: relative L2 at most 2.5e-3 (PIL's resize against torch's); bound 1e-2, as for the
    pooled features."""
    import timm

    from spml_cache.extract import extract

    loaded = cache.load(extract("csv", photos(), backbone=BACKBONE, weights=str(realdata.weights), features="last4",
                                limit=2, out=tmp_path / "last4.h5", device="cpu").path)
    model = timm.create_model(MODEL, num_classes=0)
    model.load_state_dict(torch.load(realdata.weights, weights_only=True), strict=False)
    model.eval()
    stages = model.feature_info[-4:]
    assert loaded.attrs["features"] == "last4"
    assert loaded.attrs["feature_dim"] == sum(stage["num_chs"] for stage in stages) == 24 + 40 + 112 + 320
    pooled = []
    for stage in stages:
        model.get_submodule(stage["module"]).register_forward_hook(
            lambda module, inputs, output: pooled.append(output.mean(dim=(2, 3))))
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    for name in cache.SPLITS:
        split = getattr(loaded, name)
        images = torch.stack([transform(Image.open(photos() / i).convert("RGB")) for i in split.ids])
        pooled.clear()
        with torch.inference_mode():
            model(images)
        theirs, ours = torch.cat(pooled, dim=1).numpy(), np.asarray(split.features)
        assert np.isfinite(ours).all()
        distance = np.linalg.norm(theirs - ours, axis=1) / np.linalg.norm(ours, axis=1)
        assert distance.max() < 1e-2, (name, distance)
