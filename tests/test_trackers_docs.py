"""docs/trackers.md's "Try it" runs as written, in a new folder, and each tracker then holds the run: TensorBoard's
folder, MLflow's default store (./mlflow.db, what `mlflow ui` reads there), W&B's offline run (what `wandb sync`
uploads); `tensorboard --inspect` reads the folder its viewer line names."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from cli_support import REPO
from tracker_support import assert_mlflow_holds, assert_tensorboard_holds, assert_wandb_holds, wandb_folders

from spml_cache import runs

pytest.importorskip("mlflow")
pytest.importorskip("wandb")
pytest.importorskip("tensorboard")

GUIDE = (REPO / "docs" / "trackers.md").read_text()


def try_it_blocks() -> list[str]:
    section = GUIDE.split("\n## Try it\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```\n(.*?)```", section, flags=re.S)


def test_the_guides_try_it_runs_as_written_and_each_tracker_holds_the_run(tmp_path):
    commands, viewers = try_it_blocks()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SPML_", "MLFLOW_", "WANDB_"))}
    env.update(PYTHONPATH=str(REPO), COLUMNS="400", **wandb_folders(tmp_path))
    env.pop("WANDB_MODE")  # the guide's line sets it
    script = commands.replace("spml-cache ", f"{sys.executable} -m spml_cache ")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    said = [line for line in done.stderr.splitlines() if line.startswith(("tensorboard:", "mlflow:", "wandb:"))]
    assert sorted(line.split(":")[0] for line in said) == ["mlflow", "tensorboard", "wandb"], done.stderr
    config = runs.read_json(run_dir / "config.json")
    assert_tensorboard_holds(run_dir, config)
    assert_mlflow_holds(run_dir, f"sqlite:///{tmp_path / 'mlflow.db'}", "spml-cache", config)
    assert_wandb_holds(run_dir, config, folders=1)

    tensorboard, mlflow_ui, wandb_sync = viewers.strip().splitlines()
    assert (mlflow_ui, tensorboard) == ("mlflow ui", "tensorboard --logdir runs")
    inspected = subprocess.run([sys.executable, "-m", "tensorboard.main", *tensorboard.split()[1:], "--inspect"],
                               cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert inspected.returncode == 0 and f"{run_dir.name}/tensorboard" in inspected.stdout + inspected.stderr
    folders = subprocess.run(["bash", "-c", f"ls -d {wandb_sync.split(maxsplit=2)[2]}"], cwd=tmp_path,
                             capture_output=True, text=True)
    assert folders.stdout.split() == [str(path.relative_to(tmp_path))
                                      for path in sorted((run_dir / "wandb").glob("offline-run-*"))]
