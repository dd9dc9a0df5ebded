"""`spml-cache demo`: the whole pipeline from a subprocess, at a tiny size (hidden size flags)."""

import json
from pathlib import Path

import pytest
from cli_support import run_cli

from spml_cache import losses
from spml_cache.demo.run import run_demo
from spml_cache.runtime.errors import SpmlError


def test_demo_end_to_end(tmp_path):
    tiny = ["--train", "16", "--test", "8", "--size", "32", "--resolution", "32", "--epochs", "2", "--lr", "1e-2",
            "--batch-size", "8"]
    done = run_cli("demo", "--out", "out", *tiny, cwd=tmp_path, env={"TORCH_HOME": str(tmp_path / "torch-home")})
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    assert "no ImageNet ResNet-50 weights" in done.stdout  # TORCH_HOME is empty: random trunk, said out loud
    assert (out / "data" / "VOCdevkit" / "VOC2012" / "JPEGImages").is_dir()
    assert (out / "cache" / "voc-resnet50-32.h5").is_file()
    (run_dir,) = (out / "runs" / "voc").glob("linear-*")
    results = json.loads((run_dir / "results.json").read_text())
    assert list(results["losses"]) == losses.names(similarity=False)
    assert json.loads((run_dir / "config.json").read_text())["cache_attrs"]["weights"] == "none"
    # stage three too, from the best single-positive head (never an oracle's)
    (tuned,) = (out / "runs" / "voc").glob("finetune-*")
    tuned_results = json.loads((tuned / "results.json").read_text())
    (loss,) = tuned_results["losses"]
    fair = {name: entry["val_map"] for name, entry in results["losses"].items() if not losses.get(name).oracle}
    assert loss == max(fair, key=fair.get) and tuned_results["init"]["run"] == str(run_dir.relative_to(tmp_path))
    assert sorted(p.suffix for p in (out / "plots").iterdir()) and all(p.suffix == ".png" for p in (out / "plots").iterdir())
    assert "test mAP" in done.stdout and str(Path("out") / "plots") in done.stdout
    # each loss's result once in the final table (not also in a summary table), and warnings as one line each
    assert done.stdout.count("linear heads: best config per loss") == 0
    assert "RandomWeightsWarning" not in done.stderr and "build_trunk" not in done.stderr


def test_demo_never_replaces_a_real_dataset(tmp_path):
    index = tmp_path / "data" / "VOCdevkit" / "VOC2012" / "ImageSets" / "Main" / "train.txt"
    index.parent.mkdir(parents=True)
    index.write_text("2008_000008\n")
    with pytest.raises(SpmlError, match="not demo data"):
        run_demo(tmp_path)
    assert index.read_text() == "2008_000008\n"


def test_demo_refuses_bad_flags_before_any_work(tmp_path):
    with pytest.raises(SpmlError, match="--lr is empty"):
        run_demo(tmp_path / "out", lrs=[])
    assert not (tmp_path / "out").exists()
