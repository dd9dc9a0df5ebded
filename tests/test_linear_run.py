"""`run_linear` end to end on tiny caches: the run directory, best.pt, divergence, selection labels, learning."""

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from cli_support import REPO
from linear_support import quiet, write_synthetic_cache
from sklearn.metrics import average_precision_score

from spml_cache import cache, losses
from spml_cache.linear import run_linear
from spml_cache.runtime.errors import SpmlError


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    return write_synthetic_cache(tmp_path_factory.mktemp("cache") / "voc-resnet50-448.h5", train=48, val=24, test=30)


def sklearn_map(scores, labels):
    """The protocol's mAP: mean over all classes, a class without positives counts 0."""
    aps = [average_precision_score(labels[:, c], scores[:, c]) if labels[:, c].any() else 0.0
           for c in range(labels.shape[1])]
    return 100 * float(np.mean(aps))


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_diverging_head_is_stopped_and_the_others_finish(tmp_path, tiny_cache):
    run = run_linear(cache=tiny_cache, losses="an", lrs=[1e-2, 1e38], batch_sizes=[8], epochs=3, out=tmp_path,
                     console=quiet())
    result = run.results["losses"]["an"]
    configs = {c["lr"]: c for c in result["configs"]}
    assert configs[1e38]["diverged_epoch"] == 1 and configs[1e38]["best_epoch"] is None
    assert configs[1e-2]["diverged_epoch"] is None and configs[1e-2]["best_epoch"] is not None
    assert result["selected"]["lr"] == 1e-2
    lines = read_metrics(run.run_dir)
    exploded = [line for line in lines if line["lr"] == 1e38]
    assert exploded == [{"loss": "an", "lr": 1e38, "batch_size": 8, "seed": 0, "epoch": 1, "train_loss": None,
                         "val_map": None, "test_map": None, "diverged": True}]
    healthy = [line for line in lines if line["lr"] == 1e-2]
    assert [line["epoch"] for line in healthy] == [1, 2, 3]
    assert all(np.isfinite([line["val_map"], line["test_map"], line["train_loss"]]).all() for line in healthy)


@pytest.mark.parametrize("val_labels", ["clean", "observed"])
def test_results_are_the_best_head_at_its_best_epoch(tmp_path, tiny_cache, val_labels):
    run = run_linear(cache=tiny_cache, losses="role", lrs=[1e-2, 1e-3], batch_sizes=[8, 16], epochs=4,
                     val_labels=val_labels, out=tmp_path, console=quiet())
    features = cache.load(tiny_cache)
    result = run.results["losses"]["role"]
    checkpoint = torch.load(run.run_dir / "best.pt", weights_only=True)["role"]
    assert (checkpoint["lr"], checkpoint["batch_size"]) == (result["selected"]["lr"], result["selected"]["batch_size"])
    assert checkpoint["epoch"] == result["best_epoch"][0] and checkpoint["seed"] == 0

    head = torch.nn.Linear(features.train.features.shape[1], len(features.classes))
    head.load_state_dict(checkpoint["head"])
    role = losses.build("role", num_classes=len(features.classes), dataset="voc", num_heads=1,
                        train_observed=features.train.observed, seed=0)
    initial = role.theta.detach().clone()
    role.load_state_dict(checkpoint["loss_state"])
    assert role.theta.shape == (1, len(features.train), len(features.classes))
    assert not torch.allclose(role.theta, initial)  # the trained label matrix, not the init

    with torch.no_grad():
        scores = {split: torch.sigmoid(head(torch.from_numpy(getattr(features, split).features))).numpy()
                  for split in ("train", "val", "test")}
    val_targets = features.val.labels if val_labels == "clean" else (features.val.observed == 1)
    assert result["val_map"] == pytest.approx(sklearn_map(scores["val"], val_targets), abs=1e-3)
    assert result["test_map"] == pytest.approx(sklearn_map(scores["test"], features.test.labels), abs=1e-3)
    assert result["train_map"] == pytest.approx(sklearn_map(scores["train"], features.train.labels), abs=1e-3)

    saved = np.load(run.run_dir / "scores" / "role.npz")
    for split in ("train", "val", "test"):
        assert saved[split].dtype == np.float16
        np.testing.assert_allclose(saved[split], scores[split], atol=1e-3)
    labels = np.load(run.run_dir / "labels.npz")
    np.testing.assert_array_equal(labels["train_observed"], features.train.observed)
    np.testing.assert_array_equal(labels["test_labels"], features.test.labels)
    config = json.loads((run.run_dir / "config.json").read_text())
    assert config["val_labels"] == val_labels and config["hparams"]["role"]["k"] == 1.5
    assert config["cache_id"] == run.results["cache_id"] == cache.cache_id(features.attrs)
    assert {"torch", "python", "device"} <= set(json.loads((run.run_dir / "env.json").read_text()))
    assert run.run_dir.parent == tmp_path / "voc" and run.run_dir.name.startswith("linear-resnet50-role-")


