"""The demo-data generator: real VOC layout, read back by the VOC reader, labels = what was drawn."""

import xml.etree.ElementTree as ET

import numpy as np
import pytest
from PIL import Image

from spml_cache import datasets
from spml_cache.demo.data import make_demo_data
from spml_cache.runtime.errors import SpmlError

VOC_CLASSES = (
    "aeroplane bicycle bird boat bottle bus car cat chair cow diningtable dog horse motorbike person "
    "pottedplant sheep sofa train tvmonitor"
).split()


def objects_of(xml_path):
    """[(name, difficult, (xmin, ymin, xmax, ymax))] from one VOC annotation file."""
    found = []
    for obj in ET.parse(xml_path).getroot().iter("object"):
        box = obj.find("bndbox")
        coords = tuple(int(box.find(tag).text) for tag in ("xmin", "ymin", "xmax", "ymax"))
        found.append((obj.find("name").text, obj.find("difficult").text == "1", coords))
    return found


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    assert make_demo_data(root, num_train=40, num_test=12, size=32, seed=5) == root
    return root


def test_demo_data_reads_back_with_the_drawn_labels(demo_root):
    images = datasets.read("voc", demo_root)
    assert images.classes == VOC_CLASSES
    assert (len(images.train), len(images.test)) == (40, 12)
    voc = demo_root / "VOCdevkit" / "VOC2012"
    num_difficult = 0
    for split in (images.train, images.test):
        assert split.ids == sorted(split.ids)
        for image_id, row in zip(split.ids, split.labels):
            stem = image_id.rsplit("/", 1)[1][: -len(".jpg")]
            objects = objects_of(voc / "Annotations" / f"{stem}.xml")
            assert 1 <= len(objects) <= 3
            expected = np.zeros(20, dtype=np.uint8)
            for name, difficult, (xmin, ymin, xmax, ymax) in objects:
                assert 1 <= xmin <= xmax <= 32 and 1 <= ymin <= ymax <= 32
                num_difficult += difficult
                if not difficult:
                    expected[VOC_CLASSES.index(name)] = 1
            np.testing.assert_array_equal(row, expected)
            with Image.open(images.path(image_id)) as image:
                assert (image.format, image.size, image.mode) == ("JPEG", (32, 32), "RGB")
    assert num_difficult > 0  # seed 5 draws some, so the flag-0 path below is exercised


def test_demo_class_files_flag_difficult_only_objects_zero(demo_root):
    main = demo_root / "VOCdevkit" / "VOC2012" / "ImageSets" / "Main"
    zeros = 0
    for image_set in ("train", "val"):
        ids = main.joinpath(f"{image_set}.txt").read_text().split()
        assert len(ids) == (40 if image_set == "train" else 12)
        for name in VOC_CLASSES:
            lines = [line.split() for line in main.joinpath(f"{name}_{image_set}.txt").read_text().splitlines()]
            assert [image_id for image_id, _ in lines] == ids
            for image_id, flag in lines:
                present = [d for n, d, _ in objects_of(demo_root / "VOCdevkit/VOC2012/Annotations" / f"{image_id}.xml")
                           if n == name]
                expected = -1 if not present else (0 if all(present) else 1)
                assert int(flag) == expected
                zeros += expected == 0
    assert zeros > 0


def test_demo_data_is_deterministic_and_refuses_to_overwrite(tmp_path, demo_root):
    make_demo_data(tmp_path, num_train=40, num_test=12, size=32, seed=5)
    first = demo_root / "VOCdevkit/VOC2012/JPEGImages/demo_000007.jpg"
    again = tmp_path / "VOCdevkit/VOC2012/JPEGImages/demo_000007.jpg"
    assert again.read_bytes() == first.read_bytes()
    with pytest.raises(SpmlError, match="already exists.*--overwrite"):
        make_demo_data(tmp_path, num_train=2, num_test=2, size=32)
    make_demo_data(tmp_path, num_train=2, num_test=3, size=32, overwrite=True)
    images = datasets.read("voc", tmp_path)
    assert (len(images.train), len(images.test)) == (2, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["VOCdevkit"]  # no staging folder left behind


@pytest.mark.parametrize("kwargs", [{"num_train": 0}, {"num_test": -1}, {"size": 8}])
def test_demo_data_bad_arguments_write_nothing(tmp_path, kwargs):
    target = tmp_path / "out"
    with pytest.raises(SpmlError):
        make_demo_data(target, **{"num_train": 2, "num_test": 2, "size": 32, **kwargs})
    assert not target.exists()
