"""`spml-cache datasets` and `spml-cache make-demo-data` as a user types them, from a subprocess."""

import pytest
from cli_support import run_cli

from spml_cache import datasets
from spml_cache.datasets.base import DatasetSurvey


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory):
    """A tiny VOC-layout dataset written by the command itself."""
    cwd = tmp_path_factory.mktemp("cli")
    result = run_cli("make-demo-data", "tiny", "--train", "6", "--test", "4", "--size", "32", "--seed", "1", cwd=cwd)
    assert result.returncode == 0, result.stderr
    assert "6 train + 4 test images" in result.stdout
    return cwd / "tiny"


def test_help_lists_the_commands(tmp_path):
    result = run_cli("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "datasets" in result.stdout and "make-demo-data" in result.stdout
    for command in ("datasets", "make-demo-data"):
        result = run_cli(command, "--help", cwd=tmp_path)
        assert result.returncode == 0 and "Example:" in result.stdout


def test_datasets_without_root_prints_every_layout(tmp_path):
    result = run_cli("datasets", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for expected in ("voc", "coco", "nus", "cub", "csv", "VOCdevkit/VOC2012", "instances_{train,val}2014.json",
                     "Concepts81.txt", "image_attribute_labels.txt", "SPML_DATA"):
        assert expected in result.stdout


def test_datasets_with_root_reports_what_was_found(demo_root):
    result = run_cli("datasets", "--root", str(demo_root), cwd=demo_root.parent)
    assert result.returncode == 0, result.stderr
    assert "train 6, test 4 images, 20 classes" in result.stdout
    assert f"not found: no {demo_root / 'annotations'}" in result.stdout
    # SPML_DATA is the default root; here the demo sits in its voc/ subfolder
    (demo_root.parent / "data").mkdir()
    (demo_root.parent / "data" / "voc").symlink_to(demo_root)
    result = run_cli("datasets", cwd=demo_root.parent, env={"SPML_DATA": "data"})
    assert "train 6, test 4 images, 20 classes" in result.stdout


def test_user_errors_are_one_red_line_exit_1(demo_root):
    result = run_cli("make-demo-data", str(demo_root), cwd=demo_root.parent)
    assert result.returncode == 1
    assert "already exists" in result.stderr and "Traceback" not in result.stderr
    result = run_cli("datasets", "--root", "no-such-folder", cwd=demo_root.parent)
    assert result.returncode == 1 and "no-such-folder does not exist" in result.stderr


def test_survey_without_root_describes_every_dataset():
    surveys = datasets.survey(None)
    assert [s.dataset for s in surveys] == ["voc", "coco", "nus", "cub", "openimages", "csv"]
    assert all(isinstance(s, DatasetSurvey) and s.layout and not s.found and s.problem is None for s in surveys)


def test_survey_counts_missing_images_instead_of_failing(demo_root, tmp_path):
    root = tmp_path / "copy"
    (root / "VOCdevkit/VOC2012").mkdir(parents=True)
    (root / "VOCdevkit/VOC2012/ImageSets").symlink_to(demo_root / "VOCdevkit/VOC2012/ImageSets")
    (root / "VOCdevkit/VOC2012/JPEGImages").mkdir()
    for kept in ("demo_000001.jpg", "demo_000007.jpg"):  # the first train and the first test image
        (root / "VOCdevkit/VOC2012/JPEGImages" / kept).symlink_to(demo_root / "VOCdevkit/VOC2012/JPEGImages" / kept)
    voc = datasets.survey(root)[0]
    assert voc.found and voc.counts == {"train": 1, "test": 1}
    assert len(voc.missing) == 8 and "VOCdevkit/VOC2012/JPEGImages/demo_000002.jpg" in voc.missing
    (root / "VOCdevkit/VOC2012/JPEGImages/demo_000007.jpg").unlink()
    voc = datasets.survey(root)[0]  # no test image left: the survey says so instead of raising
    assert not voc.found and "test split has no images" in voc.problem
