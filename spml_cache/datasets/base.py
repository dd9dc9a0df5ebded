"""What every dataset reader returns, and the checks all readers share.

A reader turns a dataset as users already have it on disk into `LabeledImages`: image ids (paths relative to
the dataset root, POSIX style, so `root / id` is the image file), the full label matrix of the official
training and test splits, and the class names in the reference order. Readers use only the standard library,
numpy and json; they never download anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from spml_cache.labels import SparseLabels, take
from spml_cache.runtime.errors import SpmlError

# How many missing ids an error message shows before "...".
SHOW_FIRST = 5


@dataclass(frozen=True)
class ImageSplit:
    ids: list[str]  # image path relative to the dataset root, POSIX style, unique
    # uint8 [N, C], full ground truth, rows aligned with ids; a `SparseLabels` (CSR of the 1s) from a reader of
    # data too large for a dense matrix (OpenImages: 1.7M x 9,605 is 16 GB dense); the other readers give arrays.
    labels: np.ndarray | SparseLabels
    # uint8 [N, C] (or SparseLabels), 1 where the label is annotated, for partially labelled data (OpenImages, a
    # CSV with unknown cells); None: every label is known. An unannotated entry's label is 0; no observation rule
    # observes it, no mAP scores it.
    mask: np.ndarray | SparseLabels | None = None

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, kw_only=True)
class LabeledImages:
    dataset: str  # "voc", "coco", "nus", "cub", "openimages", "csv"
    root: Path
    classes: list[str]
    train: ImageSplit  # the official training split (train + val come from it)
    test: ImageSplit  # the official test split
    skipped: list[str] = field(default_factory=list)  # ids left out because the image file is missing
    notes: list[str] = field(default_factory=list)  # facts worth printing

    def path(self, image_id: str) -> Path:
        return self.root / image_id


@dataclass(frozen=True, kw_only=True)
class DatasetSurvey:
    """One line of `spml-cache datasets`: what a dataset expects and what was found under a root."""

    dataset: str
    title: str
    layout: list[str]  # the files and folders the reader expects, relative to the root
    about: str  # classes and how the official splits map to ours
    root: Path | None = None  # the root that was looked at (after probing root/<dataset>); None without a root
    found: bool = False  # the dataset's layout is present and it reads without error
    counts: dict[str, int] = field(default_factory=dict)  # images per split ("train", "test")
    num_classes: int = 0
    missing: list[str] = field(default_factory=list)  # ids whose image file is missing
    notes: list[str] = field(default_factory=list)
    problem: str | None = None  # what is missing or wrong (an SpmlError message), when not found

    def summary(self) -> list[str]:
        """Plain lines for the "found" column of `spml-cache datasets`."""
        if self.root is None:
            return ["-"]
        if not self.found:
            return [self.problem or "not found"]
        counts = ", ".join(f"{split} {count:,}" for split, count in self.counts.items())
        lines = [f"found at {self.root}", f"{counts} images, {self.num_classes} classes"]
        if self.missing:
            shown = ", ".join(self.missing[:SHOW_FIRST]) + (", ..." if len(self.missing) > SHOW_FIRST else "")
            lines.append(f"{len(self.missing):,} image files missing ({shown}): extract needs --skip-missing")
        return lines + self.notes


def require_file(path: Path, what: str) -> Path:
    """The file a reader needs, or an error naming the expected path."""
    if not path.is_file():
        raise SpmlError(f"missing {path}: expected {what}")
    return path


def read_text(path: Path) -> str:
    """A text file as str; undecodable bytes are replaced (some official lists are not clean UTF-8)."""
    return path.read_text(encoding="utf-8", errors="replace")


def data_lines(path: Path) -> Iterator[tuple[int, list[str]]]:
    """(1-based line number, whitespace-split tokens) of every non-blank line, streamed (CUB's is 3.7M lines)."""
    with open(path, encoding="utf-8", errors="replace") as file:
        for number, line in enumerate(file, start=1):
            tokens = line.split()
            if tokens:
                yield number, tokens


def malformed(path: Path, line: int, problem: str) -> SpmlError:
    return SpmlError(f"{path}, line {line}: {problem}")


def parse_int(path: Path, line: int, token: str, what: str) -> int:
    try:
        return int(token)
    except ValueError:
        raise malformed(path, line, f"{what} {token!r} is not an integer") from None


def label_matrix(rows: list[list[int]] | list[np.ndarray], num_classes: int) -> np.ndarray:
    """uint8 [N, C] from per-row lists of positive class indices."""
    labels = np.zeros((len(rows), num_classes), dtype=np.uint8)
    for i, positives in enumerate(rows):
        labels[i, positives] = 1
    return labels


def first_duplicate(ids: list[str]) -> str | None:
    seen: set[str] = set()
    for image_id in ids:
        if image_id in seen:
            return image_id
        seen.add(image_id)
    return None


def find_missing(root: Path, ids: list[str]) -> list[str]:
    """The ids whose file does not exist under root, in the order given.

    Lists each folder once instead of calling stat per image: NUS-WIDE and COCO hold hundreds of thousands
    of files, often on network storage.
    """
    listing: dict[str, set[str]] = {}
    missing = []
    for image_id in ids:
        folder, _, name = image_id.rpartition("/")
        if folder not in listing:
            try:
                with os.scandir(root / folder) as entries:
                    listing[folder] = {entry.name for entry in entries}
            except (FileNotFoundError, NotADirectoryError):
                listing[folder] = set()
        if name not in listing[folder]:
            missing.append(image_id)
    return missing


def drop_missing(
    dataset: str, root: Path, train: ImageSplit, test: ImageSplit, *, skip_missing: bool
) -> tuple[ImageSplit, ImageSplit, list[str]]:
    """Refuse missing image files, or (skip_missing) leave them out and return them as `skipped`."""
    missing = find_missing(root, train.ids + test.ids)
    if not missing:
        return train, test, []
    if not skip_missing:
        shown = ", ".join(missing[:SHOW_FIRST]) + (", ..." if len(missing) > SHOW_FIRST else "")
        raise SpmlError(
            f"{dataset}: {len(missing)} of {len(train) + len(test)} image files are missing under {root} "
            f"(e.g. {shown}): restore them, or skip them with --skip-missing (skip_missing=True)"
        )
    gone = set(missing)

    def keep(split: ImageSplit) -> ImageSplit:
        rows = np.array([i for i, image_id in enumerate(split.ids) if image_id not in gone], dtype=np.int64)
        return ImageSplit([split.ids[i] for i in rows], take(split.labels, rows), take(split.mask, rows))

    return keep(train), keep(test), missing


def finish(
    dataset: str,
    root: Path,
    classes: list[str],
    train: ImageSplit,
    test: ImageSplit,
    *,
    source: Path,
    skip_missing: bool,
    notes: list[str] | None = None,
) -> LabeledImages:
    """The checks every reader ends with: unique ids, present images, non-empty splits.

    `source` is the file or folder the splits were read from; errors about empty splits name it.
    """
    twice = first_duplicate(train.ids + test.ids)
    if twice is not None:
        raise SpmlError(f"{source}: image {twice} is listed twice; list each image once, in one split")
    train, test, skipped = drop_missing(dataset, root, train, test, skip_missing=skip_missing)
    for name, split in (("train", train), ("test", test)):
        if len(split) == 0:
            why = " after skipping missing image files" if skipped else ""
            raise SpmlError(f"{source}: the {name} split has no images{why}; check the dataset under {root}")
    return LabeledImages(dataset=dataset, root=root, classes=list(classes), train=train, test=test, skipped=skipped,
                         notes=list(notes or []))
