"""A small synthetic multi-label dataset in the real PASCAL VOC 2012 layout, for the demo and the tests.

Each image shows 1-3 objects (1.5 on average, like VOC) on a grey background, one per quadrant so none hides
another. Each of the 20 VOC classes has its own look, a (colour, shape) pair: ten colours, each drawn either
as a disc or as a square. Colour alone narrows an object to two classes; shape decides between them.

The demo often runs without ImageNet weights, so the looks were chosen for a frozen ResNet-50 with random
weights (torchvision `resnet50(weights=None)`, eval mode, global-average-pooled). Measured on the defaults
(400 + 200 images, seed 0), a logistic regression on those features with full labels reaches 60-62 mAP at
64 px and 61-67 mAP at 128 px input (two init seeds), against 7 for chance (the test set's positive rate).

About one object in ten is "difficult": drawn small and faint, annotated with `<difficult>1</difficult>`,
and, when it is the only object of its class in the image, flagged 0 in `<class>_{train,val}.txt` exactly as
VOC does (a negative under the reference's rules). Every image has at least one non-difficult object, so
the VOC reader keeps every image.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from xml.sax.saxutils import escape

import numpy as np
from PIL import Image, ImageDraw

from spml_cache.datasets.voc import CLASSES
from spml_cache.options.demo import DemoData
from spml_cache.runtime.errors import SpmlError

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 30),
    "cyan": (40, 210, 220),
    "magenta": (210, 40, 200),
    "orange": (250, 140, 20),
    "purple": (110, 40, 150),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
SHAPES = ("disc", "square")
# class -> (colour, shape): aeroplane red disc, bicycle red square, bird green disc, ...
LOOKS = {name: (list(COLOURS)[i // 2], SHAPES[i % 2]) for i, name in enumerate(CLASSES)}
DIFFICULT_RATE = 0.1
# With random-init features, a background whose brightness varies between images and small objects each cost
# about 10 mAP points, so the background is one fixed grey (with mild pixel noise) and an object fills most of
# its quadrant.
BACKGROUND = 128
NOISE_STD = 8.0
OBJECT_EXTENT = (0.8, 0.98)  # side of an object / side of its quadrant
DIFFICULT_SCALE = 0.4  # a difficult object is this much smaller
# P(1, 2, 3 objects): 1.5 on average, VOC's label cardinality; every extra object blurs the pooled features
OBJECT_COUNT_PROBS = (0.6, 0.3, 0.1)
IMAGE_DIR = Path("VOCdevkit") / "VOC2012"


def draw_object(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], colour: tuple) -> None:
    if shape == "disc":
        draw.ellipse(box, fill=colour)
    else:
        draw.rectangle(box, fill=colour)


def draw_image(rng: np.random.RandomState, size: int) -> tuple[Image.Image, list[dict]]:
    """One image and its objects: [{"name", "difficult", "box": (xmin, ymin, xmax, ymax) 1-based}]."""
    pixels = BACKGROUND + rng.normal(0, NOISE_STD, size=(size, size, 3))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    num_objects = 1 + rng.choice(len(OBJECT_COUNT_PROBS), p=OBJECT_COUNT_PROBS)
    classes = rng.choice(len(CLASSES), size=num_objects, replace=False)
    quadrants = rng.choice(4, size=num_objects, replace=False)
    difficult = rng.rand(num_objects) < DIFFICULT_RATE
    if difficult.all():
        difficult[rng.randint(num_objects)] = False
    half = size // 2
    objects = []
    for index, quadrant, hard in zip(classes, quadrants, difficult):
        name = CLASSES[index]
        colour_name, shape = LOOKS[name]
        extent = int(half * rng.uniform(*OBJECT_EXTENT) * (DIFFICULT_SCALE if hard else 1.0))
        extent = max(extent, 3)
        left = (quadrant % 2) * half + rng.randint(0, half - extent + 1)
        top = (quadrant // 2) * half + rng.randint(0, half - extent + 1)
        colour = np.array(COLOURS[colour_name]) + rng.randint(-20, 21, size=3)
        if hard:  # faint: halfway to the background
            colour = (colour + BACKGROUND) / 2
        colour = tuple(int(c) for c in np.clip(colour, 0, 255))
        box = (left, top, left + extent - 1, top + extent - 1)
        draw_object(draw, shape, box, colour)
        objects.append({"name": name, "difficult": bool(hard), "box": tuple(b + 1 for b in box)})
    return image, objects


def annotation_xml(image_id: str, size: int, objects: list[dict]) -> str:
    parts = [
        "<annotation>",
        "\t<folder>VOC2012</folder>",
        f"\t<filename>{escape(image_id)}.jpg</filename>",
        "\t<source><database>spml-cache demo data</database></source>",
        f"\t<size><width>{size}</width><height>{size}</height><depth>3</depth></size>",
        "\t<segmented>0</segmented>",
    ]
    for obj in objects:
        xmin, ymin, xmax, ymax = obj["box"]
        parts += [
            "\t<object>",
            f"\t\t<name>{obj['name']}</name>",
            "\t\t<pose>Unspecified</pose>",
            "\t\t<truncated>0</truncated>",
            f"\t\t<difficult>{int(obj['difficult'])}</difficult>",
            f"\t\t<bndbox><xmin>{xmin}</xmin><ymin>{ymin}</ymin><xmax>{xmax}</xmax><ymax>{ymax}</ymax></bndbox>",
            "\t</object>",
        ]
    parts.append("</annotation>")
    return "\n".join(parts) + "\n"


def class_flag(name: str, objects: list[dict]) -> int:
    """VOC's per-class flag: 1 a non-difficult object of the class, 0 only difficult ones, -1 none."""
    present = [obj["difficult"] for obj in objects if obj["name"] == name]
    if not present:
        return -1
    return 0 if all(present) else 1