def test_single_positive_losses_learn_a_learnable_problem(tmp_path):
    path = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5", train=200, val=60, test=80, classes=10, dim=32)
    run = run_linear(cache=path, losses=["bce", "an", "role", "em"], lrs=[1e-2], batch_sizes=[8], epochs=6,
                     out=tmp_path / "runs", console=quiet())
    chance = 100 * cache.load(path).test.labels.mean()  # ~20: the mAP of random scores
    for name, result in run.results["losses"].items():
        assert result["test_map"] > chance + 35, (name, result["test_map"], chance)


def test_a_dataset_without_published_k_takes_the_caches(tmp_path):
    path = write_synthetic_cache(tmp_path / "mine-resnet50-448.h5", dataset="mine")
    run = run_linear(cache=path, losses="epr", lrs=[1e-2], batch_sizes=[8], epochs=1, out=tmp_path, console=quiet())
    assert run.results["losses"]["epr"]["selected"]["hparams"]["k"] == pytest.approx(
        cache.load(path).attrs["expected_positives"])


def test_worker_processes_give_the_same_run(tmp_path, tiny_cache):
    grid = dict(cache=tiny_cache, losses=["an", "role"], lrs=[1e-2, 1e-3], batch_sizes=[8, 16], epochs=2, seeds=2,
                console=quiet())
    alone = run_linear(out=tmp_path / "one", workers=1, **grid)
    parallel = run_linear(out=tmp_path / "two", workers=2, **grid)
    assert json.loads((parallel.run_dir / "config.json").read_text())["workers"] == 2
    for name in ("an", "role"):
        mine, theirs = dict(alone.results["losses"][name]), dict(parallel.results["losses"][name])
        mine.pop("seconds"), theirs.pop("seconds")
        assert mine == theirs
    first, second = (torch.load(run.run_dir / "best.pt", weights_only=True) for run in (alone, parallel))
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert sorted(read_metrics(alone.run_dir), key=json.dumps) == sorted(read_metrics(parallel.run_dir), key=json.dumps)


def test_a_head_with_non_finite_scores_is_stopped_as_diverged(tmp_path, tiny_cache, monkeypatch):
    """Whatever makes a score NaN (a GPU kernel, an overflow), it is named as divergence, never reported."""
    from spml_cache.linear import engine

    real = engine.average_precision
    calls = []

    def nan_for_the_first_head_from_the_second_epoch(scores, labels, mask=None):
        calls.append(1)
        ap = real(scores, labels, mask)
        if len(calls) > 2:  # val and test of epoch 1 are scored untouched
            ap[0] = float("nan")
        return ap

    monkeypatch.setattr(engine, "average_precision", nan_for_the_first_head_from_the_second_epoch)
    run = run_linear(cache=tiny_cache, losses="an", lrs=[1e-2, 1e-3], batch_sizes=[8], epochs=3, out=tmp_path,
                     console=quiet())
    configs = {c["lr"]: c for c in run.results["losses"]["an"]["configs"]}
    assert configs[1e-2]["diverged_epoch"] == 2 and configs[1e-3]["diverged_epoch"] is None
    lines = [m for m in read_metrics(run.run_dir) if m["lr"] == 1e-2]
    assert [m["epoch"] for m in lines] == [1, 2] and lines[1].get("diverged") and lines[1]["val_map"] is None
    text = (run.run_dir / "results.json").read_text()
    assert "NaN" not in text and "Infinity" not in text


