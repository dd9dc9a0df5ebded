"""Partial labels (docs/protocol.md, "The metric"): a CSV with unknown cells, the cache's label masks, observation
rules that never observe an unknown, and test mAP over the annotated entries only, checked with scikit-learn."""

import json

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score

from cli_support import run_cli
from extract_support import write_jpeg
from spml_cache import cache, datasets, observation, runs

CLASSES = ("cat", "dog", "owl")


def cells(k: int) -> list[str]:
    """Row k's cells: 1 / 0 / -1 / blank in a fixed pattern; the owl is never annotated positive in test."""
    pattern = [("1", "0", ""), ("0", "1", "-1"), ("1", "", "1"), ("", "0", "0"), ("0", "-1", "1"), ("1", "1", "")]
    return list(pattern[k % len(pattern)])


def write_wide_csv(root, count=36, first_test=24):
    lines = ["path,split," + ",".join(CLASSES)]
    for k in range(count):
        write_jpeg(root / "images" / f"{k}.jpg", seed=k)
        row = cells(k)
        if k >= first_test:
            row[2] = "0" if row[2] == "1" else row[2]
        lines.append(f"images/{k}.jpg,{'test' if k >= first_test else 'train'}," + ",".join(row))
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    return root


def expected_matrices(rows):
    labels = np.array([[cell == "1" for cell in row] for row in rows], dtype=np.uint8)
    mask = np.array([[cell in ("1", "0") for cell in row] for row in rows], dtype=np.uint8)
    return labels, mask


def test_the_wide_csv_reads_labels_and_masks(tmp_path):
    images = datasets.read("csv", write_wide_csv(tmp_path))
    assert images.classes == list(CLASSES)  # the header's order
    rows = [cells(k) for k in range(24)]
    labels, mask = expected_matrices(rows)
    np.testing.assert_array_equal(images.train.labels, labels)
    np.testing.assert_array_equal(images.train.mask, mask)
    assert images.test.mask is not None and images.test.mask.shape == (12, 3)


def test_a_wide_csv_without_unknown_cells_is_fully_labelled(tmp_path):
    write_jpeg(tmp_path / "a.jpg", seed=1)
    write_jpeg(tmp_path / "b.jpg", seed=2)
    (tmp_path / "labels.csv").write_text("path,split,x,y\na.jpg,train,1,0\nb.jpg,test,0,1\n")
    images = datasets.read("csv", tmp_path)
    assert images.train.mask is None and images.test.mask is None


def test_rules_never_observe_an_unannotated_label(tmp_path):
    labels = np.array([[1, 0, 0], [0, 1, 0], [1, 0, 1], [0, 1, 1]], dtype=np.uint8)
    mask = np.array([[1, 0, 1], [1, 1, 0], [0, 1, 1], [1, 1, 1]], dtype=np.uint8)
    rule = observation.parse_rules("entry:1.0")[0]  # every entry observed, but for the unannotated ones
    train, val = observation.draw_splits(rule, labels, labels, {}, label_masks=(mask, None))
    np.testing.assert_array_equal(train, np.where(mask == 1, 2 * labels.astype(np.int8) - 1, 0))
    np.testing.assert_array_equal(val, 2 * labels.astype(np.int8) - 1)


@pytest.fixture(scope="module")
def partial_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("partial")
    write_wide_csv(folder / "data")
    done = run_cli("extract", "csv", "--root", str(folder / "data"), "--out", str(folder / "c.h5"), "--weights",
                   "none", "--resolution", "32", "--workers", "0", "--device", "cpu", cwd=folder)
    assert done.returncode == 0, done.stderr
    done = run_cli("linear", "--cache", str(folder / "c.h5"), "--loss", "an,bce_observed", "--lr", "1e-2",
                   "--batch-size", "8", "--epochs", "2", "--out", str(folder / "runs"), "--device", "cpu",
                   "--workers", "0", cwd=folder)
    assert done.returncode == 0, done.stderr
    run_dir = next(path.parent for path in (folder / "runs").rglob("results.json"))
    return folder / "c.h5", run_dir


def test_the_cache_keeps_the_label_masks(partial_run):
    features = cache.load(partial_run[0])
    assert features.test.label_mask is not None and features.train.label_mask is not None
    annotated = {split: getattr(features, split).label_mask for split in ("train", "val", "test")}
    assert all(mask.dtype == np.uint8 and set(np.unique(mask)) <= {0, 1} for mask in annotated.values())
    # single's one positive is an annotated positive; nothing unannotated is observed
    assert ((features.train.observed != 0) <= (features.train.label_mask == 1)).all()
    cache.verify(features)


def test_test_map_is_taken_over_annotated_entries(partial_run):
    path, run_dir = partial_run
    features = cache.load(path)
    results = json.loads((run_dir / "results.json").read_text())
    partial = results["partial_test_labels"]
    mask, labels = features.test.label_mask, features.test.labels
    scored = ((labels == 1) & (mask == 1)).any(axis=0)
    assert partial["classes_left_out"] == int((~scored).sum()) == 1  # the owl: no annotated positive in test
    assert partial["annotated_fraction"] == pytest.approx(mask.mean())
    for loss in ("an", "bce_observed"):
        head = runs.read_linear_head(run_dir, loss)
        scores = torch.sigmoid(torch.from_numpy(features.test.features) @ head.weight.T + head.bias).numpy()
        expected = np.mean([average_precision_score(labels[mask[:, c] == 1, c], scores[mask[:, c] == 1, c])
                            for c in np.flatnonzero(scored)])
        assert results["losses"][loss]["test_map"] == pytest.approx(100 * expected, abs=1e-6)
