"""NUS-WIDE, CUB-200-2011 and CSV readers on tiny datasets written here in the real on-disk layouts."""

import re
from pathlib import Path

import numpy as np
import pytest

from spml_cache import datasets
from spml_cache.runtime.errors import SpmlError

JPEG = b"\xff\xd8\xff\xe0 not decoded by the readers \xff\xd9"

# ------------------------------------------------------------------------------------------------ NUS-WIDE

NUS_CONCEPTS = ["sky", "animal", "water"]  # Concepts81.txt order, not alphabetical
NUS_TRAIN = [("actor\\0001_11.jpg", [1, 0, 1]), ("zebra\\0002_22.jpg", [0, 0, 0]), ("actor\\0003_33.jpg", [0, 1, 0])]
NUS_TEST = [("beach\\0004_44.jpg", [0, 0, 1]), ("beach\\0005_55.jpg", [1, 1, 0])]


def write_nus(root: Path) -> None:
    (root / "ConceptsList").mkdir(parents=True)
    (root / "ConceptsList" / "Concepts81.txt").write_text("".join(f"{c}\r\n" for c in NUS_CONCEPTS))
    (root / "ImageList").mkdir()
    labels_dir = root / "Groundtruth" / "TrainTestLabels"
    labels_dir.mkdir(parents=True)
    for official, rows in (("Train", NUS_TRAIN), ("Test", NUS_TEST)):
        (root / "ImageList" / f"{official}Imagelist.txt").write_text("".join(f"{name}\r\n" for name, _ in rows))
        for index, concept in enumerate(NUS_CONCEPTS):
            column = "".join(f"{flags[index]}\n" for _, flags in rows)
            (labels_dir / f"Labels_{concept}_{official}.txt").write_text(column)
        for name, _ in rows:
            image = root / "Flickr" / Path(*name.split("\\"))
            image.parent.mkdir(parents=True, exist_ok=True)
            image.write_bytes(JPEG)


@pytest.fixture
def nus_root(tmp_path):
    write_nus(tmp_path)
    return tmp_path


def test_nus_reads_backslash_lists_and_keeps_rows_without_positives(nus_root):
    images = datasets.read("nus", nus_root)
    assert images.classes == NUS_CONCEPTS
    assert images.train.ids == ["Flickr/actor/0001_11.jpg", "Flickr/zebra/0002_22.jpg", "Flickr/actor/0003_33.jpg"]
    np.testing.assert_array_equal(images.train.labels, np.array([[1, 0, 1], [0, 0, 0], [0, 1, 0]], dtype=np.uint8))
    assert images.test.ids == ["Flickr/beach/0004_44.jpg", "Flickr/beach/0005_55.jpg"]
    np.testing.assert_array_equal(images.test.labels, np.array([[0, 0, 1], [1, 1, 0]], dtype=np.uint8))
    assert any(note.startswith("1 training images have no positive") for note in images.notes)
    assert all(images.path(image_id).is_file() for image_id in images.train.ids + images.test.ids)


def test_nus_missing_image_is_an_error_unless_skipped(nus_root):
    (nus_root / "Flickr" / "zebra" / "0002_22.jpg").unlink()
    with pytest.raises(SpmlError, match=r"1 of 5 image files are missing.*Flickr/zebra/0002_22\.jpg.*--skip-missing"):
        datasets.read("nus", nus_root)
    images = datasets.read("nus", nus_root, skip_missing=True)
    assert images.skipped == ["Flickr/zebra/0002_22.jpg"]
    assert images.train.ids == ["Flickr/actor/0001_11.jpg", "Flickr/actor/0003_33.jpg"]
    np.testing.assert_array_equal(images.train.labels, np.array([[1, 0, 1], [0, 1, 0]], dtype=np.uint8))


def test_nus_label_file_errors_name_file_and_line(nus_root):
    path = nus_root / "Groundtruth" / "TrainTestLabels" / "Labels_animal_Test.txt"
    path.write_text("0\n2\n")
    with pytest.raises(SpmlError, match=f"{path}, line 2:"):
        datasets.read("nus", nus_root)
    path.write_text("0\n")
    with pytest.raises(SpmlError, match=f"{path}: 1 labels for 2 images"):
        datasets.read("nus", nus_root)
    path.unlink()
    with pytest.raises(SpmlError, match=f"missing {path}"):
        datasets.read("nus", nus_root)


def test_nus_missing_lists_name_the_expected_path(nus_root):
    path = nus_root / "ImageList" / "TestImagelist.txt"
    path.unlink()
    with pytest.raises(SpmlError, match=f"missing {path}"):
        datasets.read("nus", nus_root)


# ------------------------------------------------------------------------------------------------ CUB

