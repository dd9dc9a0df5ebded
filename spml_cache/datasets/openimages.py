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
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spml_cache.datasets.base import ImageSplit, LabeledImages, finish, malformed
from spml_cache.labels import SparseLabels
from spml_cache.runtime.errors import SpmlError

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
# Its values elsewhere in the pipeline (datasets/__init__.py says what each is for; None: it has none)
EXPECTED_POSITIVES = None
PUBLISHED_ID_PREFIX = None
REPORT_LABEL = None
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


@dataclass(frozen=True, kw_only=True)
class Verified:
    """One split's verified-label file as three aligned arrays, one entry per line (file order), and the ids and
    LabelNames they index: compact (9 bytes a line) where per-image lists of tuples would take ~100."""

    images: list[str]  # ImageID by image code, in order of first appearance
    names: list[str]  # LabelName by label code, in order of first appearance
    image: np.ndarray  # int32 [lines]: the line's image code
    label: np.ndarray  # int32 [lines]: the line's label code
    present: np.ndarray  # bool [lines]: Confidence 1 (verified present), else 0 (verified absent)


def read_verified(path: Path) -> Verified:
    """The verified labels of one split's `ImageID,Source,LabelName,Confidence` file, streamed."""
    images: dict[str, int] = {}
    names: dict[str, int] = {}
    image, label, present = array("i"), array("i"), array("b")
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
            image.append(images.setdefault(row[0], len(images)))
            label.append(names.setdefault(row[2], len(names)))
            present.append(confidence == "1")
    return Verified(images=list(images), names=list(names), image=np.frombuffer(image, np.int32),
                    label=np.frombuffer(label, np.int32), present=np.frombuffer(present, np.int8).astype(bool))


def class_list(root: Path, train: Verified) -> list[str]:
    """The LabelNames of the classes, in order: the trainable list, else the classes verified present in train."""
    trainable = one_file(root, "*classes-trainable.txt", "", required=False)
    if trainable is not None:
        return [line.strip() for line in trainable.read_text(encoding="utf-8").splitlines() if line.strip()]
    return sorted({train.names[code] for code in np.unique(train.label[train.present])})


def display_names(labels: list[str], descriptions: dict[str, str]) -> list[str]:
    names = [descriptions.get(label, label) for label in labels]
    shared = {name for name in names if names.count(name) > 1}
    return [f"{name} ({label})" if name in shared else name for name, label in zip(names, labels)]


def split_rows(verified: Verified, column: dict[str, int], folder: str) -> ImageSplit:
    """The images of one split (sorted by id) with their labels and label mask as `SparseLabels`, built from the
    entries without a dense [N, C] matrix: labels hold the verified positives, the mask every verified entry of
    the kept classes. A label verified twice for an image takes its last line in the file."""
    order = np.argsort(np.array(verified.images, dtype=object), kind="stable")
    ids = [verified.images[code] for code in order]
    place = np.empty(len(ids), dtype=np.int64)  # image code -> row
    place[order] = np.arange(len(ids))
    del order
    classes = len(column)
    columns = np.array([column.get(name, -1) for name in verified.names], dtype=np.int32)  # label code -> column
    col = columns[verified.label]
    kept = np.flatnonzero(col >= 0)
    key = place[verified.image[kept]]
    key *= classes
    key += col[kept]  # the row-major position of each kept line
    del col
    # the last line of each (image, class): the last of its run once stably sorted
    order = np.argsort(key, kind="stable")
    key = key[order]
    last = np.append(key[1:] != key[:-1], True) if len(key) else np.zeros(0, bool)
    key, present = key[last], verified.present[kept[order[last]]]
    del order, kept, last
    indptr = np.concatenate([[0], np.cumsum(np.bincount(key // classes, minlength=len(ids)))]).astype(np.int64)
    indices = (key % classes).astype(np.int32)
    mask = SparseLabels(indptr, indices, np.ones(len(indices), np.int8), classes)
    positive_before = np.concatenate([[0], np.cumsum(present, dtype=np.int64)])
    labels = SparseLabels(positive_before[indptr], indices[present], np.ones(int(present.sum()), np.int8), classes)
    return ImageSplit([f"{folder}/{image}.jpg" for image in ids], labels, mask)


def read_labels(root: Path) -> tuple[list[str], ImageSplit, ImageSplit, list[str], Path]:
    """The class names, the train and test splits (sparse labels and mask) and the notes, before any image is
    looked for; and the train labels file (what errors about the splits name)."""
    descriptions = read_descriptions(one_file(root, "*class-descriptions.csv", "LabelName,DisplayName per class"))
    files = {split: one_file(root, f"*{split}-annotations-human-imagelabels.csv",
                             "ImageID,Source,LabelName,Confidence per verified label") for split in SPLIT_FOLDERS}
    verified = {split: read_verified(path) for split, path in files.items()}
    labels = class_list(root, verified["train"])
    if not labels:
        raise SpmlError(f"{files['train']}: no verified positive label; check the file")
    column = {label: index for index, label in enumerate(labels)}
    train, test = (split_rows(verified.pop(split), column, folder) for split, folder in SPLIT_FOLDERS.items())
    kept = test.mask.nnz / (len(test) * len(labels)) if len(test) else 0.0
    notes = [f"{len(labels):,} classes; {kept:.2%} of the test labels verified (mAP is taken over those)"]
    return display_names(labels, descriptions), train, test, notes, files["train"]


def read(root: Path, *, skip_missing: bool = False) -> LabeledImages:
    classes, train, test, notes, source = read_labels(root)
    return finish(NAME, root, classes, train, test, source=source, skip_missing=skip_missing, notes=notes)
