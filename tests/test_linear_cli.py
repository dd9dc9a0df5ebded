"""`spml-cache linear` as a user types it, and every kind of bad input it must refuse before writing anything."""

import json
import shutil
from pathlib import Path

import h5py
import pytest
import torch

from cli_support import run_cli, run_main
from linear_support import write_synthetic_cache
from spml_cache import cache, cli, losses
from spml_cache.linear import run_linear
from spml_cache.runtime.errors import SpmlError


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    return write_synthetic_cache(tmp_path_factory.mktemp("cache") / "voc-resnet50-448.h5", train=40, val=16, test=20,
                                 classes=4, dim=8)


def test_loss_all_runs_every_registered_loss(tmp_path, tiny_cache):
    done = run_cli("linear", "--cache", str(tiny_cache), "--loss", "all", "--lr", "1e-2,1e-3", "--batch-size", "4,8",
                   "--epochs", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    assert run_dir.name.startswith("linear-resnet50-all-")  # the cache's backbone, then the losses
    results = json.loads((run_dir / "results.json").read_text())
    trainable = losses.names(similarity=False)  # the tiny cache has no text side: vlpl and gpr are left out
    assert results["complete"] is True and list(results["losses"]) == trainable
    assert "vlpl, gpr left out" in done.stderr and "reference" not in results  # the note, on the progress console
    assert all(result["selected"] is not None for result in results["losses"].values())
    checkpoint = torch.load(run_dir / "best.pt", weights_only=True)
    assert set(checkpoint) == set(trainable)
    assert all(entry["head"]["weight"].shape == (4, 8) for entry in checkpoint.values())
    assert checkpoint["role"]["loss_state"]["theta"].shape == (1, 40, 4)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(trainable) * 4 * 2  # losses x (2 lrs x 2 batch sizes) x epochs
    assert sorted(p.stem for p in (run_dir / "scores").iterdir()) == sorted(trainable)
    assert "test mAP" in done.stdout and "role" in done.stdout


def test_a_bracketed_out_folder_is_a_path_not_rich_markup(tmp_path, tiny_cache):
    done = run_cli("linear", "--cache", str(tiny_cache), "--loss", "an", "--lr", "1e-2", "--batch-size", "8",
                   "--epochs", "1", "--out", "x[/]y", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "x[" / "]y" / "voc").iterdir()
    assert json.loads((run_dir / "results.json").read_text())["complete"] is True
    assert f"run directory: x[/]y/voc/{run_dir.name}" in done.stdout


def test_dataset_finds_its_cache_in_spml_cache(tmp_path, tiny_cache):
    folder = tmp_path / "features"
    folder.mkdir()
    (folder / tiny_cache.name).write_bytes(tiny_cache.read_bytes())
    done = run_cli("linear", "--dataset", "voc", "--loss", "an", "--lr", "1e-2", "--batch-size", "8", "--epochs", "1",
                   "--out", "out", "--no-graphs", cwd=tmp_path, env={"SPML_CACHE": str(folder)})  # a no-op on the CPU
    assert done.returncode == 0, done.stderr
    assert json.loads(next((tmp_path / "out" / "voc").iterdir()).joinpath("config.json").read_text())["cache"] == str(
        folder / tiny_cache.name)


def test_usage_errors_exit_2(tmp_path, tiny_cache):
    assert run_cli("linear", "--cache", str(tiny_cache), cwd=tmp_path).returncode == 2  # --loss is required
    help_text = run_cli("linear", "--help", cwd=tmp_path).stdout
    assert "Example:" in help_text and "--no-graphs" in help_text
    assert "Example:" in run_cli("demo", "--help", cwd=tmp_path).stdout


def incomplete_copy(source: Path, target: Path) -> Path:
    target.write_bytes(source.read_bytes())
    with h5py.File(target, "r+") as file:
        file.attrs["complete"] = False
    return target


BAD_INPUTS = [
    ({"cache": "missing.h5"}, "missing.h5"),
    ({"dataset": "voc", "cache_dir": "empty"}, "spml-cache extract voc"),
    ({"losses": ["an", "nope"]}, "unknown loss 'nope'"),
    ({"hparams": {"alpha": 0.3}}, "has no hyperparameter alpha"),
    ({"losses": ["an", "em"], "hparams": {"gamma": 0.3}}, "none of the selected losses has a hyperparameter 'gamma'"),
    ({"losses": ["an", "em"], "hparams": {"wan.gamma": 0.3}}, "loss 'wan' is not among --loss"),
    ({"hparams": {"an.gamma": float("nan")}}, "must be a finite number"),
    ({"dataset": "voc", "cache_dir": "empty", "cache": "x.h5"}, "not both"),
    ({"lrs": []}, "--lr is empty"),
    ({"batch_sizes": [8, 0]}, "must be positive"),
    ({"epochs": 0}, "--epochs 0"),
    ({"val_labels": "noisy"}, "--val-labels"),
    ({"device": "tpu"}, "--device"),
]

CLI_PARSING = [
    (lambda: cli.parse_hparams(["alpha"]), "expected key=value"),
    (lambda: cli.parse_hparams(["an.gamma=fast"]), "'fast' is not a number"),
    (lambda: cli.parse_list("1e-3,fast", "--lr", float), "comma list of numbers"),
    (lambda: cli.parse_list("8,sixteen", "--batch-size", int), "comma list of whole numbers"),
]


@pytest.mark.parametrize("parse, message", CLI_PARSING, ids=[m for _, m in CLI_PARSING])
def test_the_command_line_refuses_what_it_cannot_parse(parse, message):
    with pytest.raises(SpmlError, match=message):
        parse()


def test_the_command_line_parses_lists_and_hyperparameters():
    assert cli.parse_list(" 1e-2, 1e-3,", "--lr", float) == [1e-2, 1e-3]
    assert cli.parse_names("an, role") == ["an", "role"]
    assert cli.parse_hparams(["alpha=0.3", "role.k=2", "an.gamma=-1"]) == {"alpha": 0.3, "role.k": 2, "an.gamma": -1}


@pytest.mark.parametrize("arguments, message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_is_refused_before_anything_is_written(tmp_path, tiny_cache, arguments, message):
    with_cache = "cache" in arguments
    arguments = {"cache": tiny_cache, "losses": "an", "epochs": 1, **arguments}
    if "dataset" in arguments:
        if not with_cache:
            del arguments["cache"]
        (tmp_path / arguments["cache_dir"]).mkdir()
    arguments = {k: tmp_path / v if k in ("cache_dir",) or v == "missing.h5" else v for k, v in arguments.items()}
    with pytest.raises(SpmlError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_linear(out=tmp_path / "runs", **arguments)
    assert not (tmp_path / "runs").exists()


def test_caches_that_cannot_be_used(tmp_path, tiny_cache):
    broken = incomplete_copy(tiny_cache, tmp_path / "voc-resnet50-448.h5")
    with pytest.raises(SpmlError, match="incomplete"):
        run_linear(cache=broken, losses="an", out=tmp_path / "runs")
    broken.rename(tmp_path / "voc-resnet50-448.h5.partial")
    with pytest.raises(SpmlError, match="unfinished extraction.*spml-cache extract voc"):
        run_linear(dataset="voc", cache_dir=tmp_path, losses="an", out=tmp_path / "runs")
    for resolution in (224, 448):
        (tmp_path / f"voc-resnet50-{resolution}.h5").write_bytes(tiny_cache.read_bytes())
    with pytest.raises(SpmlError, match="several caches for 'voc'.*--cache"):
        run_linear(dataset="voc", cache_dir=tmp_path, losses="an", out=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_dataset_sees_every_cache_of_it_whatever_its_name(tmp_path, tiny_cache, monkeypatch, capsys):
    """`import-features ... --out cache/voc-imported.h5` (its help's example) or a cache renamed beside the one
    extract wrote: `--dataset voc` refuses to choose, naming both; a cache of another dataset, or a file that is no
    HDF5, is no cache of voc."""
    folder = tmp_path / "cache"
    folder.mkdir()
    shutil.copy(tiny_cache, folder / "voc-resnet50-448.h5")
    write_synthetic_cache(folder / "theirs.h5", train=8, val=4, test=4, classes=3, dim=4, dataset="coco")
    (folder / "notes.h5").write_text("not HDF5")
    assert cache.find_cache(None, "voc", folder) == folder / "voc-resnet50-448.h5"
    for other, listed in (("voc-imported.h5", "voc-imported.h5, voc-resnet50-448.h5"),  # seen by its name,
                          ("mine.h5", "mine.h5, voc-imported.h5, voc-resnet50-448.h5")):  # by its attrs
        shutil.copy(tiny_cache, folder / other)
        code, err = run_main("linear", "--dataset", "voc", "--loss", "an", cwd=tmp_path, monkeypatch=monkeypatch,
                             capsys=capsys)
        assert (code, err.strip()) == (1, f"error: several caches for 'voc' in cache/ ({listed}): pick one with"
                                          " --cache PATH")
    assert not (tmp_path / "runs").exists()


def test_a_user_error_is_one_red_line(tmp_path, tiny_cache):
    done = run_cli("linear", "--cache", str(tiny_cache), "--loss", "an", "--lr", "", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == ["error: --lr is empty: give at least one value, e.g. --lr 1e-3"]
    assert not (tmp_path / "runs").exists()


def test_a_cache_with_non_finite_features_is_one_red_line_naming_the_rows(tmp_path, tiny_cache):
    bad = tmp_path / "voc-resnet50-448.h5"
    bad.write_bytes(tiny_cache.read_bytes())
    with h5py.File(bad, "r+") as file:
        features = file["val"]["features"][...]
        features[[2, 5, 6, 9], 1] = float("nan")
        file["val"]["features"][...] = features
    done = run_cli("linear", "--cache", str(bad), "--loss", "an", cwd=tmp_path)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: {bad}: /val/features is not finite (NaN or inf) in 4 rows")
    assert "(ids val/00002.jpg, val/00005.jpg, val/00006.jpg, ...)" in line and "--precision fp32" in line
    assert not (tmp_path / "runs").exists()