CUB_ATTRIBUTES = ["has_bill_shape::curved", "has_wing_color::blue", "has_size::small_(5_-_9_in)"]
CUB_IMAGES = [  # (image id, path under images/, is_train, is_present per attribute), images.txt order
    (1, "001.Albatross/a_1.jpg", 1, [1, 0, 0]),
    (2, "001.Albatross/a_2.jpg", 0, [0, 1, 1]),
    (3, "002.Auklet/b_3.jpg", 1, [0, 0, 0]),
    (4, "002.Auklet/b_4.jpg", 1, [1, 1, 0]),
]


def write_cub(root: Path, attributes_at: str) -> None:
    cub = root / "CUB_200_2011"
    (cub / "attributes").mkdir(parents=True)
    (cub / "images.txt").write_text("".join(f"{i} {p}\n" for i, p, _, _ in CUB_IMAGES))
    (cub / "train_test_split.txt").write_text("".join(f"{i} {t}\n" for i, _, t, _ in CUB_IMAGES))
    lines = []
    for image_id, _, _, present in CUB_IMAGES:
        for attribute, flag in enumerate(present, start=1):
            certainty = 4 if flag else 1
            lines.append(f"{image_id} {attribute} {flag} {certainty} 12.5")
    lines[4] = lines[4] + " 0 7.25"  # real files have a few lines with extra tokens
    (cub / "attributes" / "image_attribute_labels.txt").write_text("\n".join(lines) + "\n")
    attributes = "".join(f"{i} {name}\n" for i, name in enumerate(CUB_ATTRIBUTES, start=1))
    (root / attributes_at).write_text(attributes)
    for _, path, _, _ in CUB_IMAGES:
        (cub / "images" / path).parent.mkdir(parents=True, exist_ok=True)
        (cub / "images" / path).write_bytes(JPEG)


ATTRIBUTE_PLACES = ["attributes.txt", "CUB_200_2011/attributes.txt", "CUB_200_2011/attributes/attributes.txt"]


@pytest.mark.parametrize("attributes_at", ATTRIBUTE_PLACES)
def test_cub_reads_is_present_in_images_txt_order(tmp_path, attributes_at):
    write_cub(tmp_path, attributes_at)
    images = datasets.read("cub", tmp_path)
    assert images.classes == CUB_ATTRIBUTES
    assert images.train.ids == [f"CUB_200_2011/images/{p}" for p in ("001.Albatross/a_1.jpg", "002.Auklet/b_3.jpg",
                                                                    "002.Auklet/b_4.jpg")]
    np.testing.assert_array_equal(images.train.labels, np.array([[1, 0, 0], [0, 0, 0], [1, 1, 0]], dtype=np.uint8))
    assert images.test.ids == ["CUB_200_2011/images/001.Albatross/a_2.jpg"]
    np.testing.assert_array_equal(images.test.labels, np.array([[0, 1, 1]], dtype=np.uint8))


def test_cub_without_attributes_txt_names_all_three_places(tmp_path):
    write_cub(tmp_path, "attributes.txt")
    (tmp_path / "attributes.txt").unlink()
    with pytest.raises(SpmlError) as caught:
        datasets.read("cub", tmp_path)
    for place in ATTRIBUTE_PLACES:
        assert str(tmp_path / place) in str(caught.value)


def test_cub_incomplete_labels_are_an_error(tmp_path):
    write_cub(tmp_path, "attributes.txt")
    path = tmp_path / "CUB_200_2011" / "attributes" / "image_attribute_labels.txt"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(SpmlError, match=f"{path}: 1 of 12 .* labels are missing"):
        datasets.read("cub", tmp_path)


@pytest.mark.parametrize(
    "bad, problem",
    [
        ("1 3 yes 3 1.0", "expected '<image id> <attribute id> <0|1> ...'"),
        ("1 3 2 3 1.0", "expected '<image id> <attribute id> <0|1> ...'"),
        ("9 3 1 3 1.0", "image id 9 is not in images.txt"),
        ("1 313 1 3 1.0", "attribute id 313 is outside 1..3"),
        ("1 3", "expected '<image id> <attribute id> <0|1> ...'"),
    ],
)
def test_cub_bad_label_line_names_file_and_line(tmp_path, bad, problem):
    write_cub(tmp_path, "attributes.txt")
    path = tmp_path / "CUB_200_2011" / "attributes" / "image_attribute_labels.txt"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2] + [bad] + lines[3:]) + "\n")
    with pytest.raises(SpmlError, match=f"{path}, line 3: {re.escape(problem)}"):
        datasets.read("cub", tmp_path)


def test_cub_missing_split_file_names_it(tmp_path):
    write_cub(tmp_path, "attributes.txt")
    path = tmp_path / "CUB_200_2011" / "train_test_split.txt"
    path.unlink()
    with pytest.raises(SpmlError, match=f"missing {path}"):
        datasets.read("cub", tmp_path)


# ------------------------------------------------------------------------------------------------ CSV


