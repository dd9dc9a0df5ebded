"""VOC 2012 and COCO 2014 readers on tiny datasets written here in the real on-disk layouts."""

import json
from pathlib import Path

import numpy as np
import pytest

from spml_cache import datasets
from spml_cache.runtime.errors import SpmlError

VOC_CLASSES = (
    "aeroplane bicycle bird boat bottle bus car cat chair cow diningtable dog horse motorbike person "
    "pottedplant sheep sofa train tvmonitor"
).split()
JPEG = b"\xff\xd8\xff\xe0 not decoded by the readers \xff\xd9"


def write_voc(root: Path, flags: dict[str, dict[str, dict[str, int]]], images: bool = True) -> None:
    """flags[image_set][image_id][class] = 1 / 0 / -1 (absent classes are -1); every class file is written."""
    main = root / "VOCdevkit" / "VOC2012" / "ImageSets" / "Main"
    main.mkdir(parents=True)
    (root / "VOCdevkit" / "VOC2012" / "JPEGImages").mkdir()
    for image_set, per_image in flags.items():
        for name in VOC_CLASSES:
            # real VOC pads positive flags with a second space
            lines = [f"{image_id} {per_image[image_id].get(name, -1):>2}\n" for image_id in per_image]
            (main / f"{name}_{image_set}.txt").write_text("".join(lines))
        if images:
            for image_id in per_image:
                (root / "VOCdevkit" / "VOC2012" / "JPEGImages" / f"{image_id}.jpg").write_bytes(JPEG)


VOC_FLAGS = {
    "train": {
        "2008_000002": {"aeroplane": 1, "cat": -1},
        "2008_000001": {"cat": 1, "dog": 0},  # dog: difficult only -> negative
        "2008_000003": {"dog": 0},  # no positive at all -> left out
    },
    "val": {
        "2009_000010": {"person": 1, "tvmonitor": 1},
        "2009_000005": {"bird": 1, "sheep": 0},
    },
}


@pytest.fixture
def voc_root(tmp_path):
    write_voc(tmp_path, VOC_FLAGS)
    return tmp_path


def voc_id(image_id):
    return f"VOCdevkit/VOC2012/JPEGImages/{image_id}.jpg"


def one_hot_rows(classes, rows):
    labels = np.zeros((len(rows), len(classes)), dtype=np.uint8)
    for i, names in enumerate(rows):
        for name in names:
            labels[i, classes.index(name)] = 1
    return labels


def test_voc_reads_official_train_as_train_and_val_as_test(voc_root):
    images = datasets.read("voc", voc_root)
    assert images.dataset == "voc"
    assert images.classes == VOC_CLASSES
    assert images.train.ids == [voc_id("2008_000001"), voc_id("2008_000002")]
    assert images.train.labels.dtype == np.uint8
    np.testing.assert_array_equal(images.train.labels, one_hot_rows(VOC_CLASSES, [["cat"], ["aeroplane"]]))
    assert images.test.ids == [voc_id("2009_000005"), voc_id("2009_000010")]
    np.testing.assert_array_equal(images.test.labels, one_hot_rows(VOC_CLASSES, [["bird"], ["person", "tvmonitor"]]))
    assert images.skipped == []
    assert any("1 official-train images without a positive" in note for note in images.notes)
    assert images.path(images.train.ids[0]).read_bytes() == JPEG


def test_voc_root_may_be_the_parent_of_a_voc_folder(voc_root, tmp_path_factory):
    parent = tmp_path_factory.mktemp("data")
    voc_root.rename(parent / "voc")
    images = datasets.read("voc", parent)
    assert images.root == parent / "voc"
    assert len(images.train) == 2


def test_voc_missing_root_and_missing_layout_name_the_expected_path(tmp_path):
    with pytest.raises(SpmlError, match="does not exist"):
        datasets.read("voc", tmp_path / "nowhere")
    with pytest.raises(SpmlError, match=str(tmp_path / "VOCdevkit" / "VOC2012")):
        datasets.read("voc", tmp_path)


def test_voc_missing_class_file_names_it(voc_root):
    path = voc_root / "VOCdevkit/VOC2012/ImageSets/Main/bird_val.txt"
    path.unlink()
    with pytest.raises(SpmlError, match=f"missing {path}"):
        datasets.read("voc", voc_root)


@pytest.mark.parametrize("bad", ["2008_000001  2", "2008_000001", "2008_000001 1 extra"])
def test_voc_malformed_line_names_file_and_line(voc_root, bad):
    path = voc_root / "VOCdevkit/VOC2012/ImageSets/Main/cow_train.txt"
    lines = path.read_text().splitlines()
    lines[1] = bad
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SpmlError, match=f"{path}, line 2:"):
        datasets.read("voc", voc_root)


def test_voc_missing_images_are_an_error_unless_skipped(voc_root):
    (voc_root / voc_id("2009_000010")).unlink()
    with pytest.raises(SpmlError, match=r"1 of 4 image files are missing.*2009_000010\.jpg"):
        datasets.read("voc", voc_root)
    images = datasets.read("voc", voc_root, skip_missing=True)
    assert images.skipped == [voc_id("2009_000010")]
    assert images.test.ids == [voc_id("2009_000005")]
    np.testing.assert_array_equal(images.test.labels, one_hot_rows(VOC_CLASSES, [["bird"]]))


