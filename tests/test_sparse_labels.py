"""Sparse (CSR) label matrices: the round trip, the cache's storage of them, and stage two on a sparse cache
giving the figures of the same cache stored dense."""

import h5py
import numpy as np
import pytest
from linear_support import quiet, write_synthetic_cache

from spml_cache import cache
from spml_cache.cache.csr import SPARSE_MIN_CLASSES, resolve_format
from spml_cache.labels import SparseLabels, count_positive, same
from spml_cache.linear import run_linear
from spml_cache.runtime.errors import SpmlError


def random_labels(rng, rows=40, classes=9, signed=True):
    dense = (rng.random((rows, classes)) < 0.25).astype(np.int8)
    if signed:
        dense *= rng.choice(np.array([-1, 1], dtype=np.int8), size=dense.shape)
    dense[3] = 0  # an empty row
    return dense


def test_csr_round_trip_rows_columns_and_views():
    rng = np.random.default_rng(0)
    dense = random_labels(rng)
    matrix = SparseLabels.from_dense(dense, block_rows=7)  # several blocks
    assert matrix.shape == dense.shape and len(matrix) == 40 and matrix.nnz == int((dense != 0).sum())
    assert np.array_equal(matrix.to_dense(), dense)
    index = rng.permutation(40)[:11]
    assert np.array_equal(matrix.rows(index), dense[index])
    assert np.array_equal(matrix.rows(np.array([3, 3])), np.zeros((2, 9), np.int8))
    assert np.array_equal(matrix.columns(2, 6, rows=30, dtype=np.int8), dense[:30, 2:6])
    assert np.array_equal(matrix.equal(1).to_dense(), (dense == 1).astype(np.int8))
    assert np.array_equal(matrix.rows_with(-1), (dense == -1).any(axis=1))
    assert np.array_equal(matrix.take(index).to_dense(), dense[index])
    assert count_positive(matrix) == count_positive(dense) == int((dense > 0).sum())
    empty = SparseLabels.from_dense(np.zeros((0, 4), np.int8))
    assert empty.shape == (0, 4) and empty.to_dense().shape == (0, 4)


def test_label_format_choice():
    assert resolve_format("auto", SPARSE_MIN_CLASSES - 1) == "dense"
    assert resolve_format("auto", SPARSE_MIN_CLASSES) == "sparse"
    assert resolve_format("dense", 10**5) == "dense"
    with pytest.raises(SpmlError, match="--labels 'csr'"):
        resolve_format("csr", 5)


def rewritten(source, path, **options):
    """The cache at `source` written again at `path` (its labels and features as loaded), with `options`."""
    loaded = cache.load(source)
    attrs = {key: value for key, value in loaded.attrs.items()
             if key not in ("content_hash", "complete", "schema_version")}
    splits = {}
    for name in cache.SPLITS:
        split = getattr(loaded, name)
        splits[name] = {"features": split.features, "labels": split.labels, "ids": split.ids}
        if split.observed is not None:
            splits[name]["observed"] = split.observed
    return cache.write(path, attrs=attrs, **splits, **options)


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    folder = tmp_path_factory.mktemp("caches")
    dense = write_synthetic_cache(folder / "dense" / "voc-resnet50-448.h5", train=64, val=24, test=32, classes=6)
    return dense, rewritten(dense, folder / "sparse" / "voc-resnet50-448.h5", labels="sparse")


def test_the_cache_stores_csr_and_reads_it_back(caches):
    dense_path, sparse_path = caches
    with h5py.File(dense_path) as file:
        assert isinstance(file["train/labels"], h5py.Dataset)  # few classes: dense, as always
    with h5py.File(sparse_path) as file:
        group = file["train/observed"]
        assert group.attrs["format"] == "csr" and list(group.attrs["shape"]) == [64, 6]
        assert set(group) == {"indptr", "indices", "values"}
    dense, stored = cache.load(dense_path), cache.load(sparse_path)
    for name in cache.SPLITS:
        assert isinstance(getattr(stored, name).labels, SparseLabels)
        assert np.array_equal(getattr(stored, name).labels.to_dense(np.uint8), getattr(dense, name).labels)
    assert np.array_equal(stored.train.observed.to_dense(), dense.train.observed)
    cache.verify(stored)  # the checksum covers the CSR arrays
    attrs, rows = cache.read_header(sparse_path)
    assert rows["val"].observed == stored.val.observed


def test_a_sparse_label_outside_its_values_is_refused(tmp_path, caches):
    path = rewritten(caches[1], tmp_path / "voc-resnet50-448.h5", labels="sparse")
    with h5py.File(path, "r+") as file:
        file["train/labels/values"][0] = 2
    with pytest.raises(SpmlError, match="labels has values outside"):
        cache.load(path)