def write_csv(folder: Path, text: str, name: str = "labels.csv", images=()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    for image in images:
        (folder / image).parent.mkdir(parents=True, exist_ok=True)
        (folder / image).write_bytes(JPEG)
    return folder / name


def test_csv_with_split_column(tmp_path):
    text = (
        "path,labels,split\n"
        "img/a.jpg,dog|cat,train\n"
        "img\\b.jpg,,train\n"
        '"img/c,1.jpg",zebra,test\n'
        "img/d.jpg, cat ,Test\n"
    )
    write_csv(tmp_path, text, images=["img/a.jpg", "img/b.jpg", "img/c,1.jpg", "img/d.jpg"])
    images = datasets.read("csv", tmp_path)
    assert images.root == tmp_path
    assert images.classes == ["cat", "dog", "zebra"]
    assert images.train.ids == ["img/a.jpg", "img/b.jpg"]
    np.testing.assert_array_equal(images.train.labels, np.array([[1, 1, 0], [0, 0, 0]], dtype=np.uint8))
    assert images.test.ids == ["img/c,1.jpg", "img/d.jpg"]
    np.testing.assert_array_equal(images.test.labels, np.array([[0, 0, 1], [1, 0, 0]], dtype=np.uint8))


def test_csv_without_split_holds_out_20_percent_with_seed_1200(tmp_path):
    names = ["a", "b", "c"]
    rows = [(f"x/{i:02d}.jpg", names[i % 3]) for i in range(12)]
    path = write_csv(tmp_path / "data", "path,labels\n" + "".join(f"{p},{n}\n" for p, n in rows),
                     name="mine.csv", images=[p for p, _ in rows])
    images = datasets.read("csv", path)  # the CSV file itself as the root
    assert images.root == tmp_path / "data"
    perm = np.random.RandomState(1200).permutation(12)
    test_rows = sorted(perm[12 - round(0.2 * 12):].tolist())
    train_rows = sorted(perm[: 12 - round(0.2 * 12)].tolist())
    assert len(test_rows) == 2
    assert images.test.ids == [rows[i][0] for i in test_rows]
    assert images.train.ids == [rows[i][0] for i in train_rows]
    expected = np.zeros((12, 3), dtype=np.uint8)
    expected[np.arange(12), np.arange(12) % 3] = 1
    np.testing.assert_array_equal(images.train.labels, expected[train_rows])
    np.testing.assert_array_equal(images.test.labels, expected[test_rows])
    assert any("RandomState(1200)" in note for note in images.notes)


@pytest.mark.parametrize(
    "text, message",
    [
        ("path,labels,weight\na.jpg,cat,1\n", r"line 1: a labels column and class columns \('weight'"),
        ("path,split,cat\na.jpg,train,1\nb.jpg,test,yes\n", r"line 3: column 'cat' holds 'yes'"),
        ("labels\ncat\n", r"line 1: no 'path' column"),
        ("path,labels,split\na.jpg,cat,train\nb.jpg,dog,validation\n", r"line 3: split 'validation'"),
        ("path,labels,split\na.jpg,,train\nb.jpg,,test\n", r"no row has a label"),
        ("path,labels\na.jpg,cat,extra\n", r"line 2: 3 fields for 2 columns"),
        ("", r"the file is empty"),
        ("path,labels,split\na.jpg,cat,train\n", r"test split has no images"),
        ("path,labels,split\na.jpg,cat,train\n./a.jpg,dog,test\n", r"image a.jpg is listed twice"),
        ("path,labels\n/abs/a.jpg,cat\n", r"line 2: path '/abs/a.jpg' is absolute"),
        ("path,labels,split\na.jpg,cat,train\nsub/../a.jpg,dog,test\n", r"image a.jpg is listed twice"),
        ("path,labels\n../a.jpg,cat\n", r"line 2: path '../a.jpg' is outside"),
        ("path,labels,split\na.jpg,Cat,train\nb.jpg,cat|CAT ,test\n", r"the labels 'CAT', 'Cat', 'cat' differ only in case"),
    ],
)
def test_csv_bad_input_names_the_file(tmp_path, text, message):
    path = write_csv(tmp_path, text, images=["a.jpg", "b.jpg"])
    with pytest.raises(SpmlError, match=f"{path}.*{message}"):
        datasets.read("csv", tmp_path)


def test_csv_missing_file_and_missing_images(tmp_path):
    with pytest.raises(SpmlError, match=str(tmp_path / "labels.csv")):
        datasets.read("csv", tmp_path)
    write_csv(tmp_path, "path,labels,split\na.jpg,cat,train\nb.jpg,dog,test\n", images=["a.jpg"])
    with pytest.raises(SpmlError, match=r"1 of 2 image files are missing.*b\.jpg"):
        datasets.read("csv", tmp_path)
