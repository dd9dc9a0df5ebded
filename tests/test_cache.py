"""The HDF5 schema of docs/internals.md: what `write` puts on disk, what `load` accepts and what it refuses."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from spml_cache import cache
from spml_cache.runtime.errors import SpmlError

CLASSES = ["cat", "dog", "bird"]


def splits(rows=(5, 2, 3), dim=6):
    rng = np.random.default_rng(0)
    result = {}
    for name, count in zip(("train", "val", "test"), rows):
        labels = (rng.random((count, len(CLASSES))) < 0.5).astype(np.uint8)
        split = {
            "features": rng.standard_normal((count, dim)).astype(np.float32),
            "labels": labels,
            "ids": [f"{name}/ü{i}.jpg" for i in range(count)],  # non-ASCII ids survive
        }
        if name != "test":
            split["observed"] = np.where(labels == 1, 1, 0).astype(np.int8)
        result[name] = split
    return result


def attrs(**overrides):
    return {"dataset": "voc", "classes": json.dumps(CLASSES), "num_classes": 3, "backbone": "resnet50",
            "weights": "none", "resolution": 32, "mean": [0.485, 0.456, 0.406], "val_frac": 0.2,
            **overrides}  # fmt: skip


def test_write_puts_the_schema_on_disk_and_load_reads_it_back(tmp_path):
    data = splits()
    path = cache.write(tmp_path / "voc.h5", attrs=attrs(), **data)
    assert path == tmp_path / "voc.h5" and sorted(p.name for p in tmp_path.iterdir()) == ["voc.h5"]
    with h5py.File(path, "r") as file:
        assert file.attrs["schema_version"] == 1 and bool(file.attrs["complete"]) is True
        for name in ("train", "val", "test"):
            group = file[name]
            expected = {"features", "labels", "ids", "done"} | ({"observed"} if name != "test" else set())
            assert set(group) == expected
            assert group["features"].dtype == np.float32 and group["labels"].dtype == np.uint8
            assert group["done"].dtype == bool and group["done"][...].all()
            assert h5py.check_string_dtype(group["ids"].dtype) is not None
            if name != "test":
                assert group["observed"].dtype == np.int8
    loaded = cache.load(path)
    assert loaded.classes == CLASSES and loaded.dataset == "voc" and loaded.path == path
    assert loaded.attrs["mean"] == [0.485, 0.456, 0.406] and loaded.attrs["resolution"] == 32
    for name in ("train", "val", "test"):
        split, given = getattr(loaded, name), data[name]
        np.testing.assert_array_equal(split.features, given["features"])
        np.testing.assert_array_equal(split.labels, given["labels"])
        assert split.ids == given["ids"]
        if name == "test":
            assert split.observed is None
        else:
            np.testing.assert_array_equal(split.observed, given["observed"])


def test_default_path_and_cache_id(tmp_path, monkeypatch):
    monkeypatch.setenv("SPML_CACHE", str(tmp_path / "c"))
    assert cache.default_path("coco", 224) == tmp_path / "c" / "coco-resnet50-224.h5"
    assert cache.default_path("voc", folder=tmp_path) == tmp_path / "voc-resnet50-448.h5"
    monkeypatch.delenv("SPML_CACHE")
    assert str(cache.default_path("cub")) == "cache/cub-resnet50-448.h5"
    first = cache.cache_id(attrs(created="2024-01-01T00:00:00"))
    assert first == cache.cache_id(attrs(created="2024-01-01T00:00:00"))
    assert first != cache.cache_id(attrs(created="2024-01-02T00:00:00"))


def corrupt(path, how):
    with h5py.File(path, "r+") as file:
        if how == "incomplete":
            file.attrs["complete"] = False
        elif how == "schema":
            file.attrs["schema_version"] = 2
        elif how == "lengths":
            ids = file["val"]["ids"][...][:-1]
            del file["val"]["ids"]
            file["val"].create_dataset("ids", data=ids)
        elif how == "not done":
            file["test"]["done"][0] = False
        elif how == "no observed":
            del file["train"]["observed"]
        elif how == "widths":  # a test split of other features
            test = file["test"]["features"][...]
            del file["test"]["features"]
            file["test"].create_dataset("features", data=test[:, :-1])
        elif how == "1-d":
            rows = file["val"]["features"].shape[0]
            del file["val"]["features"]
            file["val"].create_dataset("features", data=np.zeros(rows, dtype=np.float32))


@pytest.mark.parametrize(
    "how, message",
    [("incomplete", "incomplete"), ("schema", "schema_version 2"), ("lengths", "disagree in length"),
     ("not done", "never written"), ("no observed", "/train/observed is missing"),
     ("widths", r"features differ in width \(train \d+, val \d+, test \d+\)"),
     ("1-d", r"/val/features has shape \(\d+,\), not one row per image")],
)  # fmt: skip
def test_load_refuses_a_damaged_cache_naming_file_and_problem(tmp_path, how, message):
    path = cache.write(tmp_path / "voc.h5", attrs=attrs(), **splits())
    corrupt(path, how)
    with pytest.raises(SpmlError, match=message) as error:
        cache.load(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_load_refuses_missing_partial_and_foreign_files(tmp_path):
    with pytest.raises(SpmlError, match="no cache at .*extract"):
        cache.load(tmp_path / "none.h5")
    cache.partial_path(tmp_path / "half.h5").write_bytes(b"")
    with pytest.raises(SpmlError, match="half.h5.partial holds an interrupted extraction"):
        cache.load(tmp_path / "half.h5")
    (tmp_path / "text.h5").write_text("not hdf5")
    with pytest.raises(SpmlError, match="not a readable HDF5"):
        cache.load(tmp_path / "text.h5")


def test_write_to_an_unwritable_place_is_a_clear_error_and_leaves_nothing(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(SpmlError, match="cannot write"):
        cache.write(tmp_path / "file" / "voc.h5", attrs=attrs(), **splits())
    bad = splits()
    bad["val"]["features"] = bad["val"]["features"][:1]  # one row short
    with pytest.raises(SpmlError, match="val: 1 feature rows for 2 ids"):
        cache.write(tmp_path / "voc.h5", attrs=attrs(), **bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_partial_cache_resumes_and_drops_bad_rows_when_finalised(tmp_path):
    data = splits(rows=(6, 2, 3), dim=4)
    rows = {name: cache.SplitRows(d["ids"], d["labels"], d.get("observed")) for name, d in data.items()}
    final = tmp_path / "voc.h5"
    partial = cache.PartialCache.create(final, attrs(), rows, feature_dim=4)
    train = data["train"]["features"]
    partial.write_rows("train", np.array([0, 1, 4]), train[[0, 1, 4]], np.array([False, True, False]))
    partial.close()
    assert not final.exists() and cache.partial_path(final).exists()

    partial = cache.PartialCache.open(final)  # a later process resumes
    np.testing.assert_array_equal(partial.pending("train"), [2, 3, 5])
    partial.write_rows("train", np.array([2, 3, 5]), train[[2, 3, 5]], np.zeros(3, dtype=bool))
    for name in ("val", "test"):
        count = len(data[name]["ids"])
        partial.write_rows(name, np.arange(count), data[name]["features"], np.zeros(count, dtype=bool))
    path, dropped = partial.finalise({"device": "cpu"})
    assert dropped == {"train": ["train/ü1.jpg"], "val": [], "test": []}
    assert not cache.partial_path(final).exists()
    loaded = cache.load(path)
    keep = [0, 2, 3, 4, 5]
    assert loaded.train.ids == [data["train"]["ids"][i] for i in keep]
    np.testing.assert_array_equal(loaded.train.features, train[keep])
    np.testing.assert_array_equal(loaded.train.observed, data["train"]["observed"][keep])
    assert json.loads(loaded.attrs["skipped_images"]) == {"train": ["train/ü1.jpg"]}
    assert loaded.attrs["device"] == "cpu"
    np.testing.assert_array_equal(loaded.test.features, data["test"]["features"])


def test_finalise_refuses_rows_not_yet_done(tmp_path):
    data = splits()
    rows = {name: cache.SplitRows(d["ids"], d["labels"], d.get("observed")) for name, d in data.items()}
    partial = cache.PartialCache.create(tmp_path / "voc.h5", attrs(), rows, feature_dim=6)
    with pytest.raises(SpmlError, match="rows not yet extracted"):
        partial.finalise({})
    partial.close()
    assert not (tmp_path / "voc.h5").exists()


@pytest.mark.parametrize("damage", ["no classes", "classes not a list", "too few classes"])
def test_a_cache_without_its_classes_is_refused_in_one_line(tmp_path, damage):
    path = cache.write(tmp_path / "c.h5", attrs=attrs(), **splits())
    with h5py.File(path, "r+") as file:
        if damage == "no classes":
            del file.attrs["classes"]
        else:
            file.attrs["classes"] = "voc" if damage == "classes not a list" else json.dumps(CLASSES[:2])
    with pytest.raises(SpmlError, match=str(path)) as error:
        cache.load(path)
    assert "\n" not in str(error.value) and "classes" in str(error.value)


def poison(path, split, array, rows, value):
    with h5py.File(path, "r+") as file:
        data = file[split][array][...]
        data[rows, 0] = value
        file[split][array][...] = data


@pytest.mark.parametrize(
    "split, array, value, message",
    [("train", "features", np.nan, r"/train/features is not finite \(NaN or inf\) in 2 rows \(ids train/ü1.jpg,"
      r" train/ü3.jpg\): re-extract it in full precision \(spml-cache extract voc --precision fp32 --force\)"),
     ("test", "features", np.inf, r"/test/features is not finite \(NaN or inf\) in 2 rows \(ids test/ü1.jpg, test/"),
     ("val", "labels", 2, r"/val/labels has values outside \{0, 1\} in 2 rows \(ids val/ü0.jpg, val/ü1.jpg\): fix the"
      r" labels at their source"),
     ("train", "observed", -3, r"/train/observed has values outside \{-1, 0, 1\} in 2 rows")],
)  # fmt: skip
def test_load_refuses_non_finite_features_and_labels_out_of_range_naming_rows(tmp_path, split, array, value, message):
    path = cache.write(tmp_path / "voc.h5", attrs=attrs(), **splits())
    rows = [1, 3] if split == "train" else [0, 1] if split == "val" else [1, 2]
    poison(path, split, array, rows, value)
    with pytest.raises(SpmlError, match=message) as error:
        cache.load(path)
    assert str(error.value).startswith(f"{path}: ") and "\n" not in str(error.value)


def test_load_names_only_the_first_ids_of_many_bad_rows(tmp_path):
    path = cache.write(tmp_path / "voc.h5", attrs=attrs(), **splits(rows=(20_000, 2, 3)))
    poison(path, "train", "features", [4, 9_000, 16_500, 19_999], np.nan)  # across the check's blocks
    with pytest.raises(SpmlError, match=r"4 rows \(ids train/ü4.jpg, train/ü9000.jpg, train/ü16500.jpg, \.\.\.\)"):
        cache.load(path)


@pytest.mark.parametrize("val_bad", [False, True], ids=["sealed in place", "compacted"])
def test_partial_cache_counts_rows_recomputed_in_fp32_across_a_resume(tmp_path, val_bad):
    data = splits(rows=(4, 2, 3), dim=4)
    rows = {name: cache.SplitRows(d["ids"], d["labels"], d.get("observed")) for name, d in data.items()}
    final = tmp_path / "voc.h5"
    partial = cache.PartialCache.create(final, attrs(), rows, feature_dim=4)
    flags = np.array([True, False, True, False])
    partial.write_rows("train", np.arange(4), data["train"]["features"], np.zeros(4, dtype=bool), flags)
    partial.close()
    with h5py.File(cache.partial_path(final), "r+") as file:  # as a partial file from before the fp32 fallback
        del file["test"]["recomputed"]
    partial = cache.PartialCache.open(final)
    partial.write_rows("val", np.arange(2), data["val"]["features"], np.array([False, val_bad]), np.ones(2, bool))
    partial.write_rows("test", np.arange(3), data["test"]["features"], np.zeros(3, dtype=bool))
    expected = {"train": 2, "val": 1 if val_bad else 2}  # a recomputed row left out is not counted
    assert partial.recomputed() == {**expected, "test": 0}
    path, _ = partial.finalise({})
    loaded = cache.load(path)
    assert json.loads(loaded.attrs["recomputed_fp32"]) == expected
    with h5py.File(path, "r") as file:
        assert all("recomputed" not in file[name] and "bad" not in file[name] for name in cache.SPLITS)