def test_float16_features_are_stored_half_and_read_as_float32(tmp_path, caches):
    path = rewritten(caches[0], tmp_path / "voc-resnet50-448.h5", features="float16")
    with h5py.File(path) as file:
        assert file["train/features"].dtype == np.float16
    loaded, original = cache.load(path), cache.load(caches[0])
    assert loaded.train.features.dtype == np.float32
    assert np.allclose(loaded.train.features, original.train.features, rtol=1e-3, atol=1e-3)


def test_sparse_and_dense_caches_give_the_same_linear_results(tmp_path, caches):
    results = []
    for path in caches:
        run = run_linear(cache=path, losses=["an", "bce", "role", "ll_r", "crisp"], lrs=[1e-2, 1e-3],
                         batch_sizes=[8, 16], epochs=3, out=tmp_path / path.parent.name, workers=1, console=quiet())
        results.append(run.results["losses"])
    for name in ("an", "bce", "role", "ll_r", "crisp"):  # crisp: its priors read the whole observed matrix
        dense, stored = results[0][name], results[1][name]
        for key in ("selected", "best_epoch", "val_map", "test_map", "train_map", "per_class_ap", "configs"):
            assert stored[key] == dense[key], (name, key)


def test_dense_and_sparse_matrices_compare_by_value():
    dense = random_labels(np.random.default_rng(1))
    matrix = SparseLabels.from_dense(dense)
    assert same(matrix, dense) and same(dense, matrix) and same(dense, dense.copy())
    other = dense.copy()
    other[0, 0] = 1 - other[0, 0]
    assert not same(matrix, other)


def test_observation_rules_on_sparse_labels_draw_the_dense_masks_or_are_refused_in_one_line(caches):
    from spml_cache import observation

    dense, loaded = cache.load(caches[0]), cache.load(caches[1])
    rule = observation.parse_rules("entry:0.5")[0]
    drawn, want = (observation.for_cache(features, [rule])[rule.text] for features in (loaded, dense))
    assert same(drawn.train, want.train) and same(drawn.val, want.val)
    with pytest.raises(SpmlError, match="--observe single") as error:
        observation.for_cache(loaded, observation.parse_rules("largest"))
    assert "\n" not in str(error.value)


def test_selecting_on_observed_val_labels_is_the_same_sparse_or_dense(tmp_path, caches):
    results = [run_linear(cache=path, losses="an", lrs=[1e-2], batch_sizes=[8], epochs=2, val_labels="observed",
                          out=tmp_path / path.parent.name, workers=1, console=quiet()).results["losses"]["an"]
               for path in caches]
    assert results[1]["val_map"] == results[0]["val_map"] and results[1]["test_map"] == results[0]["test_map"]


def test_an_extraction_with_sparse_labels_drops_bad_rows_and_stays_sparse(tmp_path, caches):
    loaded = cache.load(caches[0])
    rows = {name: cache.SplitRows(getattr(loaded, name).ids, getattr(loaded, name).labels,
                                  getattr(loaded, name).observed) for name in cache.SPLITS}
    attrs = {key: value for key, value in loaded.attrs.items()
             if key not in ("content_hash", "complete", "schema_version")}
    final = tmp_path / "voc-resnet50-448.h5"
    partial = cache.PartialCache.create(final, attrs, rows, feature_dim=16, labels="sparse")
    for name in cache.SPLITS:
        count = len(rows[name])
        bad = np.zeros(count, dtype=bool)
        bad[1] = name == "train"
        partial.write_rows(name, np.arange(count), getattr(loaded, name).features, bad)
    path, dropped = partial.finalise({"device": "cpu"})
    assert dropped["train"] == [loaded.train.ids[1]]
    stored = cache.load(path)
    keep = [i for i in range(len(loaded.train)) if i != 1]
    assert isinstance(stored.train.labels, SparseLabels)
    assert np.array_equal(stored.train.labels.to_dense(np.uint8), loaded.train.labels[keep])
    assert np.array_equal(stored.train.observed.to_dense(), loaded.train.observed[keep])
    assert same(cache.read_header(path)[1]["val"].labels, loaded.val.labels)


def test_fine_tuning_starts_from_a_sparse_cache(tmp_path, caches):
    from spml_cache.finetune.settings import FinetuneOptions
    from spml_cache.finetune.start import starting_point

    options = FinetuneOptions(init="imagenet", cache=caches[1], loss="an")
    features, start = starting_point(options, tmp_path, None)  # tests/test_finetune_sparse.py fine-tunes one
    assert start is None and isinstance(features.train.observed, SparseLabels)