@pytest.mark.parametrize("val, positives", [(0, True), (1, True), (4, False)])
def test_a_val_split_that_cannot_select_is_refused(tmp_path, val, positives):
    cache_path = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5", train=24, val=val, test=8)
    if not positives:
        with h5py.File(cache_path, "r+") as file:
            file["val"]["labels"][...] = 0
            file["val"]["observed"][...] = 0
            del file.attrs["content_hash"]  # an edit the test means
    what = {0: "0 rows", 1: "1 row", 4: "4 rows and no positive label"}[val]
    with pytest.raises(SpmlError, match=f"its val split has {what}, so val mAP cannot select"):
        run_linear(cache=cache_path, losses=["an"], lrs=[1e-2], batch_sizes=[4], epochs=1, out=tmp_path,
                   console=quiet())
    assert not (tmp_path / "voc").exists()


def torchrun(*args: str) -> list[str]:
    """`torchrun --standalone --nproc-per-node 2 -m spml_cache ARGS`, as a command line."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
            "spml_cache", *args]


def torchrun_env() -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith("SPML_")}
    env.update(PYTHONPATH=str(REPO), COLUMNS="400")
    return env


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun's CPU processes, as CI runs them")
@pytest.mark.parametrize("budget", [None, "200KB"], ids=["in-memory", "lr-groups"])
def test_linear_under_torchrun_shares_the_parts_and_gives_the_one_process_results(tmp_path, budget):
    """Two gloo processes share the parts; under a budget the heads do not fit (200KB), each part's lr groups train
    in turn on the process that has the part (they used to be trained by both, and rank 0 ended with KeyError)."""
    cache_path = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5", train=40, val=16, test=20)
    grid = dict(losses=["an", "role"], lrs=[1e-2, 1e-3], batch_sizes=[4, 8], epochs=2, seeds=2, memory_budget=budget)
    done = subprocess.run(
        torchrun("linear", "--cache", str(cache_path), "--loss", "an,role", "--lr", "1e-2,1e-3", "--batch-size",
                 "4,8", "--epochs", "2", "--seeds", "2", "--device", "cpu", "--out", str(tmp_path / "two"),
                 *(["--memory-budget", budget] if budget else [])),
        env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("run directory:") == 1  # rank 0 reports for both
    assert ("lr of one batch size at a time" in done.stdout + done.stderr) == (budget is not None)
    (run_dir,) = (tmp_path / "two" / "voc").iterdir()
    whole = run_linear(cache=cache_path, out=tmp_path / "one", console=quiet(), **grid)
    shared = json.loads((run_dir / "results.json").read_text())
    strip = lambda results: {n: {k: v for k, v in e.items() if k != "seconds"} for n, e in results["losses"].items()}
    assert strip(shared) == strip(whole.results)
    lines = lambda path: sorted((path / "metrics.jsonl").read_text().splitlines())
    assert lines(run_dir) == lines(whole.run_dir)



def torchrun_training(tmp_path) -> subprocess.Popen:
    """A long `linear` under torchrun with 2 CPU processes, in its own process group; returns once rank 0 trains
    (the run directory's labels are written right before the first step)."""
    import time

    cache_path = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5", train=600, val=40, test=40, dim=32)
    process = subprocess.Popen(
        torchrun("linear", "--cache", str(cache_path), "--loss", "an", "--lr", "1e-2,1e-3", "--batch-size", "4,8",
                 "--epochs", "300", "--device", "cpu", "--out", "runs"),
        cwd=tmp_path, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "runs").glob("voc/*/labels.npz")):
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
        time.sleep(0.05)
    time.sleep(0.5)
    return process


