"""`spml-cache demo`: the whole pipeline from a subprocess, at a tiny size (hidden size flags)."""

import json
import shlex
from pathlib import Path

import pytest
from cli_support import run_cli

from spml_cache import losses
from spml_cache.demo.run import DemoSizes, run_demo
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
    # stage three says where it started: epoch 0, the linear head before any step
    assert "epoch 0/1 (the starting model, before any step): val mAP" in done.stdout
    go_on_from_the_demo(tmp_path, done.stdout, loss, run_dir.relative_to(tmp_path))


def go_on_from_the_demo(folder: Path, stdout: str, loss: str, linear_run: Path) -> None:
    """The demo's last lines name its folders and commands that work when pasted where it ran: run each."""
    lines = stdout.rstrip().splitlines()
    cache_line = f"cache: {Path('out', 'cache', 'voc-resnet50-32.h5')}; runs: {Path('out', 'runs')}"
    start = lines.index(next(line for line in lines if line.startswith(cache_line)))
    assert "export SPML_CACHE=out/cache" in lines[start + 1]
    commands = [shlex.split(line) for line in lines[start + 2:]]
    assert [command[:2] for command in commands] == [["spml-cache", "linear"], ["spml-cache", "finetune"],
                                                     ["spml-cache", "report"]]
    assert f"--from {linear_run} --loss {loss}" in shlex.join(commands[1])
    before = set((folder / "out" / "runs" / "voc").iterdir())
    for command in commands:
        done = run_cli(*command[1:], cwd=folder, env={"TORCH_HOME": str(folder / "torch-home")})
        assert done.returncode == 0, (command, done.stderr)
    made = sorted(path.name.split("-")[0] for path in set((folder / "out" / "runs" / "voc").iterdir()) - before)
    assert made == ["finetune", "linear"]
    # and the SPML_CACHE form: `--dataset voc` finds the demo's cache
    linear = commands[0][1:]
    at = linear.index("--cache")
    done = run_cli(*linear[:at], *linear[at + 2:], "--dataset", "voc", "--epochs", "1", cwd=folder,
                   env={"SPML_CACHE": str(Path("out", "cache"))})
    assert done.returncode == 0, done.stderr


def test_demo_never_replaces_a_real_dataset(tmp_path):
    index = tmp_path / "data" / "VOCdevkit" / "VOC2012" / "ImageSets" / "Main" / "train.txt"
    index.parent.mkdir(parents=True)
    index.write_text("2008_000008\n")
    with pytest.raises(SpmlError, match="not demo data"):
        run_demo(tmp_path)
    assert index.read_text() == "2008_000008\n"


def test_demo_refuses_bad_flags_before_any_work(tmp_path):
    with pytest.raises(SpmlError, match="--lr is empty"):
        run_demo(tmp_path / "out", DemoSizes(lrs=()))
    assert not (tmp_path / "out").exists()


def test_a_stop_after_the_demos_first_stage_still_stops_it(tmp_path, monkeypatch, capsys):
    """Each stage's door says, once its work is written, that a stop has nothing left to stop (runtime/errors.py,
    `finished`): inside the demo that held for the stages after it too, so a Ctrl-C during them was only recorded
    (and a second one ended the demo as done). The demo says more work follows after each stage."""
    import signal

    from cli_support import run_main

    import spml_cache.demo.run as demo

    def linear_stopped_at_once(**_):
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # Ctrl-C as stage two starts
        raise AssertionError("the stop was only recorded")

    monkeypatch.setattr(demo, "run_linear", linear_stopped_at_once)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    code, err = run_main("demo", "--out", "out", "--train", "16", "--test", "8", "--size", "32", "--resolution", "32",
                         "--epochs", "1", cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 130 and err.strip().splitlines()[-1] == ("interrupted; go on with: spml-cache demo --out out --train 16"
                                                            " --test 8 --size 32 --resolution 32 --epochs 1"), err
