"""What a user types reaches the terminal as text: paths and names holding rich markup (`x[/]y`, `[bold]`) are
printed as typed, never parsed (a MarkupError after the work was done, or a bracketed part silently eaten)."""

import json

import pytest
from cli_support import run_cli
from linear_support import write_synthetic_cache


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    return write_synthetic_cache(tmp_path_factory.mktemp("cache") / "voc-resnet50-448.h5", train=40, val=16, test=20,
                                 classes=4, dim=8)


def test_linear_with_a_bracketed_out_folder_trains_and_names_it(tmp_path, tiny_cache):
    done = run_cli("linear", "--cache", str(tiny_cache), "--loss", "an", "--lr", "1e-2", "--batch-size", "8",
                   "--epochs", "1", "--out", "x[/]y", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "x[" / "]y" / "voc").iterdir()
    assert json.loads((run_dir / "results.json").read_text())["complete"] is True
    assert f"run directory: x[/]y/voc/{run_dir.name}" in done.stdout


def test_make_demo_data_and_extract_print_bracketed_paths_as_typed(tmp_path):
    done = run_cli("make-demo-data", "d[bold]ata", "--train", "8", "--test", "4", "--size", "32", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "under d[bold]ata" in done.stdout and "--root 'd[bold]ata'" in done.stdout  # the next command pastes
    done = run_cli("extract", "voc", "--root", "d[bold]ata", "--dry-run", "--weights", "none", "--out", "c[/]d.h5",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "dry run: c[/]d.h5" in done.stdout and not (tmp_path / "c[").exists()
