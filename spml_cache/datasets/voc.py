"""PASCAL VOC 2012, formatted as the reference does (Cole et al. 2021).

Layout (root holds `VOCdevkit/`): labels come from `ImageSets/Main/<class>_{train,val}.txt`, one
`<image id> <flag>` line per image. Flag `1` is a positive; `0` (only "difficult" objects of the class) and
`-1` are negatives. Only images with at least one positive are kept; rows are in sorted image-id order.
The official `train` split is our training split (train + val come from it), official `val` is our test split.
"""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from pathlib import Path

import numpy as np

from spml_cache.datasets.base import (
    ImageSplit,
    LabeledImages,
    data_lines,
    finish,
    label_matrix,
    malformed,
    require_file,
)
from spml_cache.runtime.errors import SpmlError

NAME = "voc"
TITLE = "PASCAL VOC 2012"
CLASSES = [
    "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
]  # fmt: skip
MARKER = "VOCdevkit/VOC2012"
LAYOUT = [
    "VOCdevkit/VOC2012/JPEGImages/<id>.jpg",
    "VOCdevkit/VOC2012/ImageSets/Main/<class>_{train,val}.txt",
]
ABOUT = "20 classes; official train -> train + val, official val -> test"
IMAGE_DIR = "VOCdevkit/VOC2012/JPEGImages"
# Its values elsewhere in the pipeline (datasets/__init__.py says what each is for; None: it has none)
EXPECTED_POSITIVES = 1.5
PUBLISHED_ID_PREFIX = f"{IMAGE_DIR}/"
REPORT_LABEL = "VOC"
ANNOTATION_DIR = "VOCdevkit/VOC2012/Annotations"
# our split name -> the official image set it comes from
OFFICIAL = {"train": "train", "test": "val"}
FLAGS = {"1": True, "0": False, "-1": False}


def read_image_set(root: Path, image_set: str) -> tuple[ImageSplit, int]:
    """One official image set: (the images with >= 1 positive, how many listed images had none)."""
    main = root / "VOCdevkit" / "VOC2012" / "ImageSets" / "Main"
    positives: dict[str, list[int]] = {}
    for index, name in enumerate(CLASSES):
        path = require_file(main / f"{name}_{image_set}.txt", f"the VOC 2012 class list for '{name}'")
        for line, tokens in data_lines(path):
            if len(tokens) != 2 or tokens[1] not in FLAGS:
                raise malformed(path, line, f"expected '<image id> <1|0|-1>', got {' '.join(tokens)!r}")
            image_id, flag = tokens
            classes = positives.setdefault(image_id, [])
            if FLAGS[flag]:
                classes.append(index)
    kept = sorted(image_id for image_id, classes in positives.items() if classes)
    ids = [f"{IMAGE_DIR}/{image_id}.jpg" for image_id in kept]
    split = ImageSplit(ids, label_matrix([positives[image_id] for image_id in kept], len(CLASSES)))
    return split, len(positives) - len(kept)


def read(root: Path, *, skip_missing: bool = False) -> LabeledImages:
    splits, notes = {}, []
    for ours, official in OFFICIAL.items():
        splits[ours], dropped = read_image_set(root, official)
        if dropped:
            notes.append(f"{dropped} official-{official} images without a positive label left out (reference rule)")
    return finish(
        NAME,
        root,
        CLASSES,
        splits["train"],
        splits["test"],
        source=root / "VOCdevkit" / "VOC2012" / "ImageSets" / "Main",
        skip_missing=skip_missing,
        notes=notes,
    )


def read_areas(root: Path, ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Instance areas from the boxes of `Annotations/<id>.xml`, float64 [N, C] per image and class: the largest
    box and the summed boxes. Boxes are inclusive pixel corners, so a box covers (xmax - xmin + 1) x
    (ymax - ymin + 1) pixels; "difficult" objects are left out, as they are from the labels."""
    index = {name: column for column, name in enumerate(CLASSES)}
    largest, total = np.zeros((len(ids), len(CLASSES))), np.zeros((len(ids), len(CLASSES)))
    for row, image_id in enumerate(ids):
        path = require_file(root / ANNOTATION_DIR / f"{Path(image_id).stem}.xml", "the VOC 2012 box annotations")
        try:
            objects = ElementTree.parse(path).getroot().iter("object")
            for obj in objects:
                if obj.findtext("difficult", "0").strip() == "1" or obj.findtext("name", "").strip() not in index:
                    continue
                box = obj.find("bndbox")
                xmin, ymin, xmax, ymax = (float(box.findtext(key)) for key in ("xmin", "ymin", "xmax", "ymax"))
                area, column = (xmax - xmin + 1) * (ymax - ymin + 1), index[obj.findtext("name").strip()]
                largest[row, column] = max(largest[row, column], area)
                total[row, column] += area
        except (ElementTree.ParseError, AttributeError, TypeError, ValueError) as err:
            raise SpmlError(f"{path}: not a VOC annotation with numeric boxes ({err}); restore the file") from None
    return largest, total
