"""NUS-WIDE (81 concepts), formatted as the reference does (Cole et al. 2021).

Layout (root holds `Flickr/`, `ImageList/`, `Groundtruth/`, `ConceptsList/`): the image lists
`ImageList/{Train,Test}Imagelist.txt` name images relative to `Flickr/` with Windows separators
(`actor\\0001_2124494179.jpg`); `Groundtruth/TrainTestLabels/Labels_<concept>_{Train,Test}.txt` hold one 0/1
per line in image-list order; classes are `ConceptsList/Concepts81.txt` in file order. Images without any
positive are kept (the reference keeps them; a training image without one gets an all-unobserved row later).
Many Flickr images are gone from every copy of the dataset: they are an error unless `skip_missing=True`,
which leaves them out and lists them in `skipped`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from spml_cache.datasets.base import ImageSplit, LabeledImages, finish, malformed, read_text, require_file
from spml_cache.runtime.errors import SpmlError

NAME = "nus"
TITLE = "NUS-WIDE"
MARKER = "ImageList"
LAYOUT = [
    "Flickr/<tag>/*.jpg",
    "ImageList/{Train,Test}Imagelist.txt",
    "Groundtruth/TrainTestLabels/Labels_<concept>_{Train,Test}.txt",
    "ConceptsList/Concepts81.txt",
]
ABOUT = "81 classes; official train -> train + val, official test -> test; missing Flickr images need skip_missing"
# Its values elsewhere in the pipeline (datasets/__init__.py says what each is for; None: it has none)
EXPECTED_POSITIVES = 1.9
PUBLISHED_ID_PREFIX = "Flickr/"
REPORT_LABEL = "NUS"
# our split name -> the official split's file-name part
OFFICIAL = {"train": "Train", "test": "Test"}


def read_concepts(root: Path) -> list[str]:
    path = require_file(root / "ConceptsList" / "Concepts81.txt", "the NUS-WIDE concept list, one name per line")
    concepts = [line.strip() for line in read_text(path).splitlines() if line.strip()]
    if not concepts:
        raise SpmlError(f"{path}: no concept names; expected one concept per line")
    return concepts


def read_image_list(root: Path, official: str) -> list[str]:
    path = require_file(root / "ImageList" / f"{official}Imagelist.txt", "the NUS-WIDE image list")
    names = [line.strip().replace("\\", "/") for line in read_text(path).splitlines()]
    return [f"Flickr/{name}" for name in names if name]


def read_label_column(path: Path, num_images: int) -> np.ndarray:
    """One concept's 0/1 column; the fast path checks everything at once, the slow one finds the bad line."""
    tokens = path.read_bytes().split()
    digits = b"".join(tokens)
    if len(tokens) == num_images == len(digits) and not digits.translate(None, b"01"):
        return np.frombuffer(digits, dtype=np.uint8) == ord("1")
    lines = [(number, line.split()) for number, line in enumerate(read_text(path).splitlines(), start=1)]
    lines = [(number, parts) for number, parts in lines if parts]
    for number, parts in lines:
        if len(parts) != 1 or parts[0] not in ("0", "1"):
            raise malformed(path, number, f"expected one 0 or 1, got {' '.join(parts)!r}")
    raise SpmlError(
        f"{path}: {len(lines)} labels for {num_images} images in the image list; the two files must line up"
    )


def read_split(root: Path, official: str, concepts: list[str]) -> ImageSplit:
    ids = read_image_list(root, official)
    labels = np.zeros((len(ids), len(concepts)), dtype=np.uint8)
    folder = root / "Groundtruth" / "TrainTestLabels"
    for index, concept in enumerate(concepts):
        path = require_file(folder / f"Labels_{concept}_{official}.txt", f"the NUS-WIDE labels of '{concept}'")
        labels[:, index] = read_label_column(path, len(ids))
    return ImageSplit(ids, labels)


def read(root: Path, *, skip_missing: bool = False) -> LabeledImages:
    concepts = read_concepts(root)
    splits = {ours: read_split(root, official, concepts) for ours, official in OFFICIAL.items()}
    images = finish(
        NAME,
        root,
        concepts,
        splits["train"],
        splits["test"],
        source=root / "ImageList",
        skip_missing=skip_missing,
    )
    notes = list(images.notes)
    train_empty = int((images.train.labels.sum(axis=1) == 0).sum())
    test_empty = int((images.test.labels.sum(axis=1) == 0).sum())
    if train_empty:
        notes.append(f"{train_empty} training images have no positive label: kept, with an all-unobserved row")
    if test_empty:
        notes.append(f"{test_empty} test images have no positive label: kept, all-zero (reference rule)")
    return dataclasses.replace(images, notes=notes)
