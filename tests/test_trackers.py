"""`linear --log tensorboard,mlflow,wandb`: each tracker, read back with its own reader, holds what the run directory
holds (every head's train loss and val mAP per epoch, each once; each result's test mAP and F1 family; the options;
the run's files), across a Ctrl-C and `--resume`; a tracker that fails is one line and the run is whole.

MLflow runs against a real `mlflow server` (sqlite backend, served artifacts) that the module starts on 127.0.0.1,
and a file store; W&B in offline mode. Tiny caches, a few epochs."""

from __future__ import annotations

import io
import json
import os
import signal
from pathlib import Path

import pytest
from cli_support import ended, one_error_line, run_cli, start_cli
from linear_support import interrupted_run, quiet, write_synthetic_cache
from rich.console import Console
from tracker_support import (
    assert_f1_family_is_sklearns, assert_mlflow_holds, assert_tensorboard_holds, assert_wandb_holds, result_values,
    SharedServer, free_port, stop_mlflow_server, wandb_folders,
)

from spml_cache import runs
from spml_cache.linear import run_linear

pytest.importorskip("mlflow")
pytest.importorskip("wandb")
pytest.importorskip("tensorboard")

GRID = ["--loss", "an,role", "--seeds", "2", "--lr", "1e-2", "--batch-size", "4,8", "--epochs", "3"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The module's one mlflow server (`alive()`: started again after the test that kills it)."""
    shared = SharedServer(tmp_path_factory.mktemp("mlflow"))
    yield shared
    shared.close()


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    return write_synthetic_cache(tmp_path_factory.mktemp("cache") / "voc-resnet50-448.h5", train=40, val=16, test=20)


def environment(tmp_path: Path, **more) -> dict:
    """The command's environment: none of the user's MLflow or W&B settings, W&B offline in the test's folder."""
    theirs = {key: None for key in os.environ if key.startswith(("MLFLOW_", "WANDB_"))}
    return {**theirs, **wandb_folders(tmp_path), **more}


def ledger(tmp_path: Path) -> dict:
    """The run's trackers.json so far ({} before it is written)."""
    found = next(tmp_path.glob("runs/voc/*/trackers.json"), None)
    return json.loads(found.read_text()) if found is not None and found.stat().st_size else {}


def test_ctrl_c_then_resume_leaves_one_whole_run_in_each_tracker(tmp_path, servers):
    """SIGINT to the process group once a part is kept and a part not kept has logged epochs (which the resume
    trains again); `--resume RUN` without --log goes on in the run's own tracker runs: one MLflow run (a child per
    head), one TensorBoard folder, one W&B run id, each epoch once, every value the run directory's."""
    cache_path = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5", train=1500, val=20, test=20)
    server = servers.alive()
    env = environment(tmp_path, MLFLOW_TRACKING_URI=server.uri, MLFLOW_EXPERIMENT_NAME="resumed")
    # 12 epochs a head, not GRID's 3: seconds of parts left to train when the stop comes (a stop after results.json
    # is written ends a finished run, exit 0)
    args = ["--cache", str(cache_path), *GRID, "--epochs", "12", "--workers", "0", "--log", "tensorboard,mlflow,wandb"]

    def part_half_trained():  # a part kept, and epochs written of a part not kept (which the resume trains again)
        (run_dir,) = list(tmp_path.glob("runs/voc/*/")) or [None]
        if run_dir is None or not (run_dir / "metrics.jsonl").exists() or not list(run_dir.glob("jobs/*.pt")):
            return False
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()[:-1]]  # whole
        return any(not (run_dir / "jobs" / f"{line['loss']}-seed{line['seed']}-batch{line['batch_size']}.pt").exists()
                   for line in lines)

    process = start_cli("linear", *args, cwd=tmp_path, env=env, ready=part_half_trained)
    os.killpg(process.pid, signal.SIGINT)
    stderr = ended(process, tmp_path)
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "--log" not in stderr, stderr  # no tracker failed
    assert not (run_dir / "results.json").exists()
    done = run_cli("linear", "--resume", f"runs/voc/{run_dir.name}", cwd=tmp_path, env=environment(tmp_path))
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith(("tensorboard:", "mlflow:", "wandb:"))]
    assert [line.split(":")[0] for line in sorted(said)] == ["mlflow", "tensorboard", "wandb"], done.stderr
    config = runs.read_json(run_dir / "config.json")
    assert len(list((run_dir / "tensorboard").glob("events.*"))) == 2  # the resumed run's file beside the first
    assert_tensorboard_holds(run_dir, config)
    assert_mlflow_holds(run_dir, server.uri, "resumed", config)
    assert_wandb_holds(run_dir, config, folders=2)
    assert_f1_family_is_sklearns(run_dir, result_values(run_dir))