def tools_line(tmp_path, output: str) -> str:
    """Rank 0's one line: what was kept and the command that goes on."""
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    ours = [line for line in output.splitlines() if line.startswith("interrupted: ")]
    assert len(ours) == 1 and f"go on with: spml-cache linear --resume runs/voc/{run_dir.name}" in ours[0], output
    return ours[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun's CPU processes, as CI runs them")
def test_ctrl_c_under_torchrun_ends_with_the_tools_line(tmp_path):
    """A Ctrl-C reaches torchrun and its processes, and torchrun passes it on again: rank 0 takes both as one stop
    and says what was kept and how to go on (it used to end at once on the copy, silently, leaving torchrun's
    traceback alone on the screen); torchrun then adds its own words (README.md, torchrun)."""
    import signal

    process = torchrun_training(tmp_path)
    os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole group
    tools_line(tmp_path, process.communicate(timeout=60)[0])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun's CPU processes, as CI runs them")
def test_a_killed_process_under_torchrun_leaves_the_tools_line_in_torchruns_report(tmp_path):
    """torchrun stops the others when one process dies; rank 0 says what was kept, and torchrun's failure report
    shows that line as rank 0's message (it showed a link to torchrun's docs)."""
    import signal

    process = torchrun_training(tmp_path)
    workers = [int(child) for task in Path(f"/proc/{process.pid}/task").glob("*")
               for child in (task / "children").read_text().split()]
    ranks = {int(dict(line.split("=", 1) for line in Path(f"/proc/{pid}/environ").read_text().split("\0")
                      if "=" in line)["RANK"]): pid for pid in workers}
    os.kill(ranks[1], signal.SIGKILL)
    output = process.communicate(timeout=60)[0]
    line = tools_line(tmp_path, output)
    assert f"traceback : {line}" in output, output


def test_a_process_lost_while_rank_0_gathers_is_a_stop_with_the_tools_line(tmp_path, monkeypatch):
    """gloo's error when another process ended mid-exchange ("Connection closed by peer") becomes `PeerLost`, and
    rank 0 says what was kept and how to go on, as for a stop (it was `error: RuntimeError: ...`)."""
    import torch.distributed as dist

    from spml_cache.linear import run as linear_run
    from spml_cache.runtime import ranks as ranks_module
    from spml_cache.runtime.errors import Interrupted

    def closed(*args, **kwargs):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500")

    class RankZeroOfTwo(ranks_module.Ranks):
        def broadcast(self, value):  # every process plans the same parts: nothing to exchange with itself
            return value

    monkeypatch.setattr(dist, "gather_object", closed)
    monkeypatch.setattr(linear_run, "current_ranks", lambda: RankZeroOfTwo(0, 2, 0))
    cache_path = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5", train=40, val=16, test=20)
    with pytest.raises(Interrupted) as stopped:
        run_linear(cache=cache_path, out=tmp_path / "runs", console=quiet(), losses=["an"], lrs=[1e-2],
                   batch_sizes=[4, 8], epochs=1)
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    assert stopped.value.kept == ("another process of this torchrun command ended ([gloo/transport/tcp/pair.cc:534]"
                                  f" Connection closed by peer [127.0.0.1]:29500): 1 of 2 (loss, seed, batch size)"
                                  f" parts are kept in {run_dir}")
    assert stopped.value.command == f"spml-cache linear --resume {run_dir}"


# rank 1 dies while the group forms: once rank 0 has begun to join (the file it touches then), before joining itself
DIES_WHILE_JOINING = """
import os, sys, time
from pathlib import Path

import torch.distributed as dist

joining = Path(os.environ["JOINING"])
if os.environ["RANK"] == "1":
    while not joining.exists():
        time.sleep(0.05)
    time.sleep(0.5)
    os._exit(3)
join = dist.init_process_group


def announced(*args, **kwargs):
    joining.touch()
    return join(*args, **kwargs)


dist.init_process_group = announced
from spml_cache.cli import main

sys.argv[0] = "spml-cache"
main()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun's CPU processes, as CI runs them")
def test_a_process_lost_while_the_group_forms_lets_rank_0_stop_with_the_tools_line(tmp_path):
    """Rank 0 waited in `init_process_group` (C++, where Python's handlers never run), deaf to torchrun's SIGTERM
    until its SIGKILL 30 s later, and said nothing; it now stops at once with its line, exit 143."""
    import time

    cache_path = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5", train=40, val=16, test=20)
    (tmp_path / "dies.py").write_text(DIES_WHILE_JOINING)
    env = {**torchrun_env(), "JOINING": str(tmp_path / "joining")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "dies.py",
               "linear", "--cache", str(cache_path), "--loss", "an", "--epochs", "1", "--device", "cpu"]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    output = process.communicate(timeout=120)[0]
    took = time.time() - (tmp_path / "joining").stat().st_mtime  # from rank 0's join to torchrun's end
    line = ("interrupted: nothing was done: the 2 processes of this torchrun command were still joining (another"
            " one ended, or a stop was asked for); go on with: torchrun --nproc-per-node 2 -m spml_cache linear"
            f" --cache {cache_path} --loss an --epochs 1 --device cpu")
    assert f"traceback : {line}" in output and "exitcode  : 143" in output, output  # rank 0's, in torchrun's report
    assert took < 20, f"{took:.0f} s: torchrun had to kill rank 0"
    assert not (tmp_path / "runs").exists()
