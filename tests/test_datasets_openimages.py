"""The OpenImages reader on a tiny dataset in the official V6 layout (the label CSVs, class descriptions, trainable
classes, images by id): verified positives and negatives, the label mask, `--observe given`, masked test mAP."""

import json

import numpy as np
import pytest
import torch

from cli_support import run_cli
from extract_support import write_jpeg
from spml_cache import cache, datasets
from spml_cache.labels import SparseLabels, is_sparse
from spml_cache.runtime.errors import SpmlError

CLASSES = {"/m/01": "Cat", "/m/02": "Dog", "/m/03": "Owl", "/m/04": "Jaguar", "/m/05": "Jaguar", "/m/09": "Unused"}
TRAINABLE = ["/m/01", "/m/02", "/m/03", "/m/04", "/m/05"]
VERIFIED = tuple(TRAINABLE)  # the classes images get verified labels of (a test may make more trainable)


def verified_labels(k: int) -> list[tuple[str, int]]:
    """Image k's verified labels: a deterministic mix of present (1) and absent (0); some classes unverified."""
    return [(label, int((k + i) % 3 == 0)) for i, label in enumerate(VERIFIED) if (k * 7 + i) % 4 != 0]


def write_openimages(root, num_train=30, num_test=12):
    root.mkdir(parents=True, exist_ok=True)
    (root / "oidv6-class-descriptions.csv").write_text(
        "LabelName,DisplayName\n" + "".join(f"{k},{v}\n" for k, v in CLASSES.items()))
    (root / "oidv6-classes-trainable.txt").write_text("\n".join(TRAINABLE) + "\n")
    expected = {}
    for split, prefix, count, offset in (("train", "oidv6-", num_train, 0), ("test", "", num_test, 100)):
        lines = ["ImageID,Source,LabelName,Confidence"]
        for k in range(offset, offset + count):
            image = f"{k:016x}"
            write_jpeg(root / split / f"{image}.jpg", seed=k)
            labels = verified_labels(k)
            lines += [f"{image},verification,{label},{confidence}" for label, confidence in labels]
            lines.append(f"{image},verification,/m/09,1")  # not trainable: left out
            expected[f"{split}/{image}.jpg"] = dict(labels)
        (root / f"{prefix}{split}-annotations-human-imagelabels.csv").write_text("\n".join(lines) + "\n")
    return expected


def test_verified_positives_and_negatives_become_labels_and_mask(tmp_path):
    expected = write_openimages(tmp_path / "openimages")
    images = datasets.read("openimages", tmp_path)  # found under root/openimages
    assert images.classes == ["Cat", "Dog", "Owl", "Jaguar (/m/04)", "Jaguar (/m/05)"]  # a shared name disambiguated
    for split in (images.train, images.test):
        assert is_sparse(split.labels) and is_sparse(split.mask)  # never a dense [N, C] matrix
        labels, mask = split.labels.to_dense(), split.mask.to_dense()
        for row, image_id in enumerate(split.ids):
            verified = expected[image_id]
            for column, label in enumerate(VERIFIED):
                assert mask[row, column] == (label in verified)
                assert labels[row, column] == verified.get(label, 0)


def write_label_file(path, lines):
    path.write_text("ImageID,Source,LabelName,Confidence\n" + "".join(f"{i},verification,{n},{c}\n" for i, n, c in lines))


def test_the_sparse_reading_equals_a_dense_matrix_written_from_the_lines(tmp_path):
    """Shuffled lines over many images, a label verified twice (the last line wins), classes taken from the
    train positives without a trainable list: the CSR matrices equal the dense ones built here line by line."""
    rng = np.random.default_rng(0)
    names = [f"/m/c{k:03d}" for k in range(40)]
    (tmp_path / "oidv7-class-descriptions.csv").write_text("".join(f"{n},Class {n[-3:]}\n" for n in names))
    lines = {"train": [], "test": []}
    for split, count in (("train", 60), ("test", 25)):
        for k in range(count):
            image = f"{split[:2]}{rng.integers(1 << 40):012x}"
            (tmp_path / split).mkdir(exist_ok=True)
            (tmp_path / split / f"{image}.jpg").write_bytes(b"")
            for label in rng.choice(names, size=rng.integers(0, 6), replace=False):
                lines[split].append((image, label, int(rng.integers(2))))
        image, label, confidence = lines[split][3]
        order = rng.permutation(len(lines[split]))
        # verified again, the other way, on the last line: this one counts
        lines[split] = [lines[split][i] for i in order] + [(image, label, 1 - confidence)]
        write_label_file(tmp_path / f"oidv7-{split}-annotations-human-imagelabels.csv", lines[split])
    images = datasets.read("openimages", tmp_path)
    classes = sorted({n for _, n, c in lines["train"] if c == 1})  # no trainable list: the train positives
    assert images.classes == [f"Class {n[-3:]}" for n in classes]
    for split in ("train", "test"):
        ids = sorted({i for i, _, _ in lines[split]})
        labels = np.zeros((len(ids), len(classes)), np.int8)
        mask = np.zeros_like(labels)
        for image, label, confidence in lines[split]:  # in file order: a later line overwrites
            if label in classes:
                labels[ids.index(image), classes.index(label)] = confidence
                mask[ids.index(image), classes.index(label)] = 1
        read = getattr(images, split)
        assert read.ids == [f"{split}/{i}.jpg" for i in ids]
        assert read.labels == SparseLabels.from_dense(labels)  # ascending columns, values 1
        assert read.mask == SparseLabels.from_dense(mask)


