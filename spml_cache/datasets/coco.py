"""MS-COCO 2014, formatted as the reference does (Cole et al. 2021).

Layout (root holds `train2014/`, `val2014/`, `annotations/`): labels come from
`annotations/instances_{train,val}2014.json`. Classes are the `categories` in ascending category id (the ids
are not contiguous). An image is positive for a category if it has any annotation of it, crowd annotations
included; images without annotations are left out. Rows are ordered by image id compared as strings, the
reference's order, so the authors' published feature files line up row for row. Ids are
`<split>2014/<file_name>`. `train2014` is our training split (train + val come from it), `val2014` the test split.
"""

from __future__ import annotations

import json
from pathlib import Path

from spml_cache.datasets.base import ImageSplit, LabeledImages, finish, label_matrix, require_file
from spml_cache.runtime.errors import SpmlError

NAME = "coco"
TITLE = "MS-COCO 2014"
MARKER = "annotations"
LAYOUT = [
    "train2014/*.jpg, val2014/*.jpg",
    "annotations/instances_{train,val}2014.json",
]
ABOUT = "80 classes; train2014 -> train + val, val2014 -> test"
# Its values elsewhere in the pipeline (datasets/__init__.py says what each is for; None: it has none)
EXPECTED_POSITIVES = 2.9
PUBLISHED_ID_PREFIX = ""
REPORT_LABEL = "COCO"
# our split name -> the official split it comes from
OFFICIAL = {"train": "train", "test": "val"}


def load_instances(path: Path) -> dict:
    require_file(path, "a COCO 2014 instances file")
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SpmlError(f"{path}: not valid JSON ({err}); re-download the COCO annotations") from None
    for key in ("categories", "images", "annotations"):
        if not isinstance(data, dict) or key not in data:
            raise SpmlError(f"{path}: no '{key}' list; expected a COCO instances file (instances_*2014.json)")
    return data


def categories(data: dict, path: Path) -> tuple[list[int], list[str]]:
    """(category ids, names), in ascending category id."""
    try:
        ordered = sorted((int(category["id"]), str(category["name"])) for category in data["categories"])
    except (KeyError, TypeError, ValueError):
        raise SpmlError(f"{path}: every entry of 'categories' needs an integer 'id' and a 'name'") from None
    if not ordered:
        raise SpmlError(f"{path}: 'categories' is empty; expected the 80 COCO categories")
    return [cid for cid, _ in ordered], [name for _, name in ordered]


def read_split(data: dict, path: Path, official: str, category_ids: list[int]) -> tuple[ImageSplit, int]:
    """One official split: (the annotated images, how many images had no annotation)."""
    column = {cid: index for index, cid in enumerate(category_ids)}
    try:
        file_names = {int(image["id"]): str(image["file_name"]) for image in data["images"]}
    except (KeyError, TypeError, ValueError):
        raise SpmlError(f"{path}: every entry of 'images' needs an integer 'id' and a 'file_name'") from None
    positives: dict[int, set[int]] = {}
    for number, annotation in enumerate(data["annotations"]):
        try:
            image_id, category_id = int(annotation["image_id"]), int(annotation["category_id"])
        except (KeyError, TypeError, ValueError):
            raise SpmlError(f"{path}: annotation #{number} lacks an integer 'image_id' or 'category_id'") from None
        if image_id not in file_names:
            raise SpmlError(f"{path}: annotation #{number} refers to image {image_id}, which 'images' does not list")
        if category_id not in column:
            raise SpmlError(f"{path}: annotation #{number} has category {category_id}, not in 'categories'")
        positives.setdefault(image_id, set()).add(column[category_id])
    order = sorted(positives, key=str)
    ids = [f"{official}2014/{file_names[image_id]}" for image_id in order]
    labels = label_matrix([sorted(positives[image_id]) for image_id in order], len(category_ids))
    return ImageSplit(ids, labels), len(file_names) - len(positives)


def read(root: Path, *, skip_missing: bool = False) -> LabeledImages:
    splits, notes, reference = {}, [], None
    for ours, official in OFFICIAL.items():
        path = root / "annotations" / f"instances_{official}2014.json"
        data = load_instances(path)
        category_ids, names = categories(data, path)
        if reference is None:
            reference = (category_ids, names, path)
        elif (category_ids, names) != reference[:2]:
            raise SpmlError(f"{path}: its categories differ from those of {reference[2]}; use one COCO release")
        splits[ours], unannotated = read_split(data, path, official, category_ids)
        del data  # the train file is large: free it before loading the next
        if unannotated:
            notes.append(f"{unannotated} {official}2014 images without annotations left out (reference rule)")
    return finish(
        NAME,
        root,
        reference[1],
        splits["train"],
        splits["test"],
        source=root / "annotations",
        skip_missing=skip_missing,
        notes=notes,
    )