def test_a_server_killed_mid_run_is_one_line_and_the_run_is_whole(tmp_path, tiny_cache, servers):
    """The server is killed (SIGKILL) once the tracker has begun its run: the command goes on, exits 0 with one
    line naming the server, and results.json is complete; the other tracker logs the whole run."""
    server = servers.alive()
    args = ["--cache", str(tiny_cache), "--loss", "an,role", "--lr", "1e-2,1e-3", "--batch-size", "4,8", "--epochs",
            "30", "--log", "mlflow,tensorboard"]
    env = environment(tmp_path, MLFLOW_TRACKING_URI=server.uri, MLFLOW_EXPERIMENT_NAME="killed")
    try:  # ready: the parent run is on the server, the tracker has begun
        process = start_cli("linear", *args, cwd=tmp_path, env=env,
                            ready=lambda: "run_id" in ledger(tmp_path).get("mlflow", {}))
        stop_mlflow_server(server)
        stderr = ended(process, tmp_path, timeout=300)
    finally:
        stop_mlflow_server(server)  # whatever happened: the next test that needs one starts another
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    assert process.returncode == 0, stderr
    failed = [line for line in stderr.splitlines() if line.startswith("--log")]
    assert failed == [f"--log mlflow: {server.uri} does not answer (is the server up? MLFLOW_TRACKING_URI says where"
                      f" it is): the run goes on without mlflow; its own files in runs/voc/{run_dir.name} are whole"]
    assert "Traceback" not in stderr and "Retrying" not in stderr, stderr
    assert set(runs.load_results(run_dir)["losses"]) == {"an", "role"} and runs.load_results(run_dir)["complete"]
    assert_tensorboard_holds(run_dir, runs.read_json(run_dir / "config.json"))


def test_a_tracking_uri_nothing_answers_at_is_one_line_before_the_training(tmp_path, tiny_cache, monkeypatch):
    uri = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    said = io.StringIO()
    run = run_linear(cache=tiny_cache, out=tmp_path, losses=["an"], lrs=[1e-2], batch_sizes=[4], epochs=2,
                     device="cpu", trackers="mlflow", console=Console(file=said, width=400))
    lines = said.getvalue().splitlines()
    assert [line for line in lines if "mlflow" in line] == [
        f"--log mlflow: {uri} does not answer (is the server up? MLFLOW_TRACKING_URI says where it is): the run goes"
        f" on without mlflow; its own files in {run.run_dir} are whole"]
    assert lines.index([line for line in lines if "mlflow" in line][0]) < lines.index(
        next(line for line in lines if line.startswith("an: done")))
    assert runs.load_results(run.run_dir)["complete"]


def test_wandb_online_without_a_login_is_one_line_and_never_a_prompt(tmp_path, tiny_cache, monkeypatch):
    for key, value in {**wandb_folders(tmp_path), "WANDB_MODE": "online", "HOME": str(tmp_path),
                       "NETRC": str(tmp_path / "no-netrc")}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    said = io.StringIO()
    run = run_linear(cache=tiny_cache, out=tmp_path, losses=["an"], lrs=[1e-2], batch_sizes=[4], epochs=2,
                     device="cpu", trackers="wandb", console=Console(file=said, width=400))
    assert [line for line in said.getvalue().splitlines() if "wandb" in line.lower()] == [
        "--log wandb: no W&B login: run `wandb login` (or set WANDB_API_KEY), or log offline with WANDB_MODE=offline:"
        f" the run goes on without wandb; its own files in {run.run_dir} are whole"]
    assert runs.load_results(run.run_dir)["complete"]