def test_voc_without_any_positive_is_an_error(tmp_path):
    write_voc(tmp_path, {"train": {"a": {"cat": 0}}, "val": {"b": {"dog": 1}}})
    with pytest.raises(SpmlError, match="train split has no images"):
        datasets.read("voc", tmp_path)


def test_unknown_dataset_lists_the_valid_names(tmp_path):
    with pytest.raises(SpmlError, match="voc, coco, nus, cub, openimages, csv"):
        datasets.read("imagenet", tmp_path)
    assert datasets.names() == ["voc", "coco", "nus", "cub", "openimages", "csv"]


# ------------------------------------------------------------------------------------------------ COCO

COCO_CATEGORIES = [  # deliberately not in id order; ids not contiguous
    {"id": 90, "name": "toothbrush", "supercategory": "indoor"},
    {"id": 1, "name": "person", "supercategory": "person"},
    {"id": 7, "name": "train", "supercategory": "vehicle"},
    {"id": 3, "name": "car", "supercategory": "vehicle"},
]
COCO_CLASSES = ["person", "car", "train", "toothbrush"]  # ascending category id: 1, 3, 7, 90


def coco_file(split, image_id):
    return f"COCO_{split}2014_{image_id:012d}.jpg"


def write_coco(root: Path, annotations: dict[str, list[tuple[int, int, int]]], image_ids: dict[str, list[int]]):
    """annotations[split] = [(image id, category id, iscrowd)]."""
    (root / "annotations").mkdir(parents=True)
    for split, ids in image_ids.items():
        (root / f"{split}2014").mkdir()
        for image_id in ids:
            (root / f"{split}2014" / coco_file(split, image_id)).write_bytes(JPEG)
        data = {
            "info": {},
            "images": [{"id": i, "file_name": coco_file(split, i), "width": 8, "height": 8} for i in ids],
            "annotations": [
                {"id": n, "image_id": i, "category_id": c, "iscrowd": crowd, "bbox": [0, 0, 1, 1]}
                for n, (i, c, crowd) in enumerate(annotations[split])
            ],
            "categories": COCO_CATEGORIES,
        }
        (root / "annotations" / f"instances_{split}2014.json").write_text(json.dumps(data))


@pytest.fixture
def coco_root(tmp_path):
    write_coco(
        tmp_path,
        {
            "train": [(9, 1, 0), (9, 3, 0), (100, 90, 1), (25, 7, 0), (25, 7, 0), (10, 1, 1)],
            "val": [(2, 3, 0), (11, 1, 0), (11, 90, 0)],
        },
        {"train": [9, 10, 25, 55, 100], "val": [2, 11]},  # image 55 has no annotation
    )
    return tmp_path


def test_coco_classes_rows_and_labels(coco_root):
    images = datasets.read("coco", coco_root)
    assert images.classes == COCO_CLASSES
    # ids compared as strings: "10" < "100" < "25" < "9"
    assert images.train.ids == [f"train2014/{coco_file('train', i)}" for i in (10, 100, 25, 9)]
    np.testing.assert_array_equal(
        images.train.labels,
        one_hot_rows(COCO_CLASSES, [["person"], ["toothbrush"], ["train"], ["person", "car"]]),
    )
    assert images.test.ids == [f"val2014/{coco_file('val', i)}" for i in (11, 2)]
    np.testing.assert_array_equal(images.test.labels, one_hot_rows(COCO_CLASSES, [["person", "toothbrush"], ["car"]]))
    assert any("1 train2014 images without annotations" in note for note in images.notes)


def test_coco_without_categories_is_a_clear_error(coco_root):
    path = coco_root / "annotations" / "instances_val2014.json"
    data = json.loads(path.read_text())
    del data["categories"]
    path.write_text(json.dumps(data))
    with pytest.raises(SpmlError, match=f"{path}: no 'categories'"):
        datasets.read("coco", coco_root)


def test_coco_bad_json_and_missing_file_name_the_file(coco_root):
    path = coco_root / "annotations" / "instances_train2014.json"
    path.write_text("{not json")
    with pytest.raises(SpmlError, match=f"{path}: not valid JSON"):
        datasets.read("coco", coco_root)
    path.unlink()
    with pytest.raises(SpmlError, match=f"missing {path}"):
        datasets.read("coco", coco_root)


def test_coco_categories_must_agree_between_splits(coco_root):
    path = coco_root / "annotations" / "instances_val2014.json"
    data = json.loads(path.read_text())
    data["categories"] = data["categories"][1:]
    data["annotations"] = [a for a in data["annotations"] if a["category_id"] != 90]
    path.write_text(json.dumps(data))
    with pytest.raises(SpmlError, match="categories differ"):
        datasets.read("coco", coco_root)


def test_coco_missing_image_lists_count_and_id(coco_root):
    (coco_root / "train2014" / coco_file("train", 25)).unlink()
    with pytest.raises(SpmlError, match=r"1 of 6 image files are missing.*COCO_train2014_000000000025\.jpg"):
        datasets.read("coco", coco_root)