def write_dataset(folder: Path, splits: dict[str, int], size: int, seed: int) -> None:
    """Everything under folder/VOCdevkit; splits maps the VOC image-set name to its number of images."""
    voc = folder / IMAGE_DIR
    for sub in ("JPEGImages", "Annotations", "ImageSets/Main"):
        (voc / sub).mkdir(parents=True, exist_ok=True)
    rng = np.random.RandomState(seed)
    number = 0
    for image_set, count in splits.items():
        flags = {name: [] for name in CLASSES}
        ids = []
        for _ in range(count):
            number += 1
            image_id = f"demo_{number:06d}"
            image, objects = draw_image(rng, size)
            image.save(voc / "JPEGImages" / f"{image_id}.jpg", quality=90)
            (voc / "Annotations" / f"{image_id}.xml").write_text(annotation_xml(image_id, size, objects))
            ids.append(image_id)
            for name in CLASSES:
                flags[name].append(class_flag(name, objects))
        main = voc / "ImageSets" / "Main"
        (main / f"{image_set}.txt").write_text("".join(f"{image_id}\n" for image_id in ids))
        for name in CLASSES:
            lines = "".join(f"{image_id} {flag:>2}\n" for image_id, flag in zip(ids, flags[name]))
            (main / f"{name}_{image_set}.txt").write_text(lines)


def write_demo_data(given: DemoData) -> Path:
    """`spml-cache make-demo-data`'s door: `make_demo_data` with its declared options (options/demo.py)."""
    return make_demo_data(given.folder, num_train=given.num_train, num_test=given.num_test, size=given.size,
                          seed=given.seed, overwrite=given.overwrite)


def make_demo_data(
    root: Path, *, num_train: int = 400, num_test: int = 200, size: int = 128, seed: int = 0, overwrite: bool = False
) -> Path:
    """Write the demo dataset under `root` (which then holds VOCdevkit/) and return root.

    `num_train` images form VOC's `train` image set (our train + val), `num_test` its `val` set (our test).
    The dataset is built in a temporary folder next to its destination and moved into place only when
    complete, so a failure leaves nothing half-written. With `overwrite`, an existing `root/VOCdevkit` is
    replaced; without it, it is an error.
    """
    root = Path(root)
    if num_train < 1 or num_test < 1:
        raise SpmlError(f"--train ({num_train}) and --test ({num_test}) must each be at least 1")
    if size < 16:
        raise SpmlError(f"--size {size} is too small to draw on; use at least 16 pixels")
    target = root / "VOCdevkit"
    if target.exists() and not overwrite:
        raise SpmlError(f"{target} already exists; pick another folder or pass --overwrite to replace it")
    if root.exists() and not root.is_dir():
        raise SpmlError(f"{root} is a file; pass a folder for the demo data")
    created = not root.exists()
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".demo-data-", dir=root))
    except OSError as err:
        raise SpmlError(f"cannot write the demo data in {root} ({err.strerror or err}): pick a writable folder") from None
    try:
        write_dataset(staging, {"train": num_train, "val": num_test}, size, seed)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging / "VOCdevkit", target)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            shutil.rmtree(root, ignore_errors=True)
        if isinstance(err, OSError):  # a full disk, a folder made read-only meanwhile
            raise SpmlError(f"cannot write the demo data in {root} ({err.strerror or err}): free some space, or"
                            " pick a writable folder") from None
        raise
    shutil.rmtree(staging, ignore_errors=True)
    return root
