"""Stage one end to end on tiny datasets in their real layouts: schema, row alignment, observed labels, resume,
--limit, --dry-run, --force, bad images, unwritable output."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import torch
from cli_support import run_cli
from extract_support import (
    REPO,
    RESOLUTION,
    random_weights,
    truncate,
    write_coco_dataset,
    write_csv_dataset,
    write_cub_dataset,
    write_jpeg,
)

from spml_cache import cache, datasets, protocol
from spml_cache.backbones.resnet50 import build_trunk
from spml_cache.demo.data import make_demo_data
from spml_cache.extract import extract
from spml_cache.images import decode_jpegs, preprocess
from spml_cache.runtime.errors import SpmlError

VOC_CLASSES = ["aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow", "diningtable",
               "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor"]  # fmt: skip
ROOT_ATTRS = {"schema_version", "dataset", "classes", "num_classes", "backbone", "weights", "resolution", "resize",
              "mean", "std", "feature_dim", "created", "package_version", "torch_version", "torchvision_version",
              "device", "split_seed", "val_frac", "observe_seed", "num_pos", "num_neg", "expected_positives",
              "complete"}  # fmt: skip


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return random_weights(tmp_path_factory)


def options(weights, **overrides):
    return {"weights": str(weights), "resolution": RESOLUTION, "batch_size": 8, "workers": 0, "device": "cpu",
            **overrides}  # fmt: skip


@pytest.fixture(scope="module")
def voc(tmp_path_factory, weights):
    """The demo VOC dataset and one complete extraction of it."""
    root = make_demo_data(tmp_path_factory.mktemp("voc"), num_train=10, num_test=4, size=40)
    out = tmp_path_factory.mktemp("voc-cache") / "voc.h5"
    report = extract("voc", root, out=out, **options(weights))
    return root, report


def reference_rows(dataset, root):
    """The protocol restated: official train rows -> observed labels drawn over all of them, then the split."""
    images = datasets.read(dataset, root)
    train_rows, val_rows = protocol.split_train_val(len(images.train.ids))
    observed = protocol.observe_labels(images.train.labels, num_pos=1, num_neg=0, seed=1200)
    pick = lambda rows: ([images.train.ids[i] for i in rows], images.train.labels[rows], observed[rows])  # noqa: E731
    test = (images.test.ids, images.test.labels, None)
    return images, {"train": pick(train_rows), "val": pick(val_rows), "test": test}


_TRUNKS: dict = {}


def recomputed(weights, root, ids):
    """Features of `ids` straight from the backbone (no loader, no cache), in one batch."""
    if weights not in _TRUNKS:
        _TRUNKS[weights] = build_trunk(str(weights))[0].eval()
    images = decode_jpegs([(root / image_id).read_bytes() for image_id in ids])
    with torch.no_grad():
        return _TRUNKS[weights](preprocess(images, RESOLUTION)).numpy()


def check_cache(path, dataset, root, weights, expected_labels=None):
    """Schema, dtypes, labels and observed labels against the restated protocol; a few rows recomputed."""
    images, reference = reference_rows(dataset, root)
    with h5py.File(path, "r") as file:
        assert ROOT_ATTRS <= set(file.attrs)
        assert file.attrs["schema_version"] == 1 and bool(file.attrs["complete"])
        for name in ("train", "val", "test"):
            assert file[name]["features"].dtype == np.float32 and file[name]["labels"].dtype == np.uint8
            assert file[name]["done"].dtype == bool
            if name != "test":
                assert file[name]["observed"].dtype == np.int8
    loaded = cache.load(path)
    assert loaded.classes == images.classes and loaded.dataset == dataset
    assert loaded.attrs["weights"] == "sha256:" + hashlib.sha256(weights.read_bytes()).hexdigest()
    assert loaded.attrs["num_classes"] == len(images.classes) and loaded.attrs["feature_dim"] == 2048
    assert loaded.attrs["resolution"] == RESOLUTION and loaded.attrs["device"] == "cpu"
    assert (loaded.attrs["split_seed"], loaded.attrs["observe_seed"], loaded.attrs["val_frac"]) == (1200, 1200, 0.2)
    for name in ("train", "val", "test"):
        split, (ids, labels, observed) = getattr(loaded, name), reference[name]
        assert split.ids == ids and split.features.shape == (len(ids), 2048)
        np.testing.assert_array_equal(split.labels, labels)
        if observed is not None:
            np.testing.assert_array_equal(split.observed, observed)
        if expected_labels is not None:  # the labels restated from what the test wrote on disk
            for image_id, row in zip(split.ids, split.labels):
                assert {loaded.classes[c] for c in np.flatnonzero(row)} == expected_labels[image_id]
    few = {name: [0, len(reference[name][0]) - 1] for name in ("train", "val", "test")}
    expected = recomputed(weights, images.root, [reference[name][0][i] for name in few for i in few[name]])
    got = np.concatenate([getattr(loaded, name).features[few[name]] for name in few])
    assert np.abs(expected[0] - expected[1]).max() > 0.1  # images are told apart, so a shifted row would show
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    return loaded


def test_voc_extraction_follows_the_schema_and_the_protocol(voc, weights):
    root, report = voc
    assert report.status == "written" and report.counts == {"train": 8, "val": 2, "test": 4}
    assert report.extracted == 14 and report.resumed == 0
    loaded = check_cache(report.path, "voc", root, weights)
    assert loaded.classes == VOC_CLASSES
    assert not cache.partial_path(report.path).exists()
    with h5py.File(report.path, "r") as file:  # without --observe, no observation rules beside single's
        assert "observed_rules" not in file["train"] and "observed_rules" not in file["val"]


@pytest.mark.parametrize("layout", ["coco", "cub", "csv"])
def test_other_layouts_extract_with_aligned_rows(tmp_path, weights, layout):
    root = tmp_path / "data"
    if layout == "coco":
        expected = write_coco_dataset(root, num_train=6, num_test=3)
    elif layout == "cub":
        expected = write_cub_dataset(root, num_images=8)
    else:
        labels = [["a"], ["a", "b"], ["b"], ["c"], ["a"], ["a", "b"], ["b"], ["c", "a"]]
        rows = [(f"{k}.jpg", labels[k], "test" if k >= 6 else "train") for k in range(8)]
        expected = write_csv_dataset(root, rows)
    report = extract(layout, root, out=tmp_path / "out.h5", **options(weights))
    loaded = check_cache(report.path, layout, root, weights, expected_labels=expected)
    if layout == "coco":
        assert loaded.classes == ["person", "car", "train"]  # ascending category id, not name order


def test_limit_keeps_the_observed_labels_of_the_full_run(voc, tmp_path, weights):
    root, full = voc
    report = extract("voc", root, out=tmp_path / "limited.h5", limit=3, **options(weights))
    assert report.counts == {"train": 3, "val": 2, "test": 3}
    limited, whole = cache.load(report.path), cache.load(full.path)
    for name in ("train", "val", "test"):
        part, everything = getattr(limited, name), getattr(whole, name)
        assert part.ids == everything.ids[:3]
        np.testing.assert_allclose(part.features, everything.features[:3], rtol=1e-4, atol=1e-4)
        if name != "test":
            np.testing.assert_array_equal(part.observed, everything.observed[:3])
    assert limited.attrs["limit"] == 3


def test_dry_run_reports_and_writes_nothing(voc, tmp_path, weights):
    root, _ = voc
    out = tmp_path / "out" / "voc.h5"
    report = extract("voc", root, out=out, dry_run=True, **options(weights))
    assert report.status == "dry run" and report.counts == {"train": 8, "val": 2, "test": 4}
    assert report.size_bytes >= 14 * 2048 * 4
    assert not (tmp_path / "out").exists()
    rows = [(f"{k}.jpg", ["a"], "test" if k >= 4 else "train") for k in range(6)]
    write_csv_dataset(tmp_path / "csv", rows)
    (tmp_path / "csv" / "images" / "1.jpg").unlink()
    report = extract("csv", tmp_path / "csv", out=out, dry_run=True, **options(weights))
    assert report.missing == ["images/1.jpg"] and any("--skip-missing" in note for note in report.notes)
    assert not (tmp_path / "out").exists()


def test_complete_cache_is_kept_other_settings_refused_force_rebuilds(voc, tmp_path, weights):
    root, full = voc
    out = tmp_path / "voc.h5"
    out.write_bytes(full.path.read_bytes())
    before = cache.cache_id(cache.load(out).attrs)
    again = extract("voc", root, out=out, **options(weights))
    assert again.status == "up to date" and again.extracted == 0
    assert cache.cache_id(cache.load(out).attrs) == before
    with pytest.raises(SpmlError, match=r"other settings \(resolution: 32 in the file, 48 now\).*--force"):
        extract("voc", root, out=out, **options(weights, resolution=48))
    rebuilt = extract("voc", root, out=out, force=True, **options(weights, resolution=48, limit=1))
    assert rebuilt.status == "written" and cache.load(out).attrs["resolution"] == 48


def test_a_file_that_is_not_a_cache_is_never_replaced(voc, tmp_path, weights):
    root, _ = voc
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    for force in (False, True):
        with pytest.raises(SpmlError, match=f"{notes} exists and is not an HDF5 cache: pick another --out"):
            extract("voc", root, out=notes, force=force, **options(weights))
    assert notes.read_text() == "my notes\n"


def test_bad_image_fails_naming_it_then_skip_resumes_and_drops_its_row(tmp_path, weights):
    rows = [(f"{k}.jpg", ["a", "b"][: 1 + k % 2], "test" if k >= 6 else "train") for k in range(9)]
    write_csv_dataset(tmp_path, rows)
    truncate(tmp_path / "images" / "7.jpg")
    out = tmp_path / "out.h5"
    with pytest.raises(SpmlError, match=r"images/7.jpg cannot be decoded .*--on-bad-image skip") as error:
        extract("csv", tmp_path, out=out, **options(weights))
    assert "\n" not in str(error.value)
    assert not out.exists() and cache.partial_path(out).exists()  # progress kept, nothing half-final
    report = extract("csv", tmp_path, out=out, on_bad_image="skip", **options(weights))
    assert report.resumed == 6  # train 5 + val 1 were written before the failure
    assert report.skipped["test"] == ["images/7.jpg"] and report.counts["test"] == 2
    loaded = cache.load(out)
    assert loaded.test.ids == ["images/6.jpg", "images/8.jpg"]
    assert json.loads(loaded.attrs["skipped_images"]) == {"test": ["images/7.jpg"]}
    expected = recomputed(weights, tmp_path, loaded.test.ids)
    np.testing.assert_allclose(loaded.test.features, expected, rtol=1e-4, atol=1e-4)


def test_unwritable_output_is_a_clear_error(voc, tmp_path, weights):
    root, _ = voc
    (tmp_path / "file").write_text("")
    with pytest.raises(SpmlError, match="cannot create the output folder"):
        extract("voc", root, out=tmp_path / "file" / "sub" / "voc.h5", **options(weights))


def done_rows(partial):
    with h5py.File(partial, "r", locking=False) as file:
        return sum(int(file[name]["done"][...].sum()) for name in ("train", "val", "test"))


def test_killed_extraction_resumes_to_the_uninterrupted_result(tmp_path, weights):
    # The last test image is a named pipe: the run blocks reading it after writing every earlier batch, so
    # the kill lands at a known row count without relying on timing.
    rows = [(f"{k}.jpg", ["a", "b"][: 1 + k % 3 // 2], "test" if k >= 10 else "train") for k in range(14)]
    write_csv_dataset(tmp_path / "data", rows)
    blocker = tmp_path / "data" / "images" / "13.jpg"
    blocker.unlink()
    os.mkfifo(blocker)
    out = tmp_path / "out.h5"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "spml_cache", "extract", "csv", "--root", "data", "--out", "out.h5",
               "--weights", str(weights), "--resolution", str(RESOLUTION), "--batch-size", "4", "--workers", "0",
               "--device", "cpu"]  # fmt: skip
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300  # a guard against hanging forever, not a timing assumption
        written = 0
        while written < 10:  # train 8 + val 2 are written; the test batch waits on the pipe
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "the extraction never reached the pipe"
            time.sleep(0.2)
            if cache.partial_path(out).exists():
                try:
                    written = done_rows(cache.partial_path(out))
                except OSError:  # caught mid-creation
                    written = 0
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert not out.exists() and done_rows(cache.partial_path(out)) == 10
    blocker.unlink()
    write_jpeg(blocker, seed=13)
    resumed = extract("csv", tmp_path / "data", out=out, **options(weights))
    assert (resumed.resumed, resumed.extracted) == (10, 4)
    whole = extract("csv", tmp_path / "data", out=tmp_path / "whole.h5", **options(weights))
    first, second = cache.load(resumed.path), cache.load(whole.path)
    for name in ("train", "val", "test"):
        assert getattr(first, name).ids == getattr(second, name).ids
        np.testing.assert_allclose(getattr(first, name).features, getattr(second, name).features, rtol=1e-4, atol=1e-4)


def test_cli_bad_image_is_one_red_line(tmp_path, weights):
    write_csv_dataset(tmp_path, [("0.jpg", ["a"], "train"), ("1.jpg", ["b"], "train"), ("2.jpg", ["a"], "test")])
    truncate(tmp_path / "images" / "2.jpg")
    result = run_cli("extract", "csv", "--root", ".", "--out", "o.h5", "--weights", str(weights), "--resolution",
                     str(RESOLUTION), "--device", "cpu", "--workers", "0", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "images/2.jpg cannot be decoded" in lines[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "o.h5").exists()


def test_cli_counts_only_the_images_kept_after_skipping_a_bad_one(tmp_path, weights):
    write_csv_dataset(tmp_path, [("0.jpg", ["a"], "train"), ("1.jpg", ["b"], "train"), ("2.jpg", ["a"], "test"),
                                 ("3.jpg", ["b"], "test")])
    truncate(tmp_path / "images" / "2.jpg")
    result = run_cli("extract", "csv", "--root", ".", "--out", "o.h5", "--weights", str(weights), "--resolution",
                     str(RESOLUTION), "--device", "cpu", "--workers", "0", "--on-bad-image", "skip", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "extracted 3 images in" in result.stdout and ", 1 left out" in result.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="names the holder from Linux's /proc")
def test_a_partial_file_another_program_reads_asks_to_close_it_not_to_throw_the_images_away(tmp_path, weights):
    """HDF5 locks a file that a program has open for reading (h5py, HDFView) against writers: resuming then said
    "delete it or pass --force", which extracts every kept image again (issue 56). The line names the program."""
    rows = [(f"{k}.jpg", ["a", "b"][: 1 + k % 2], "test" if k >= 6 else "train") for k in range(9)]
    write_csv_dataset(tmp_path, rows)
    truncate(tmp_path / "images" / "7.jpg")
    out = tmp_path / "out.h5"
    with pytest.raises(SpmlError, match="cannot be decoded"):
        extract("csv", tmp_path, out=out, **options(weights))
    partial = cache.partial_path(out)
    reader = subprocess.Popen([sys.executable, "-c", f"import h5py, sys; f = h5py.File({str(partial)!r}, 'r');"
                               " print('open', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline() == "open\n"
        with pytest.raises(SpmlError) as refused:
            extract("csv", tmp_path, out=out, on_bad_image="skip", **options(weights))
    finally:
        reader.communicate("")
    name = os.path.basename(sys.executable)[:15]  # as /proc/PID/comm holds it
    assert str(refused.value) == (f"cannot resume from {partial}: another program has it open (process {reader.pid}"
                                  f" ({name})), and HDF5 keeps a file open for reading from being written: close it"
                                  " there, then run the same command again (the 6 images done are kept)")
    assert extract("csv", tmp_path, out=out, on_bad_image="skip", **options(weights)).resumed == 6
