"""Stage three on a cache that stores its labels sparse (CSR): the same rows stored dense and sparse give the same
fine-tuning results (train losses, val and test mAP, per-class AP, scores), for `an`, ROLE (per-row state), `crisp`
(class priors from every training row) and the `bce` oracle (full labels per batch), with and without label masks (partial labels); a sparse split is scored a
block of classes at a time with the figures of the dense one."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from spml_cache import cache, extract, finetune, metrics
from spml_cache import labels as label_matrices
from spml_cache.demo import data as demo_data
from spml_cache.finetune import labels as finetune_labels
from spml_cache.labels import SparseLabels

pytestmark = pytest.mark.filterwarnings("ignore::spml_cache.backbones.checkpoints.RandomWeightsWarning")


def stored_as(source: Path, path: Path, labels: str, masked: bool) -> Path:
    """The cache at `source` written again at `path` with labels stored `labels` (dense or sparse); `masked`: val
    and test get a label mask (about a third of their entries unannotated, each class keeping a positive)."""
    loaded = cache.load(source)
    attrs = {key: value for key, value in loaded.attrs.items()
             if key not in ("content_hash", "complete", "schema_version")}
    rng, splits = np.random.default_rng(1), {}
    for name in cache.SPLITS:
        split = getattr(loaded, name)
        splits[name] = {"features": split.features, "labels": split.labels, "ids": split.ids}
        if split.observed is not None:
            splits[name]["observed"] = split.observed
        if masked and name != "train":
            mask = (rng.random(split.labels.shape) < 0.67).astype(np.uint8)
            mask[0] = 1  # the first row keeps every label: val's and test's scored classes never depend on the draw
            splits[name]["label_mask"] = mask
    return cache.write(path, attrs=attrs, **splits, labels=labels)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("finetune-sparse")
    root = demo_data.make_demo_data(base / "data", num_train=16, num_test=6, size=40, seed=0)
    source = extract.extract("voc", root, out=base, backbone="timm:resnet10t", weights="none", resolution=32,
                             batch_size=8, workers=0, device="cpu").path
    caches = {(labels, masked): stored_as(source, base / f"{labels}-{masked}" / source.name, labels, masked)
              for labels in ("dense", "sparse") for masked in (False, True)}
    return SimpleNamespace(base=base, root=root, caches=caches)


def fine_tuned(world, loss: str, labels: str, masked: bool) -> dict:
    path = world.caches[(labels, masked)]
    results = finetune.finetune(init="imagenet", cache=path, root=world.root, loss=loss, lrs=[1e-4],
                                batch_sizes=[4], epochs=2, workers=0, device="cpu",
                                out=world.base / f"runs-{loss}-{labels}-{masked}")
    run_dir = Path(results["run_dir"])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scores = dict(np.load(next((run_dir / "scores").glob("*.npz"))))
    return {"entry": results["losses"][loss], "metrics": metrics, "scores": scores, "run_dir": run_dir}


def assert_close(first, second, where="") -> None:
    """Equal structures, numbers within float tolerance (timings left out)."""
    if isinstance(first, dict):
        assert set(first) == set(second), where
        for key in first:
            if key != "seconds":
                assert_close(first[key], second[key], f"{where}.{key}")
    elif isinstance(first, (list, tuple)):
        assert len(first) == len(second), where
        for index, (a, b) in enumerate(zip(first, second)):
            assert_close(a, b, f"{where}[{index}]")
    elif isinstance(first, float) or isinstance(second, float):
        assert first == pytest.approx(second, rel=1e-5, abs=1e-6), where
    else:
        assert first == second, where


@pytest.mark.parametrize("loss,masked", [("an", False), ("an", True), ("role", False), ("role", True),
                                         ("bce", False), ("crisp", False)])
def test_sparse_and_dense_labels_fine_tune_alike(world, one_thread, loss, masked):
    dense, stored = (fine_tuned(world, loss, labels, masked) for labels in ("dense", "sparse"))
    assert isinstance(cache.load(world.caches[("sparse", masked)]).train.observed, SparseLabels)
    assert dense["entry"]["selected"] is not None and len(dense["metrics"]) == 3  # epochs 0 (the start), 1, 2
    assert_close(dense["entry"], stored["entry"], loss)
    assert_close(dense["metrics"], stored["metrics"], "metrics")
    for split, values in dense["scores"].items():
        np.testing.assert_allclose(stored["scores"][split].astype(np.float32), values.astype(np.float32), atol=1e-3)
    # labels.npz is written for a dense cache only (as stage two: report's label figures read dense matrices)
    assert (dense["run_dir"] / "labels.npz").is_file() and not (stored["run_dir"] / "labels.npz").exists()
    # the test labels of report's metrics beside mAP: kept in the cache's form, CSR for a sparse one
    assert "labels_csr_indptr" in np.load(stored["run_dir"] / "test_labels.npz")
    assert ("mask_csr_indptr" in np.load(stored["run_dir"] / "test_labels.npz")) == masked


def test_a_split_is_scored_in_blocks_of_classes_as_if_at_once(monkeypatch):
    """labels.average_precision scores a block of classes at a time, dense or sparse: the same AP and mAP as
    metrics.py over the whole matrix at once."""
    rng = np.random.default_rng(0)
    labels = (rng.random((30, 7)) < 0.3).astype(np.uint8)
    mask = (rng.random((30, 7)) < 0.7).astype(np.uint8)
    scores = torch.from_numpy(rng.random((30, 7)).astype(np.float32))
    monkeypatch.setattr(label_matrices, "SCORED_BLOCK_ENTRIES", 30 * 3)  # blocks of 3, 3 and 1 classes
    for given_mask in (None, mask):
        whole_mask = None if given_mask is None else torch.from_numpy(given_mask)
        whole_ap = metrics.average_precision(scores, torch.from_numpy(labels), whole_mask)
        scored = None if given_mask is None else metrics.scored_classes(torch.from_numpy(labels), whole_mask)
        whole_map = float(metrics.mean_over_classes(whole_ap, scored))
        sparse_mask = None if given_mask is None else SparseLabels.from_dense(given_mask)
        for matrix, matrix_mask in ((labels, given_mask), (SparseLabels.from_dense(labels), sparse_mask)):
            ap, mean = label_matrices.average_precision(scores, matrix, matrix_mask)
            assert torch.equal(ap, whole_ap) and mean == whole_map


def test_a_sparse_batch_is_built_from_its_rows():
    rng = np.random.default_rng(2)
    observed = (rng.random((12, 5)) < 0.3).astype(np.int8) * rng.choice(np.array([-1, 1], np.int8), (12, 5))
    full = (rng.random((12, 5)) < 0.4).astype(np.uint8)
    device, index = torch.device("cpu"), torch.tensor([7, 2, 2, 11])
    dense = finetune_labels.TrainLabels(observed, full, device)
    stored = finetune_labels.TrainLabels(SparseLabels.from_dense(observed), SparseLabels.from_dense(full), device)
    for oracle in (False, True):
        (dense_observed, dense_full), (sparse_observed, sparse_full) = (
            labels.batch(index, index.to(device), oracle) for labels in (dense, stored))
        assert torch.equal(dense_observed, sparse_observed) and sparse_observed.dtype == torch.int8
        assert torch.equal(dense_full, sparse_full) if oracle else dense_full is None and sparse_full is None
    assert finetune_labels.loss_observed("an", SparseLabels.from_dense(observed)) is None
    assert torch.equal(finetune_labels.loss_observed("an", observed), torch.from_numpy(observed))
    assert torch.equal(finetune_labels.loss_observed("role", SparseLabels.from_dense(observed)),
                       torch.from_numpy(observed))
