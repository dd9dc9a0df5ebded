"""PASCAL VOC 2012, formatted as the reference does (Cole et al. 2021).

Layout (root holds `VOCdevkit/`): labels come from `ImageSets/Main/<class>_{train,val}.txt`, one
`<image id> <flag>` line per image. Flag `1` is a positive; `0` (only "difficult" objects of the class) and
`-1` are negatives. Only images with at least one positive are kept; rows are in sorted image-id order.
The official `train` split is our training split (train + val come from it), official `val` is our test split.
"""

from __future__ import annotations

from pathlib import Path

from spml_cache.datasets.base import (
    ImageSplit,
    LabeledImages,
    data_lines,
    finish,
    label_matrix,
    malformed,
    require_file,
)

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
