"""On a GPU, stage one pads every batch to one shape and decodes in the feed thread (both on by default there);
the cache must be the CPU's: same ids, labels and observed labels, features within the precision's error.

Marked `cuda`: skipped where no CUDA GPU is visible; `python -m pytest -m cuda` runs just these.
"""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest
import torch
from extract_support import random_weights, write_jpeg, write_numbered_csv_dataset

from spml_cache import cache
from spml_cache.backbones import resnet50
from spml_cache.demo.data import make_demo_data
from spml_cache.extract import extract
from spml_cache.extract.feed import THREAD_NAME
from spml_cache.images import decode_jpegs
from spml_cache.runtime.errors import SpmlError

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
    shapes, build = set(), resnet50.build_trunk

    def hooked(weights):
        trunk, provenance = build(weights)

        def hook(module, args):
            if args[0].dtype == dtype:
                shapes.add(tuple(args[0].shape))

        trunk.register_forward_pre_hook(hook)
        return trunk, provenance

    monkeypatch.setattr(resnet50, "build_trunk", hooked)
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


def test_a_gpu_decode_never_overwrites_memory_that_queued_kernels_still_read(tmp_path):
    """torchvision pull request 9606's check, through `decode_jpegs`: tensors the size of the decoded images are
    freed while reductions of them still wait behind ~50 ms of queued work, then a batch of VOC-sized baseline
    JPEGs (what nvjpeg's hardware decoder takes) is decoded. The decoder, handed their memory, would overwrite it
    before the reductions read it; the decode drains the stream first (drain_before_gpu_decode), so
    every reduction sees what was written."""
    device = torch.device("cuda")
    for i in range(8):
        write_jpeg(tmp_path / f"{i}.jpg", seed=i, size=(375, 500))
    blobs = [(tmp_path / f"{i}.jpg").read_bytes() for i in range(8)]
    sizes = [image.numel() for image in decode_jpegs(blobs, "cpu")]  # uint8 [3, H, W]: bytes
    expected = torch.tensor([(j + 1) * size for j, size in enumerate(sizes)], dtype=torch.int64)
    wrong = 0
    for _ in range(50):
        held = [torch.full((size,), j + 1, dtype=torch.uint8, device=device) for j, size in enumerate(sizes)]
        torch.cuda._sleep(100_000_000)  # ~50 ms at 2 GHz: the reductions below wait behind it
        sums = torch.stack([tensor.sum(dtype=torch.int64) for tensor in held])
        del held  # freed on the stream with the reductions still queued: the allocator may hand this memory out
        decode_jpegs(blobs, device)
        wrong += int(not torch.equal(sums.cpu(), expected))
    assert wrong == 0, f"{wrong} of 50 decodes overwrote memory that queued reductions still read"


def test_fp16_extraction_at_448_px_recomputes_nothing_and_gives_the_cpu_fp32_features(tmp_path):
    """1,000 demo images at 448 px, where fp16 extraction once wrote a batch of non-finite rows (the nvjpeg race
    is the suspect): on the GPU no row may need the fp32 recompute, and every row must be the CPU's fp32 row
    within fp16's error (relative L2 distance 1e-2; rows corrupted but finite would miss it)."""
    root = make_demo_data(tmp_path / "data", num_train=700, num_test=300, size=448, seed=1)
    on_gpu = extract("voc", root, out=tmp_path / "gpu.h5", weights="none", resolution=448, device="cuda")
    assert sum(on_gpu.counts.values()) == 1000 and on_gpu.precision == "fp16"
    assert on_gpu.recomputed == {name: 0 for name in cache.SPLITS}, on_gpu.recomputed
    gpu = cache.load(on_gpu.path)
    assert json.loads(gpu.attrs["recomputed_fp32"]) == {}
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # the CPU reference: 1,000 images at 448 px in fp32
    try:
        on_cpu = extract("voc", root, out=tmp_path / "cpu.h5", weights="none", resolution=448, device="cpu")
    finally:
        torch.set_num_threads(threads)
    cpu = cache.load(on_cpu.path)
    for name in cache.SPLITS:
        got, expected = getattr(gpu, name), getattr(cpu, name)
        assert got.ids == expected.ids
        distance = np.linalg.norm(got.features - expected.features, axis=1)
        relative = distance / np.maximum(np.linalg.norm(expected.features, axis=1), 1e-12)
        worst = int(relative.argmax())
        assert relative[worst] <= 1e-2, (f"{name}: {int((relative > 1e-2).sum())} rows differ from the CPU's fp32 rows"
                                         f" by more than 1e-2, worst {relative[worst]:.2e} at {got.ids[worst]}")
