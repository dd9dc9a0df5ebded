"""`import-features`: the authors' published layout (their `val` = the official test split) into our cache."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_support import run_cli

from spml_cache import cache
from spml_cache.extract import import_features
from spml_cache.runtime.errors import SpmlError

NUM_CLASSES = 20  # VOC
PREFIX = "VOCdevkit/VOC2012/JPEGImages/"


def write_authors_files(folder, num_train=12, num_test=5, dim=8):
    """formatted_{train,val}_{images,labels,labels_obs}.npy and {train,val}_features_imagenet_resnet50.npy."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, count in (("train", num_train), ("val", num_test)):
        labels = np.zeros((count, NUM_CLASSES))  # float64 0/1, as their formatting scripts save them
        for row in range(count):
            labels[row, rng.choice(NUM_CLASSES, size=1 + row % 3, replace=False)] = 1.0
        observed = np.zeros_like(labels)
        for row in range(count):
            observed[row, rng.choice(np.flatnonzero(labels[row]))] = 1.0
        images = np.array([f"2008_{split}_{row:06d}.jpg" for row in range(count)])
        features = rng.standard_normal((count, dim)).astype(np.float32)
        np.save(folder / f"formatted_{split}_images.npy", images)
        np.save(folder / f"formatted_{split}_labels.npy", labels)
        np.save(folder / f"formatted_{split}_labels_obs.npy", observed)
        np.save(folder / f"{split}_features_imagenet_resnet50.npy", features)
        written[split] = (images, labels, observed, features)
    return written


def reference_split(num_rows, val_frac=0.2, seed=1200):
    """Their generate_split: RandomState(seed).permutation, the last round(frac * N) indices are val."""
    perm = np.random.RandomState(seed).permutation(num_rows)
    num_val = int(np.round(val_frac * num_rows))
    return np.sort(perm[: num_rows - num_val]), np.sort(perm[-num_val:])


def test_cli_imports_the_authors_layout(tmp_path):
    written = write_authors_files(tmp_path / "pascal")
    result = run_cli("import-features", "pascal", "--dataset", "voc", "--out", "voc.h5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    loaded = cache.load(tmp_path / "voc.h5")
    images, labels, observed, features = written["train"]
    train_rows, val_rows = reference_split(12)
    for name, rows in (("train", train_rows), ("val", val_rows)):
        split = getattr(loaded, name)
        assert split.ids == [PREFIX + str(images[i]) for i in rows]
        np.testing.assert_array_equal(split.features, features[rows])
        np.testing.assert_array_equal(split.labels, labels[rows].astype(np.uint8))
        np.testing.assert_array_equal(split.observed, observed[rows].astype(np.int8))
    test_images, test_labels, _, test_features = written["val"]  # their val is the official test split
    assert loaded.test.ids == [PREFIX + str(name) for name in test_images] and loaded.test.observed is None
    np.testing.assert_array_equal(loaded.test.features, test_features)
    np.testing.assert_array_equal(loaded.test.labels, test_labels.astype(np.uint8))
    assert loaded.classes[0] == "aeroplane" and len(loaded.classes) == NUM_CLASSES
    assert loaded.attrs["source"].startswith("import-features") and loaded.attrs["feature_dim"] == 8
    assert (loaded.attrs["num_pos"], loaded.attrs["num_neg"], loaded.attrs["resolution"]) == (1, 0, 448)
    assert json.loads(loaded.attrs["classes"]) == loaded.classes


@pytest.mark.parametrize("damage, message", [
    ("missing", "missing .*train_features_imagenet_resnet50.npy"),
    ("short", "the train files disagree"),
    ("observed", "observed labels do not fit"),
    ("values", "expected only 0, 1"),
    ("nan", r"val_features_imagenet_resnet50.npy: not finite \(NaN or inf\) in 2 rows \(ids 2008_val_000001.jpg,"
            r" 2008_val_000003.jpg\); nothing was written: fetch or export the published features again"),
    ("float64 beyond float32", r"train_features_imagenet_resnet50.npy: not finite .* in 1 row \(ids 2008_train_000004"),
])  # fmt: skip
def test_bad_files_are_clear_errors_and_write_nothing(tmp_path, damage, message):
    folder = tmp_path / "pascal"
    written = write_authors_files(folder)
    images, labels, observed, features = written["train"]
    if damage == "missing":
        (folder / "train_features_imagenet_resnet50.npy").unlink()
    elif damage == "short":
        np.save(folder / "train_features_imagenet_resnet50.npy", features[:-1])
    elif damage == "observed":
        wrong = observed.copy()
        wrong[0] = 1 - labels[0]  # positives where the full labels have none
        np.save(folder / "formatted_train_labels_obs.npy", wrong)
    elif damage == "values":
        np.save(folder / "formatted_train_labels.npy", labels * 2)
    elif damage == "nan":
        test_features = written["val"][3].copy()
        test_features[[1, 3], 2] = np.nan
        np.save(folder / "val_features_imagenet_resnet50.npy", test_features)
    elif damage == "float64 beyond float32":
        wide = features.astype(np.float64)
        wide[4, 0] = 1e39  # finite in float64, inf once cast to the cache's float32
        np.save(folder / "train_features_imagenet_resnet50.npy", wide)
    with pytest.raises(SpmlError, match=message):
        import_features(folder, dataset="voc", out=tmp_path / "out" / "voc.h5")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_an_existing_cache_is_replaced_only_with_force(tmp_path):
    folder = tmp_path / "pascal"
    write_authors_files(folder)
    out = tmp_path / "voc.h5"
    first = import_features(folder, dataset="voc", out=out)
    with pytest.raises(SpmlError, match="already exists.*--force"):
        import_features(folder, dataset="voc", out=out)
    second = import_features(folder, dataset="voc", out=out, force=True)
    assert first.counts == second.counts == {"train": 10, "val": 2, "test": 5}


def test_class_names_come_from_a_file_or_are_numbered(tmp_path):
    folder = tmp_path / "coco"
    write_authors_files(folder)
    report = import_features(folder, dataset="coco", out=tmp_path / "numbered.h5")
    assert cache.load(report.path).classes[:2] == ["class_0", "class_1"] and "--classes" in report.notes[0]
    names = tmp_path / "names.txt"
    names.write_text("".join(f"thing{k}\n" for k in range(NUM_CLASSES)))
    report = import_features(folder, dataset="coco", out=tmp_path / "named.h5", classes_file=names)
    loaded = cache.load(report.path)
    assert loaded.classes[-1] == f"thing{NUM_CLASSES - 1}" and loaded.train.ids[0].startswith("2008_")
    names.write_text("only\n")
    with pytest.raises(SpmlError, match="1 names for 20 label columns"):
        import_features(folder, dataset="coco", out=tmp_path / "bad.h5", classes_file=names)
