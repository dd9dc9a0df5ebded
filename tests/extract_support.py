"""Shared helpers of the stage-one tests: saved random weights, tiny JPEGs, tiny dataset layouts on disk."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torchvision
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
RESOLUTION = 32
_WEIGHTS: dict[str, Path] = {}


def random_weights(tmp_path_factory) -> Path:
    """One saved random ResNet-50 state dict per test session: runs that must agree share weights."""
    if "path" not in _WEIGHTS:
        torch.manual_seed(0)
        model = torchvision.models.resnet50()
        path = tmp_path_factory.mktemp("weights") / "resnet50-random.pth"
        torch.save(model.state_dict(), path)
        _WEIGHTS["path"] = path
    return _WEIGHTS["path"]


def write_jpeg(path: Path, seed: int, size: tuple[int, int] = (24, 32)) -> None:
    """A small noisy RGB JPEG (height, width) = size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.RandomState(seed).randint(0, 256, size=(*size, 3)).astype(np.uint8)
    Image.fromarray(pixels).save(path, quality=90)


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def write_csv_dataset(root: Path, rows: list[tuple[str, list[str], str]]) -> dict[str, set[str]]:
    """root/labels.csv with (image name, label names, split) rows and their images; returns id -> labels."""
    lines = ["path,labels,split"]
    for number, (name, labels, split) in enumerate(rows):
        write_jpeg(root / "images" / name, seed=number, size=(20 + number % 7, 24 + number % 5))
        lines.append(f"images/{name},{'|'.join(labels)},{split}")
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    return {f"images/{name}": set(labels) for name, labels, _ in rows}


def write_numbered_csv_dataset(root: Path, count: int, first_test: int, classes: tuple[str, ...] = ("a", "b", "c"),
                               bad: tuple[str, ...] = ()) -> Path:
    """`count` images 0.jpg ... with 1..len(classes) labels each, those from `first_test` on in the test split; the
    `bad` ones (ids) truncated. Returns `root`."""
    rows = [(f"{k}.jpg", list(classes[: 1 + k % len(classes)]), "test" if k >= first_test else "train")
            for k in range(count)]
    write_csv_dataset(root, rows)
    for image_id in bad:
        truncate(root / image_id)
    return root


def write_coco_dataset(root: Path, num_train: int = 8, num_test: int = 4) -> dict[str, set[str]]:
    """A COCO-2014 layout with non-contiguous category ids; returns id -> category names."""
    categories = [{"id": 1, "name": "person"}, {"id": 3, "name": "car"}, {"id": 7, "name": "train"}]
    expected = {}
    for official, count, offset in (("train", num_train, 0), ("val", num_test, 100)):
        images, annotations = [], []
        for k in range(count):
            image_id = offset + k + 1
            file_name = f"COCO_{official}2014_{image_id:012d}.jpg"
            write_jpeg(root / f"{official}2014" / file_name, seed=image_id)
            images.append({"id": image_id, "file_name": file_name})
            chosen = [categories[k % 3], categories[(k + 1) % 3]][: 1 + k % 2]
            for category in chosen:
                annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": category["id"]})
            expected[f"{official}2014/{file_name}"] = {category["name"] for category in chosen}
        (root / "annotations").mkdir(parents=True, exist_ok=True)
        content = {"images": images, "annotations": annotations, "categories": categories}
        (root / "annotations" / f"instances_{official}2014.json").write_text(json.dumps(content))
    return expected


def write_cub_dataset(root: Path, num_images: int = 10, num_attributes: int = 4) -> dict[str, set[str]]:
    """A CUB-200-2011 layout (attributes.txt next to CUB_200_2011/); returns id -> attribute names."""
    folder = root / "CUB_200_2011"
    (folder / "attributes").mkdir(parents=True, exist_ok=True)
    names = [f"has_part::{k}" for k in range(num_attributes)]
    (root / "attributes.txt").write_text("".join(f"{k + 1} {name}\n" for k, name in enumerate(names)))
    images, split, labels, expected = [], [], [], {}
    for image_id in range(1, num_images + 1):
        relative = f"{image_id:03d}.Bird/Bird_{image_id}.jpg"
        write_jpeg(folder / "images" / relative, seed=image_id)
        images.append(f"{image_id} {relative}\n")
        split.append(f"{image_id} {0 if image_id % 3 == 0 else 1}\n")
        present = {k for k in range(num_attributes) if (image_id + k) % 2 == 0}
        labels += [f"{image_id} {k + 1} {int(k in present)} 3 1.5\n" for k in range(num_attributes)]
        expected[f"CUB_200_2011/images/{relative}"] = {names[k] for k in present}
    (folder / "images.txt").write_text("".join(images))
    (folder / "train_test_split.txt").write_text("".join(split))
    (folder / "attributes" / "image_attribute_labels.txt").write_text("".join(labels))
    return expected
