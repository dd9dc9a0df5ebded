"""`spml-cache run EXPERIMENT.toml` from a subprocess, as a user types it: each step equals its command typed by
hand, bit for bit; a run again trains nothing; Ctrl-C stops it in one line and a run again goes on with the same
run; `--log` (on `run`, or the file's `log` key) reaches the linear and finetune steps' trackers."""

from __future__ import annotations

import json
import os
import shlex
import signal
from pathlib import Path

import pytest
from cli_support import ended, run_cli, start_cli
from linear_support import write_synthetic_cache
from run_support import assert_same_run

from spml_cache import runs

LINEAR = """
[experiment]
name = "grid"

[axes]
batch_size = [4, 8]

[linear]
cache = "{cache}"
loss = ["an", "role"]
lr = [1e-2, 1e-3]
epochs = 3
seeds = 2
hp = {{ "role.k" = 2 }}
device = "cpu"

[report]
"""


def plan_lines(folder: Path, file: str, *more: str) -> list[str]:
    done = run_cli("run", file, "--dry-run", *more, cwd=folder)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def made(folder: Path, name: str) -> dict[str, Path]:
    """The experiment's state: each step's key and the run it made."""
    state = json.loads((folder / "runs" / "experiments" / f"{name}.json").read_text())
    return {key: folder / path for key, path in state["made"].items()}


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    folder = tmp_path_factory.mktemp("experiment")
    cache = write_synthetic_cache(folder / "voc-resnet50-448.h5")
    (folder / "grid.toml").write_text(LINEAR.format(cache=cache.name))
    done = run_cli("run", "grid.toml", cwd=folder)
    assert done.returncode == 0, done.stderr
    return folder, done


def test_each_step_is_its_command_typed_by_hand_bit_for_bit(grid):
    folder, done = grid
    assert done.stdout.splitlines()[-1] == "grid.toml: 3 steps done; its state: runs/experiments/grid.json"
    steps = made(folder, "grid")
    assert len(steps) == 2 and len(set(steps.values())) == 2  # one linear run per batch size
    lines = plan_lines(folder, "grid.toml")
    linear = [line.split("  # ")[0] for line in lines if line.startswith("spml-cache linear ")]
    assert linear == [f"spml-cache linear --loss an,role --cache voc-resnet50-448.h5 --lr 0.01,0.001 --batch-size {b}"
                      " --epochs 3 --seeds 2 --hp role.k=2 --device cpu" for b in (4, 8)]
    for command in linear:
        words = shlex.split(command)[1:]
        by_hand = run_cli(*words, "--out", "by-hand", cwd=folder)
        assert by_hand.returncode == 0, by_hand.stderr
        (run_dir,) = [line.split(": ", 1)[1] for line in by_hand.stdout.splitlines()
                      if line.startswith("run directory: ")]
        (key,) = [key for key in steps if key == shlex.join(["spml-cache", *words[:-2]])]  # less --device cpu
        assert_same_run(steps[key], folder / run_dir)
    # the report covers exactly the experiment's runs
    (report,) = [line.split("  # ")[0] for line in lines if line.startswith("spml-cache report ")]
    assert shlex.split(report)[2:] == [str(path.relative_to(folder)) for path in steps.values()]


def test_a_run_again_trains_nothing(grid):
    folder, _ = grid
    before = {path: (path / "results.json").stat().st_mtime_ns for path in made(folder, "grid").values()}
    done = run_cli("run", "grid.toml", cwd=folder)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == ("grid.toml: 3 steps done, 2 of them before; its state:"
                                            " runs/experiments/grid.json")
    assert sum(line.startswith("step ") and ": done, runs/" in line for line in done.stdout.splitlines()) == 2
    assert {path: (path / "results.json").stat().st_mtime_ns for path in made(folder, "grid").values()} == before
    assert len(list((folder / "runs" / "voc").iterdir())) == 2
    lines = plan_lines(folder, "grid.toml")
    assert [line.split("  # ")[1].split(",")[0] for line in lines if line.startswith("spml-cache linear")] == [
        "step 1: done", "step 2: done"]


def test_ctrl_c_stops_the_step_in_one_line_and_a_run_again_goes_on_with_its_run(tmp_path):
    cache = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5", train=1500, val=20, test=20)
    (tmp_path / "long.toml").write_text(f'[linear]\ncache = "{cache.name}"\nloss = ["an", "role"]\nseeds = 3\n'
                                        'lr = 1e-2\nbatch_size = [4, 8]\nepochs = 3\nworkers = 2\n')
    process = start_cli("run", "long.toml", cwd=tmp_path,  # ready: the first of 12 parts, each seconds long, kept
                        ready=lambda: list(tmp_path.glob("runs/voc/*/jobs/*.pt")))
    os.killpg(process.pid, signal.SIGINT)
    stderr = ended(process, tmp_path)
    assert process.returncode == 130, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr and lines[-1].startswith("interrupted: step 1 of 1: ")
    assert lines[-1].endswith("; go on with: spml-cache run long.toml")
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    assert not (run_dir / "results.json").exists()
    assert list(made(tmp_path, "long").values()) == [run_dir]  # kept as soon as it existed
    assert f"goes on with runs/voc/{run_dir.name}" in plan_lines(tmp_path, "long.toml")[1]
    done = run_cli("run", "long.toml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"resuming runs/voc/{run_dir.name}" in done.stderr
    assert list((tmp_path / "runs" / "voc").iterdir()) == [run_dir]
    assert set(runs.load_results(run_dir)["losses"]) == {"an", "role"}


def test_log_reaches_the_linear_and_finetune_steps_trackers(tmp_path):
    pytest.importorskip("tensorboard")
    from tracker_support import assert_tensorboard_holds

    cache = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5")
    (tmp_path / "tracked.toml").write_text(f'log = "tensorboard"\n[linear]\ncache = "{cache.name}"\nloss = "an"\n'
                                           'lr = 1e-2\nbatch_size = 8\nepochs = 2\n[finetune]\nloss = "an"\n')
    (linear, finetune) = [line for line in plan_lines(tmp_path, "tracked.toml") if not line.startswith("#")]
    assert " --log tensorboard  # " in linear and " --log tensorboard  # " in finetune
    # --log on `run` in the file's key's place: none, then tensorboard again for the run
    assert all(" --log none  # " in line for line in plan_lines(tmp_path, "tracked.toml", "--log", "none")[1:])
    (tmp_path / "tracked.toml").write_text(f'[linear]\ncache = "{cache.name}"\nloss = "an"\nlr = 1e-2\n'
                                           'batch_size = 8\nepochs = 2\n')
    done = run_cli("run", "tracked.toml", "--log", "tensorboard", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (run_dir,) = made(tmp_path, "tracked").values()
    assert_tensorboard_holds(run_dir, runs.read_json(run_dir / "config.json"))
