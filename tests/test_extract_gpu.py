"""On a GPU, stage one pads every batch to one shape and decodes in the feed thread (both on by default there);
the cache must be the CPU's: same ids, labels and observed labels, features within the precision's error.

Marked `cuda`: skipped where no CUDA GPU is visible; `python -m pytest -m cuda` runs just these.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from extract_support import random_weights, write_numbered_csv_dataset

from spml_cache import backbone, cache
from spml_cache.errors import SpmlError
from spml_cache.extract import extract, pipeline
from spml_cache.extract.feed import THREAD_NAME

pytestmark = pytest.mark.cuda
RESOLUTION = 64
# Row-relative error (max |gpu - cpu| / max |cpu| per row) allowed against the CPU's fp32 features: fp16
# autocast through 53 convolutions of a random-weights trunk, and fp32 with TF32 off (only summation order).
TOLERANCE = {"fp16": 3e-2, "fp32": 1e-4}
# 30 train-official images -> train 24 (batches 8, 8, 8) and val 6 (one short batch); test 11 (8, 3). The bad
# image sits in the short last test batch, which is padded on the GPU.
BAD = ["images/39.jpg"]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return random_weights(tmp_path_factory)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_numbered_csv_dataset(tmp_path_factory.mktemp("gpu-extract"), 41, first_test=30, bad=tuple(BAD))


def options(weights, device, **overrides):
    return {"weights": str(weights), "resolution": RESOLUTION, "batch_size": 8, "device": device,
            "on_bad_image": "skip", **overrides}  # fmt: skip


@pytest.fixture(scope="module")
def on_cpu(data, weights, tmp_path_factory):
    out = tmp_path_factory.mktemp("cpu") / "cpu.h5"
    return cache.load(extract("csv", data, out=out, **options(weights, "cpu", workers=0)).path)


def row_relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    scale = np.maximum(np.abs(expected).max(axis=1), 1e-12)
    return float((np.abs(got - expected).max(axis=1) / scale).max()) if len(expected) else 0.0


def input_shapes(monkeypatch, dtype) -> set:
    """The shapes of the `dtype` inputs the run's trunk sees (the fp32 recompute of rare rows aside)."""
    shapes, build = set(), backbone.build_trunk

    def hooked(weights):
        trunk, provenance = build(weights)

        def hook(module, args):
            if args[0].dtype == dtype:
                shapes.add(tuple(args[0].shape))

        trunk.register_forward_pre_hook(hook)
        return trunk, provenance

    monkeypatch.setattr(pipeline, "build_trunk", hooked)
    return shapes


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_padded_overlapped_gpu_extraction_gives_the_cpu_cache(data, weights, on_cpu, tmp_path, monkeypatch, precision):
    if precision == "fp32":
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    shapes = input_shapes(monkeypatch, torch.float16 if precision == "fp16" else torch.float32)
    report = extract("csv", data, out=tmp_path / "gpu.h5", **options(weights, "cuda", precision=precision))
    assert shapes == {(8, 3, RESOLUTION, RESOLUTION)}  # every split ends on a short batch: all padded
    assert report.skipped["test"] == BAD
    on_gpu = cache.load(report.path)
    assert "cuda" in on_gpu.attrs["device"] and on_gpu.attrs["precision"] == precision
    for name in cache.SPLITS:
        got, expected = getattr(on_gpu, name), getattr(on_cpu, name)
        assert got.ids == expected.ids
        assert got.labels.tobytes() == expected.labels.tobytes()
        if name != "test":
            assert got.observed.tobytes() == expected.observed.tobytes()
        assert np.isfinite(got.features).all()
        error = row_relative_error(got.features, expected.features)
        assert error <= TOLERANCE[precision], f"{name}: row-relative error {error:.2e}"
    assert not [thread for thread in threading.enumerate() if thread.name == THREAD_NAME]


def test_without_padding_the_gpu_sees_every_short_batch_shape(data, weights, tmp_path, monkeypatch):
    """What padding saves: each new shape is a fresh round of cuDNN autotuning of every convolution."""
    shapes = input_shapes(monkeypatch, torch.float16)
    extract("csv", data, out=tmp_path / "unpadded.h5", **options(weights, "cuda", pad_batches=False))
    assert shapes == {(8, 3, RESOLUTION, RESOLUTION), (6, 3, RESOLUTION, RESOLUTION), (2, 3, RESOLUTION, RESOLUTION)}


def test_a_bad_image_in_the_feed_thread_fails_naming_it_then_resumes(data, weights, on_cpu, tmp_path):
    out = tmp_path / "resumed.h5"
    with pytest.raises(SpmlError, match=r"images/39.jpg cannot be decoded .*--on-bad-image skip") as error:
        extract("csv", data, out=out, **options(weights, "cuda", on_bad_image="fail"))
    assert "\n" not in str(error.value) and not out.exists()
    assert not [thread for thread in threading.enumerate() if thread.name == THREAD_NAME]
    report = extract("csv", data, out=out, **options(weights, "cuda"))
    assert report.resumed == 38  # train 24, val 6, the first test batch 8
    assert cache.load(out).test.ids == on_cpu.test.ids
