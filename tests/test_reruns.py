"""`--config RUN/config.json` (linear and finetune): a finished run rerun from its record gives the same results and
best models bit for bit; an option given beside it changes that one, said in one line, and the run equals the
same flags typed by hand; beside `--resume`, or on another stage's record, one line."""

import json
from pathlib import Path

import pytest
from cli_support import one_error_line, run_cli
from linear_support import quiet, write_synthetic_cache
from run_support import assert_same_run

from spml_cache.demo.data import make_demo_data
from spml_cache.linear import run_linear

GRID = ["--loss", "an,role", "--lr", "1e-2,1e-3", "--batch-size", "8", "--epochs", "3", "--device", "cpu"]


def made_run(done, folder: Path) -> Path:
    """The run directory a command printed (the one run under `folder` it made)."""
    assert done.returncode == 0, done.stderr
    (run_dir,) = [line.split(": ", 1)[1] for line in done.stdout.splitlines() if line.startswith("run directory: ")]
    return folder / run_dir


def options_of(run_dir: Path) -> dict:
    """A config.json's record less what differs between two runs of the same settings on the same cache."""
    config = json.loads((run_dir / "config.json").read_text())
    return {key: value for key, value in config.items() if key not in ("memory_budget",)}


@pytest.fixture(scope="module")
def linear_world(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reruns")
    first = write_synthetic_cache(folder / "first.h5", seed=0)
    other = write_synthetic_cache(folder / "other.h5", seed=1)
    original = made_run(run_cli("linear", "--cache", str(first), *GRID, "--hp", "role.k=2", cwd=folder), folder)
    return folder, first, other, original


def test_a_linear_run_rerun_from_its_record_is_the_same_bit_for_bit(linear_world):
    folder, _, _, original = linear_world
    done = run_cli("linear", "--config", str(original / "config.json"), cwd=folder)
    rerun = made_run(done, folder)
    assert rerun != original
    assert f"--config {original / 'config.json'}: a new run with that run's settings exactly" in done.stderr
    assert_same_run(rerun, original)
    assert options_of(rerun) == options_of(original)  # --hp role.k=2 kept too


def test_another_cache_is_the_records_settings_with_that_change_said_once(linear_world):
    folder, first, other, original = linear_world
    done = run_cli("linear", "--config", str(original), "--cache", str(other), cwd=folder)
    rerun = made_run(done, folder)
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("--config")]
    assert line == (f"--config {original / 'config.json'} with --cache {other}: that run's settings but --cache"
                    f" {other} in place of {first}")
    # the same as the record's flags typed by hand with that one flag changed (role's k kept: the record's value)
    by_hand = made_run(run_cli("linear", "--cache", str(other), *GRID, "--hp", "role.k=2", cwd=folder), folder)
    assert_same_run(rerun, by_hand)
    assert options_of(rerun) == options_of(by_hand)


def test_an_option_given_changes_that_one_and_the_records_hp_stay_per_loss(linear_world, tmp_path):
    _, _, _, original = linear_world
    run = run_linear(config=original, epochs=2, hparams={"role.lr_mult": 5}, out=tmp_path, console=quiet())
    record = json.loads((run.run_dir / "config.json").read_text())
    assert record["epochs"] == 2 and record["losses"] == ["an", "role"]
    assert record["hparams"]["role"] == {"k": 2, "lr_mult": 5} and record["lrs"] == [1e-2, 1e-3]


def test_config_beside_resume_or_on_another_stages_record_is_one_line(linear_world, monkeypatch, capsys):
    folder, _, _, original = linear_world
    line = one_error_line(["linear", "--config", str(original), "--resume", str(original)], subprocess_too=True,
                          cwd=folder, monkeypatch=monkeypatch, capsys=capsys)
    assert line == (f"error: --config {original} with --resume {original}: --resume goes on with an interrupted"
                    " run's own settings, --config starts a new run from a record's; give one of them")
    line = one_error_line(["finetune", "--config", str(original)], subprocess_too=False, cwd=folder,
                          monkeypatch=monkeypatch, capsys=capsys)
    assert line == (f"error: --config {original}: the record of a linear run; rerun it with spml-cache linear"
                    f" --config {original}")
    line = one_error_line(["linear", "--config", str(folder / "nowhere" / "config.json")], subprocess_too=False,
                          cwd=folder, monkeypatch=monkeypatch, capsys=capsys)
    assert line == f"error: {folder / 'nowhere' / 'config.json'} does not exist"


def test_a_finetuning_rerun_from_its_record_is_the_same_bit_for_bit(tmp_path):
    root = make_demo_data(tmp_path / "data", num_train=12, num_test=6, size=32, seed=0)
    small = ["--device", "cpu", "--workers", "0"]
    assert run_cli("extract", "voc", "--root", str(root), "--backbone", "resnet18", "--weights", "none",
                   "--resolution", "32", "--out", "voc.h5", *small, cwd=tmp_path).returncode == 0
    assert run_cli("linear", "--cache", "voc.h5", "--loss", "role", "--lr", "1e-2", "--batch-size", "4",
                   "--epochs", "2", "--device", "cpu", cwd=tmp_path).returncode == 0
    tune = ["--lr", "1e-4", "--batch-size", "4", "--epochs", "1", *small]
    first = run_cli("finetune", "--dataset", "voc", "--loss", "role", "--root", str(root), *tune, cwd=tmp_path,
                    env={"SPML_CACHE": str(tmp_path)})
    assert first.returncode == 0, first.stderr
    (original,) = (tmp_path / "runs" / "voc").glob("finetune-*")
    # the images' root is the record's: no --root, no SPML_DATA
    done = run_cli("finetune", "--config", str(original / "config.json"), *small, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"--config {original / 'config.json'}: a new run with that run's settings exactly" in done.stdout
    (rerun,) = set((tmp_path / "runs" / "voc").glob("finetune-*")) - {original}
    assert_same_run(rerun, original, cwd=tmp_path)
