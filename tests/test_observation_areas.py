"""The rules drawn from instance areas, `largest` and `size` (Cole et al.'s biased labels), and the instance areas
they read: VOC's boxes."""

from __future__ import annotations

import re

import numpy as np
import pytest

from spml_cache import datasets, observation
from spml_cache.datasets import voc
from spml_cache.demo.data import make_demo_data
from spml_cache.observation import Areas, parse_rule
from spml_cache.runtime.errors import SpmlError


def test_largest_observes_the_class_of_the_largest_positive_instance():
    labels = np.array([[1, 1, 0], [0, 1, 1], [1, 1, 1], [0, 0, 0], [1, 0, 0]], dtype=np.uint8)
    largest = np.array([[5, 9, 50], [0, 4, 4], [7, 2, 3], [1, 1, 1], [0, 0, 0]], dtype=float)  # 50: not a positive
    observed = parse_rule("largest").draw(labels, Areas(largest, largest * 2))
    # row by row: the positive class with the largest instance; a tie goes to the first; no area, nothing observed
    assert observed.tolist() == [[0, 1, 0], [0, 1, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]]


def test_size_draws_in_proportion_to_the_total_area():
    rows = 4000
    labels = np.tile(np.array([1, 1, 1, 0], dtype=np.uint8), (rows, 1))
    total = np.tile(np.array([1.0, 3.0, 6.0, 50.0]), (rows, 1))  # the negative class's area never counts
    observed = parse_rule("size").draw(labels, Areas(total, total))
    assert (observed.sum(axis=1) == 1).all() and not observed[:, 3].any()
    for column, share in enumerate((0.1, 0.3, 0.6)):
        count = int(observed[:, column].sum())
        assert abs(count - rows * share) <= 6 * np.sqrt(rows * share * (1 - share))
    assert np.array_equal(observed, parse_rule("size").draw(labels, Areas(total, total)))


def test_area_rules_refuse_to_draw_without_areas():
    with pytest.raises(SpmlError, match="--observe largest: needs instance areas"):
        parse_rule("largest").draw(np.ones((2, 3), dtype=np.uint8))
    with pytest.raises(SpmlError, match="--observe size: needs instance areas .*extract the dataset with --observe"):
        observation.draw_splits(parse_rule("size"), np.ones((2, 3)), np.ones((1, 3)), attrs={})


def boxes_restated(xml: str) -> list[tuple[str, bool, float]]:
    """(class, difficult, area) of every object of a VOC annotation, by regular expressions."""
    found = []
    for block in re.findall(r"<object>(.*?)</object>", xml, flags=re.S):
        value = lambda tag: re.search(rf"<{tag}>\s*([^<]*?)\s*</{tag}>", block).group(1)  # noqa: E731
        area = (float(value("xmax")) - float(value("xmin")) + 1) * (float(value("ymax")) - float(value("ymin")) + 1)
        found.append((value("name"), value("difficult") == "1", area))
    return found


def test_voc_areas_are_the_boxes_of_the_non_difficult_objects(tmp_path):
    root = make_demo_data(tmp_path, num_train=12, num_test=2, size=40, seed=3)
    images = datasets.read("voc", root)
    largest, total = datasets.instance_areas(images, images.train.ids)
    assert largest.shape == total.shape == images.train.labels.shape
    for row, image_id in enumerate(images.train.ids):
        xml = (root / voc.ANNOTATION_DIR / image_id.rsplit("/", 1)[1].replace(".jpg", ".xml")).read_text()
        for column, name in enumerate(voc.CLASSES):
            areas = [area for cls, difficult, area in boxes_restated(xml) if cls == name and not difficult]
            assert largest[row, column] == max(areas, default=0) and total[row, column] == sum(areas)
        assert ((largest[row] > 0) == (images.train.labels[row] == 1)).all()  # a positive is a non-difficult box


def test_datasets_without_areas_say_so():
    empty = datasets.ImageSplit([], np.zeros((0, 1)))
    images = datasets.LabeledImages(dataset="cub", root=None, classes=["a"], train=empty, test=empty)
    assert datasets.instance_areas(images, []) is None
