"""OpenImages V6 / V7 image-level labels: human-verified positives AND negatives, the partial-label papers' data.

Layout (the files of the official download page, V6 `oidv6-...` or V7 `oidv7-...` names, in one folder):

- `*class-descriptions.csv`: `LabelName,DisplayName` (`/m/011k07,Tortoise`), with or without its header;
- `*classes-trainable.txt` (optional): the trainable classes, one LabelName per line; without it, every class
  with a verified positive in the training labels;
- `*train-annotations-human-imagelabels.csv` and `*test-annotations-human-imagelabels.csv`:
  `ImageID,Source,LabelName,Confidence`, one verified label per line, Confidence 1 (present) or 0 (absent);
- `train/<ImageID>.jpg`, `test/<ImageID>.jpg`: the images (as the official downloader names them).

Each image listed in a split's labels file is a row; a class verified present is 1, verified absent 0 and
annotated, never verified unannotated (the split's label mask). So the test mAP is taken over verified entries
only, and `linear --observe given` trains on exactly the human-verified labels (docs/protocol.md). Classes are
the trainable ones in their file's order, named by their display names (a name that two classes share gets its
LabelName in brackets). The official validation split is not read: the protocol carves val out of train.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from spml_cache.datasets.base import ImageSplit, LabeledImages, finish, malformed
from spml_cache.errors import SpmlError

NAME = "openimages"
TITLE = "OpenImages V6/V7 (image-level labels)"
MARKER = "*test-annotations-human-imagelabels.csv"
LAYOUT = [
    "oidv6-class-descriptions.csv (or oidv7-...)",
    "oidv6-classes-trainable.txt (optional)",
    "oidv6-train-annotations-human-imagelabels.csv, test-annotations-human-imagelabels.csv",
    "train/<ImageID>.jpg, test/<ImageID>.jpg",
]
ABOUT = ("verified positives and negatives; unverified labels masked (test mAP over verified entries, --observe"
         " given trains on them); official train -> train + val, test -> test")
LABEL_COLUMNS = ("ImageID", "Source", "LabelName", "Confidence")
SPLIT_FOLDERS = {"train": "train", "test": "test"}


def one_file(root: Path, pattern: str, what: str, required: bool = True) -> Path | None:
    """The one file under `root` matching `pattern` (V6 and V7 name them differently)."""
    found = sorted(root.glob(pattern))
    if len(found) > 1:
        raise SpmlError(f"{root}: several files match {pattern} ({', '.join(p.name for p in found)}); keep one")
    if not found and required:
        raise SpmlError(f"missing {root / pattern.replace('*', 'oidv6-', 1)}: expected {what}")
    return found[0] if found else None


def read_descriptions(path: Path) -> dict[str, str]:
    """LabelName -> DisplayName."""
    names = {}
    with open(path, encoding="utf-8", newline="") as file:
        for line, row in enumerate(csv.reader(file), start=1):
            if line == 1 and row[:1] == ["LabelName"]:
                continue
            if len(row) != 2:
                raise malformed(path, line, f"expected LabelName,DisplayName, got {len(row)} fields")
            names[row[0]] = row[1]
    return names


def read_verified(path: Path) -> dict[str, list[tuple[str, int]]]:
    """ImageID -> [(LabelName, 1 or 0)], in file order."""
    verified: dict[str, list[tuple[str, int]]] = {}
    with open(path, encoding="utf-8", newline="") as file:
        reader = csv.reader(file)
        header = next(reader, None)
        if header is None or tuple(header[:4]) != LABEL_COLUMNS:
            raise SpmlError(f"{path}, line 1: expected the header {','.join(LABEL_COLUMNS)}")
        for row in reader:
            if len(row) < 4:
                raise malformed(path, reader.line_num, f"expected {len(LABEL_COLUMNS)} fields, got {len(row)}")
            confidence = row[3].strip()
            if confidence not in ("0", "1"):
                raise malformed(path, reader.line_num, f"Confidence {confidence!r} is neither 1 nor 0")
            verified.setdefault(row[0], []).append((row[2], int(confidence)))
    return verified


def class_list(root: Path, train: dict[str, list[tuple[str, int]]]) -> list[str]:
    """The LabelNames of the classes, in order: the trainable list, else the classes verified present in train."""
    trainable = one_file(root, "*classes-trainable.txt", "", required=False)
    if trainable is not None:
        return [line.strip() for line in trainable.read_text(encoding="utf-8").splitlines() if line.strip()]
    present = {label for labels in train.values() for label, confidence in labels if confidence == 1}
    return sorted(present)


def display_names(labels: list[str], descriptions: dict[str, str]) -> list[str]:
    names = [descriptions.get(label, label) for label in labels]
    shared = {name for name in names if names.count(name) > 1}
    return [f"{name} ({label})" if name in shared else name for name, label in zip(names, labels)]


def split_rows(verified: dict[str, list[tuple[str, int]]], column: dict[str, int], folder: str) -> ImageSplit:
    """The images of one split with their labels and label mask (verified entries of the kept classes)."""
    ids = sorted(verified)
    labels = np.zeros((len(ids), len(column)), dtype=np.uint8)
    mask = np.zeros_like(labels)
    for row, image in enumerate(ids):
        for label, confidence in verified[image]:
            if label in column:
                labels[row, column[label]] = confidence
                mask[row, column[label]] = 1
    return ImageSplit([f"{folder}/{image}.jpg" for image in ids], labels, mask)


def read(root: Path, *, skip_missing: bool = False) -> LabeledImages:
    descriptions = read_descriptions(one_file(root, "*class-descriptions.csv", "LabelName,DisplayName per class"))
    files = {split: one_file(root, f"*{split}-annotations-human-imagelabels.csv",
                             "ImageID,Source,LabelName,Confidence per verified label") for split in SPLIT_FOLDERS}
    verified = {split: read_verified(path) for split, path in files.items()}
    labels = class_list(root, verified["train"])
    if not labels:
        raise SpmlError(f"{files['train']}: no verified positive label; check the file")
    column = {label: index for index, label in enumerate(labels)}
    splits = {split: split_rows(verified[split], column, folder) for split, folder in SPLIT_FOLDERS.items()}
    kept = splits["test"].mask.mean() if len(splits["test"]) else 0.0
    notes = [f"{len(labels):,} classes; {kept:.2%} of the test labels verified (mAP is taken over those)"]
    return finish(NAME, root, display_names(labels, descriptions), splits["train"], splits["test"],
                  source=files["train"], skip_missing=skip_missing, notes=notes)
