"""CUB-200-2011 attributes, formatted as the reference does (Cole et al. 2021).

Layout (root holds `CUB_200_2011/`): images from `images.txt` (`<image id> <path under images/>`), the split
from `train_test_split.txt` (`<image id> <is_train>`), labels from `attributes/image_attribute_labels.txt`
(`<image id> <attribute id> <is_present> <certainty id> <time>`; some lines carry extra tokens, only the first
three count; certainty is ignored). The 312 classes are the attributes in `attributes.txt` order; copies of
the dataset put that file next to `CUB_200_2011/`, inside it, or in its `attributes/` folder, and all three are
probed. Rows are in `images.txt` order; `is_train=1` is our training split, `is_train=0` the test split.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from spml_cache.datasets.base import ImageSplit, LabeledImages, data_lines, finish, malformed, parse_int, require_file
from spml_cache.runtime.errors import SpmlError

NAME = "cub"
TITLE = "CUB-200-2011 (attributes)"
MARKER = "CUB_200_2011"
LAYOUT = [
    "CUB_200_2011/{images.txt,train_test_split.txt}",
    "CUB_200_2011/images/<class>/*.jpg",
    "CUB_200_2011/attributes/image_attribute_labels.txt",
    "attributes.txt next to CUB_200_2011/, inside it, or in its attributes/",
]
ABOUT = "312 attribute classes; is_train=1 -> train + val, is_train=0 -> test"
# Its values elsewhere in the pipeline (datasets/__init__.py says what each is for; None: it has none)
EXPECTED_POSITIVES = 31.4
PUBLISHED_ID_PREFIX = "CUB_200_2011/images/"
REPORT_LABEL = "CUB"


def attribute_file_candidates(root: Path) -> list[Path]:
    return [
        root / "attributes.txt",
        root / "CUB_200_2011" / "attributes.txt",
        root / "CUB_200_2011" / "attributes" / "attributes.txt",
    ]


def read_attributes(root: Path) -> list[str]:
    candidates = attribute_file_candidates(root)
    path = next((candidate for candidate in candidates if candidate.is_file()), None)
    if path is None:
        raise SpmlError(f"missing attributes.txt: looked for {', '.join(map(str, candidates))}; put it in one of them")
    names = []
    for line, tokens in data_lines(path):
        if len(tokens) < 2 or parse_int(path, line, tokens[0], "attribute id") != len(names) + 1:
            raise malformed(path, line, f"expected '{len(names) + 1} <attribute name>', got {' '.join(tokens)!r}")
        names.append(" ".join(tokens[1:]))
    if not names:
        raise SpmlError(f"{path}: no attributes; expected '<id> <name>' lines")
    return names


def read_id_pairs(path: Path, what: str) -> dict[int, str]:
    """`<image id> <value>` lines as {image id: value}, in file order."""
    pairs: dict[int, str] = {}
    for line, tokens in data_lines(path):
        if len(tokens) != 2:
            raise malformed(path, line, f"expected '<image id> <{what}>', got {' '.join(tokens)!r}")
        image_id = parse_int(path, line, tokens[0], "image id")
        if image_id in pairs:
            raise malformed(path, line, f"image id {image_id} appears twice")
        pairs[image_id] = tokens[1]
    return pairs


def read_labels(path: Path, row_of: dict[int, int], num_attributes: int) -> np.ndarray:
    """uint8 [images, attributes] from `image_attribute_labels.txt`; every pair must be present.

    The file has 3.7M lines: numpy parses it; only when a check fails is it re-read line by line, to name
    the first bad line.
    """
    try:
        table = np.loadtxt(path, usecols=(0, 1, 2), dtype=np.int64, ndmin=2)
    except ValueError:
        return read_labels_line_by_line(path, row_of, num_attributes)
    lookup = np.full(max(row_of) + 2, -1, dtype=np.int64)  # image id -> row; the extra slot stays -1
    lookup[list(row_of)] = list(row_of.values())
    image_ids, attributes, present = table.T
    known = (image_ids >= 0) & (image_ids < len(lookup))
    rows = np.where(known, lookup[np.clip(image_ids, 0, len(lookup) - 1)], -1)
    valid = (rows >= 0) & (attributes >= 1) & (attributes <= num_attributes) & ((present == 0) | (present == 1))
    if not valid.all():
        return read_labels_line_by_line(path, row_of, num_attributes)
    labels = np.zeros((len(row_of), num_attributes), dtype=np.uint8)
    seen = np.zeros((len(row_of), num_attributes), dtype=bool)
    labels[rows, attributes - 1] = present
    seen[rows, attributes - 1] = True
    check_complete(path, seen)
    return labels


def read_labels_line_by_line(path: Path, row_of: dict[int, int], num_attributes: int) -> np.ndarray:
    labels = np.zeros((len(row_of), num_attributes), dtype=np.uint8)
    seen = np.zeros((len(row_of), num_attributes), dtype=bool)
    for line, tokens in data_lines(path):
        if len(tokens) < 3 or tokens[2] not in ("0", "1"):
            raise malformed(path, line, f"expected '<image id> <attribute id> <0|1> ...', got {' '.join(tokens)!r}")
        image_id = parse_int(path, line, tokens[0], "image id")
        attribute = parse_int(path, line, tokens[1], "attribute id")
        if image_id not in row_of:
            raise malformed(path, line, f"image id {image_id} is not in images.txt")
        if not 1 <= attribute <= num_attributes:
            raise malformed(path, line, f"attribute id {attribute} is outside 1..{num_attributes} (attributes.txt)")
        row = row_of[image_id]
        labels[row, attribute - 1] = tokens[2] == "1"
        seen[row, attribute - 1] = True
    check_complete(path, seen)
    return labels


def check_complete(path: Path, seen: np.ndarray) -> None:
    if not seen.all():
        raise SpmlError(
            f"{path}: {int((~seen).sum())} of {seen.size} (image, attribute) labels are missing; "
            "expected one line per image and attribute"
        )


def read(root: Path, *, skip_missing: bool = False) -> LabeledImages:
    folder = root / "CUB_200_2011"
    attributes = read_attributes(root)
    images_path = require_file(folder / "images.txt", "the CUB-200-2011 image list")
    images = read_id_pairs(images_path, "image path")
    if not images:
        raise SpmlError(f"{images_path}: no images listed; expected '<image id> <path under images/>' lines")
    split_path = require_file(folder / "train_test_split.txt", "the CUB-200-2011 train/test split")
    is_train = read_id_pairs(split_path, "is_train")
    for image_id in images:
        if is_train.get(image_id) not in ("0", "1"):
            raise SpmlError(f"{split_path}: image id {image_id} needs an is_train of 0 or 1")
    label_path = require_file(
        folder / "attributes" / "image_attribute_labels.txt", "the CUB-200-2011 attribute labels"
    )
    row_of = {image_id: row for row, image_id in enumerate(images)}
    labels = read_labels(label_path, row_of, len(attributes))
    ids = [f"CUB_200_2011/images/{path}" for path in images.values()]
    splits = {}
    for ours, flag in (("train", "1"), ("test", "0")):
        rows = [row for row, image_id in enumerate(images) if is_train[image_id] == flag]
        splits[ours] = ImageSplit([ids[row] for row in rows], labels[rows])
    return finish(
        NAME, root, attributes, splits["train"], splits["test"], source=folder, skip_missing=skip_missing
    )
