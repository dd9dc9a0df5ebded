"""Stage one's GPU-speed machinery, forced on the CPU: batches padded to one shape, the feed thread, the pinned
buffer ring. None of it may change the cache: ids, labels and observed labels byte-identical, features within
float tolerance (eval-mode batchnorm keeps rows independent, so only the convolutions' summation order may
differ)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from extract_support import write_numbered_csv_dataset

from spml_cache import cache
from spml_cache.backbones import resnet50
from spml_cache.extract import extract
from spml_cache.extract.feed import Feed, THREAD_NAME
from spml_cache.extract.writer import HostRing
from spml_cache.runtime.errors import Interrupted, SpmlError

pytestmark = pytest.mark.filterwarnings("ignore::spml_cache.backbones.checkpoints.RandomWeightsWarning")
FORCED = {"pad_batches": True, "feed_thread": True}
# Largest difference of a row over its largest value, float32 on the CPU: oneDNN's algorithm may depend on the
# batch size; measured up to 2e-6 (padded batches of 4 against unpadded ones of 3).
TOLERANCE = 1e-5
# 12 train-official images -> train 10 (batches 4, 4, 2) and val 2 (one batch of 2); test 5 (4, 1). 13.jpg,
# in the first test batch, cannot be decoded, and 11.jpg sits in train's or val's short last batch.
BAD = ["images/13.jpg"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_numbered_csv_dataset(tmp_path_factory.mktemp("overlap"), 17, first_test=12, bad=tuple(BAD))


def options(**overrides):
    return {"weights": "none", "resolution": 32, "batch_size": 4, "workers": 0, "device": "cpu",
            "on_bad_image": "skip", **overrides}  # fmt: skip


@pytest.fixture(scope="module")
def plain(data, tmp_path_factory):
    return cache.load(extract("csv", data, out=tmp_path_factory.mktemp("plain") / "plain.h5", **options()).path)


def row_relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    """max over rows of max |got - expected| / max |expected|: a feature's error on the scale of its row."""
    scale = np.maximum(np.abs(expected).max(axis=1), 1e-12)
    return float((np.abs(got - expected).max(axis=1) / scale).max()) if len(expected) else 0.0


def assert_same_cache(got, expected):
    for name in cache.SPLITS:
        a, b = getattr(got, name), getattr(expected, name)
        assert a.ids == b.ids, name
        assert a.labels.dtype == b.labels.dtype and a.labels.tobytes() == b.labels.tobytes(), name
        if name != "test":
            assert a.observed.dtype == b.observed.dtype and a.observed.tobytes() == b.observed.tobytes(), name
        assert row_relative_error(a.features, b.features) <= TOLERANCE, name
    assert got.attrs["skipped_images"] == expected.attrs["skipped_images"]


def count_input_shapes(monkeypatch) -> set:
    """The input shapes the run's trunk sees (a forward pre-hook on the trunk `extract` builds)."""
    shapes, build = set(), resnet50.build_trunk

    def hooked(weights):
        trunk, provenance = build(weights)
        trunk.register_forward_pre_hook(lambda module, args: shapes.add(tuple(args[0].shape)))
        return trunk, provenance

    monkeypatch.setattr(resnet50, "build_trunk", hooked)
    return shapes


def feed_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == THREAD_NAME and thread.is_alive()]


@pytest.mark.parametrize("forced", [{"pad_batches": True}, FORCED], ids=["padded", "padded-fed"])
def test_padded_batches_give_the_same_cache_through_one_input_shape(data, plain, tmp_path, monkeypatch, forced):
    shapes = count_input_shapes(monkeypatch)
    report = extract("csv", data, out=tmp_path / "padded.h5", **options(**forced))
    assert shapes == {(4, 3, 32, 32)}  # short last batches and the batch with a bad image, all padded
    assert report.skipped["test"] == BAD
    assert_same_cache(cache.load(report.path), plain)
    assert not feed_threads()


def test_padding_is_off_on_the_cpu_by_default(data, tmp_path, monkeypatch):
    shapes = count_input_shapes(monkeypatch)
    extract("csv", data, out=tmp_path / "default.h5", **options(limit=3))
    assert shapes == {(3, 3, 32, 32), (2, 3, 32, 32)}  # train 3, val 2, test 3 of which one is bad


def test_fed_run_fails_naming_the_bad_image_then_resumes_padded_to_the_same_cache(data, plain, tmp_path):
    out = tmp_path / "resumed.h5"
    with pytest.raises(SpmlError, match=r"images/13.jpg cannot be decoded .*--on-bad-image skip") as error:
        extract("csv", data, out=out, **options(on_bad_image="fail", **FORCED))
    assert "\n" not in str(error.value) and str(cache.partial_path(out)) in str(error.value)
    assert not out.exists() and cache.partial_path(out).exists() and not feed_threads()
    report = extract("csv", data, out=out, **options(**FORCED))
    assert report.resumed == 12  # train and val were written before the test batch failed
    assert_same_cache(cache.load(out), plain)


def test_an_interrupt_in_the_main_thread_stops_the_feed_thread(data, tmp_path, monkeypatch):
    calls, build = [], resnet50.build_trunk

    def interrupting(weights):
        trunk, provenance = build(weights)

        def hook(module, args):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt

        trunk.register_forward_pre_hook(hook)
        return trunk, provenance

    monkeypatch.setattr(resnet50, "build_trunk", interrupting)
    out = tmp_path / "interrupted.h5"
    with pytest.raises(Interrupted, match="4 of 17 images are kept"):
        extract("csv", data, out=out, **options(**FORCED))
    assert not feed_threads()


def test_an_error_in_the_feed_thread_is_raised_in_the_main_thread():
    def loader():
        yield "train", np.arange(2), [b"x", b"y"], np.zeros(2, dtype=bool), None
        raise ValueError("the loader broke")

    def decode(blobs, bad):
        return torch.zeros((len(blobs), 3, 8, 8), dtype=torch.uint8), None

    feed = Feed(loader(), decode, device=torch.device("cpu"), dtype=torch.float32, rows=4, resolution=8, pad=True)
    got = []
    try:
        with pytest.raises(ValueError, match="the loader broke"):
            for batch in feed:
                got.append((batch.num_good, tuple(batch.inputs.shape)))
                feed.release(batch)
    finally:
        feed.close()
    assert got == [(2, (4, 3, 8, 8))] and not feed.thread.is_alive()


class FakeEvent:
    def __init__(self) -> None:
        self.done = True

    def query(self) -> bool:
        return self.done


def test_the_host_ring_never_hands_out_a_buffer_in_flight():
    made = []
    ring = HostRing(2, allocate=lambda shape, dtype: made.append(shape) or torch.empty(shape, dtype=dtype),
                    new_event=FakeEvent)  # fmt: skip
    first, second = ring.take(4, 8), ring.take(3, 8)
    assert first is not second and made == [(4, 8), (4,), (3, 8), (3,)]
    with pytest.raises(RuntimeError, match="still in flight"):
        ring.take(4, 8)  # both out: the first one's batch has not been written yet
    first.ready.done = False
    with pytest.raises(RuntimeError, match="before its copies completed"):
        ring.give_back(first)
    first.ready.done = True
    ring.give_back(first)
    again = ring.take(2, 8)
    assert again is first and len(made) == 4  # reused, not allocated again
    with pytest.raises(RuntimeError, match="still in flight"):
        ring.take(4, 8)  # the turn is the second's, still out
    ring.give_back(second)
    assert ring.take(4, 8) is second and made[-2:] == [(4, 8), (4,)]  # grown to the larger batch