def test_mlflow_3_refuses_a_file_store_unless_allowed_in_one_line_with_the_fix(tmp_path, tiny_cache, monkeypatch):
    """MLflow 3's file store (`file:` URIs, ./mlruns) is refused by MLflow unless MLFLOW_ALLOW_FILE_STORE=true:
    said in one line, the run whole; allowed, the store holds the run (read back with MlflowClient)."""
    import mlflow

    store = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    said = io.StringIO()
    refused = run_linear(cache=tiny_cache, out=tmp_path / "refused", losses=["an"], lrs=[1e-2], batch_sizes=[4],
                         epochs=2, device="cpu", trackers="mlflow", console=Console(file=said, width=400))
    lines = [line for line in said.getvalue().splitlines() if line.startswith("--log mlflow:")]
    assert lines == [f"--log mlflow: MLflow {mlflow.__version__} refuses the file store {store} unless"
                     " MLFLOW_ALLOW_FILE_STORE=true is set; or track to a database, e.g."
                     " MLFLOW_TRACKING_URI=sqlite:///mlflow.db: the run goes on without mlflow; its own files in"
                     f" {refused.run_dir} are whole"]
    assert runs.load_results(refused.run_dir)["complete"]

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "file-store")
    allowed = run_linear(cache=tiny_cache, out=tmp_path / "allowed", losses=["an"], lrs=[1e-2, 1e-3],
                         batch_sizes=[4], epochs=2, device="cpu", trackers="mlflow",
                         console=Console(file=io.StringIO()))
    assert_mlflow_holds(allowed.run_dir, store, "file-store", runs.read_json(allowed.run_dir / "config.json"))


def test_mlflow_finds_its_runs_on_the_server_when_trackers_json_lost_their_ids(tmp_path, tiny_cache, monkeypatch):
    """A stop between MLflow making a run and trackers.json keeping its id (here: the ids removed from the ledger
    of a stopped run): the resume finds the parent by its run directory and each child by its head, on the
    server, and makes neither again."""
    store = (tmp_path / "mlruns").as_uri()
    for key, value in {"MLFLOW_TRACKING_URI": store, "MLFLOW_ALLOW_FILE_STORE": "true",
                       "MLFLOW_EXPERIMENT_NAME": "found"}.items():
        monkeypatch.setenv(key, value)
    grid = dict(losses=["an", "role"], lrs=[1e-2], batch_sizes=[4, 8], epochs=2, seeds=1, device="cpu")
    run_dir = interrupted_run(tmp_path / "runs", tiny_cache, monkeypatch, 2, trackers="mlflow", **grid)
    ledger_path = run_dir / "trackers.json"
    kept = json.loads(ledger_path.read_text())
    assert kept["mlflow"]["run_id"] and kept["mlflow"]["children"]
    lost = {**kept, "mlflow": {"logged": kept["mlflow"]["logged"]}}  # how far it logged, not where
    ledger_path.write_text(json.dumps(lost))
    run_linear(resume=run_dir, console=quiet())
    assert json.loads(ledger_path.read_text())["mlflow"]["run_id"] == kept["mlflow"]["run_id"]
    assert_mlflow_holds(run_dir, store, "found", runs.read_json(run_dir / "config.json"))


def test_results_the_trackers_cannot_read_are_one_line_and_the_run_is_done(tmp_path, tiny_cache, monkeypatch):
    """Once results.json is written the command cannot fail: a damaged scores file, say, that the trackers' F1
    family reads, is one line, and the run returns whole."""
    from spml_cache.runtime.errors import SpmlError
    from spml_cache.trackers import session

    def damaged(run_dir):
        raise SpmlError(f"{run_dir}/scores/an.npz is not the .npz file of a run")

    monkeypatch.setattr(session, "read_outcome", damaged)
    said = io.StringIO()
    run = run_linear(cache=tiny_cache, out=tmp_path, losses=["an"], lrs=[1e-2], batch_sizes=[4], epochs=2,
                     device="cpu", trackers="tensorboard", console=Console(file=said, width=400))
    assert runs.load_results(run.run_dir)["complete"]
    assert [line for line in said.getvalue().splitlines() if line.startswith(("--log", "tensorboard"))] == [
        f"--log: the trackers got no results ({run.run_dir}/scores/an.npz is not the .npz file of a run); the run's"
        f" own files in {run.run_dir} are whole"]


def test_log_refuses_an_unknown_tracker_and_a_missing_package_in_one_line(tmp_path, monkeypatch, capsys):
    line = one_error_line(["linear", "--dataset", "voc", "--loss", "an", "--log", "tensorboard,mlfow"],
                          subprocess_too=True, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert line == ("error: --log tensorboard,mlfow: unknown tracker 'mlfow' (did you mean mlflow?); choose one of"
                    " tensorboard, mlflow, wandb, or none")
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "wandb" else
                        find_spec(name, *rest))
    line = one_error_line(["finetune", "--dataset", "voc", "--loss", "an", "--log", "wandb"], subprocess_too=False,
                          cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert line == 'error: --log wandb: needs the wandb package: pip install "spml-cache[wandb]"'