def test_skipping_missing_images_keeps_the_labels_sparse(tmp_path):
    expected = write_openimages(tmp_path, num_train=8, num_test=4)
    gone = sorted(expected)[1]
    (tmp_path / gone).unlink()
    images = datasets.read("openimages", tmp_path, skip_missing=True)
    assert images.skipped == [gone] and gone not in images.train.ids + images.test.ids
    split = images.train if gone.startswith("train") else images.test
    assert is_sparse(split.labels) and is_sparse(split.mask) and len(split.labels) == len(split)
    for row, image_id in enumerate(split.ids):
        assert dict(zip(VERIFIED, split.mask.to_dense()[row])) == {
            label: int(label in expected[image_id]) for label in VERIFIED}


def test_the_layout_is_found_and_described(tmp_path):
    write_openimages(tmp_path / "openimages", num_train=4, num_test=2)
    done = run_cli("datasets", "--root", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "openimages" in done.stdout and "oidv6-class-descriptions.csv" in done.stdout
    assert "train 4, test 2 images, 5 classes" in done.stdout


def test_a_missing_labels_file_is_one_line(tmp_path):
    write_openimages(tmp_path, num_train=4, num_test=2)
    (tmp_path / "oidv6-train-annotations-human-imagelabels.csv").unlink()
    with pytest.raises(SpmlError, match=r"missing .*oidv6-train-annotations-human-imagelabels\.csv"):
        datasets.read("openimages", tmp_path)


def test_extract_then_linear_on_the_verified_labels(tmp_path):
    write_openimages(tmp_path / "openimages")
    done = run_cli("extract", "openimages", "--root", str(tmp_path), "--out", "oi.h5", "--weights", "none",
                   "--resolution", "32", "--workers", "0", "--device", "cpu", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    features = cache.load(tmp_path / "oi.h5")
    assert features.test.label_mask is not None and 0 < features.test.label_mask.mean() < 1
    done = run_cli("linear", "--cache", "oi.h5", "--loss", "bce_observed", "--observe", "given", "--lr", "1e-2",
                   "--batch-size", "8", "--epochs", "1", "--out", "runs", "--device", "cpu", "--workers", "0",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    results = json.loads(next((tmp_path / "runs").rglob("results.json")).read_text())
    assert results["partial_test_labels"]["classes_left_out"] == 0
    assert "bce_observed@given" in results["losses"]
    run_dir = next((tmp_path / "runs").rglob("results.json")).parent
    trained_on = np.load(run_dir / "labels.npz")["train_observed@given"]
    verified = np.where(features.train.label_mask == 1, 2 * features.train.labels.astype(np.int8) - 1, 0)
    np.testing.assert_array_equal(trained_on, verified)  # exactly the human-verified labels, nothing else


def test_many_classes_store_sparse_and_train_on_the_verified_labels(tmp_path):
    """From 1,000 classes the cache is sparse (labels, observed and the label mask alike); `--observe given`
    takes the verified entries from the sparse mask, and test mAP is taken over them (scikit-learn on the
    annotated rows of each class scored)."""
    from sklearn.metrics import average_precision_score

    from spml_cache import runs

    extra = {f"/m/x{k:04d}": f"Extra {k}" for k in range(1000)}  # never verified: left out of the mAP
    CLASSES.update(extra)
    TRAINABLE.extend(extra)
    try:
        write_openimages(tmp_path / "openimages")
    finally:
        for label in extra:
            CLASSES.pop(label)
            TRAINABLE.remove(label)
    done = run_cli("extract", "openimages", "--root", str(tmp_path), "--out", "oi.h5", "--weights", "none",
                   "--resolution", "32", "--workers", "0", "--device", "cpu", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    features = cache.load(tmp_path / "oi.h5")
    assert all(is_sparse(m) for m in (features.train.labels, features.train.label_mask, features.test.label_mask))
    done = run_cli("linear", "--cache", "oi.h5", "--loss", "bce_observed", "--observe", "given", "--lr", "1e-2",
                   "--batch-size", "8", "--epochs", "1", "--out", "runs", "--device", "cpu", "--workers", "0",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    run_dir = next((tmp_path / "runs").rglob("results.json")).parent
    results = json.loads((run_dir / "results.json").read_text())
    assert results["partial_test_labels"]["classes_left_out"] == 1000
    assert results["rules"]["given"]["fraction_observed"] == pytest.approx(
        features.train.label_mask.nnz / np.prod(features.train.label_mask.shape))
    labels, mask = (m.to_dense(np.uint8) for m in (features.test.labels, features.test.label_mask))
    head = runs.read_linear_head(run_dir, "bce_observed@given")
    scores = torch.sigmoid(torch.from_numpy(features.test.features) @ head.weight.T + head.bias).numpy()  # as scored
    scored = np.flatnonzero(((labels == 1) & (mask == 1)).any(axis=0))
    expected = np.mean([average_precision_score(labels[mask[:, c] == 1, c], scores[mask[:, c] == 1, c])
                        for c in scored])
    assert results["losses"]["bce_observed@given"]["test_map"] == pytest.approx(100 * expected, abs=1e-4)
