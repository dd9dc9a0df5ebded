"""Safe to stop: Ctrl-C and SIGTERM end a long `linear --workers 2` within seconds with the one line, and no worker
outlives its parent, even one killed with SIGKILL; what a kill leaves half-written is never read back; one
writer at a time per run directory and per cache."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_support import REPO
from linear_support import interrupted_run, quiet, write_synthetic_cache

from spml_cache import runs
from spml_cache.extract import extract
from spml_cache.linear import run_linear
from spml_cache.runtime import locks
from spml_cache.runtime.errors import SpmlError

LONG = ["--loss", "an,role,em", "--lr", "1e-2,1e-3", "--batch-size", "4,8", "--epochs", "40", "--workers", "2"]
STOPS_WITHIN = 5.0  # seconds: generous for a loaded CI machine; the goal is 2


def children(pid: int) -> set[int]:
    """The live child processes of `pid` (Linux's /proc)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(child) for child in (task / "children").read_text().split()}
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its parent's reaping is left


@pytest.fixture(scope="module")
def long_cache(tmp_path_factory):
    return write_synthetic_cache(tmp_path_factory.mktemp("cache") / "voc-resnet50-448.h5", train=600, val=40,
                                 test=40, dim=32)


def start_long_run(tmp_path: Path, cache_path: Path) -> tuple[subprocess.Popen, set[int]]:
    """`spml-cache linear` of 3 losses x 40 epochs with 2 worker processes, in its own process group (as a
    terminal starts it); returns once both workers are training."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SPML_")}
    env.update(PYTHONPATH=str(REPO), COLUMNS="400")
    err = open(tmp_path / "err.txt", "w")
    process = subprocess.Popen([sys.executable, "-m", "spml_cache", "linear", "--cache", str(cache_path), *LONG],
                               cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    err.close()
    deadline = time.monotonic() + 120
    while len(children(process.pid)) < 2:
        assert process.poll() is None, (tmp_path / "err.txt").read_text()
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.02)
    return process, children(process.pid)


def ended_within(process: subprocess.Popen, seconds: float) -> float:
    began = time.monotonic()
    try:
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return time.monotonic() - began


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads child processes from Linux's /proc")
@pytest.mark.parametrize("signum, code, delay", [(signal.SIGINT, 130, 0.0), (signal.SIGINT, 130, 1.5),
                                                 (signal.SIGTERM, 143, 0.5)])
def test_a_signal_ends_a_long_run_within_seconds_and_leaves_no_worker(tmp_path, long_cache, signum, code, delay):
    process, workers = start_long_run(tmp_path, long_cache)
    time.sleep(delay)
    if signum == signal.SIGINT:
        os.killpg(process.pid, signum)  # Ctrl-C: the terminal signals the whole group
    else:
        process.send_signal(signum)  # `timeout`, a scheduler, systemd: the main process
    took = ended_within(process, STOPS_WITHIN)
    stderr = (tmp_path / "err.txt").read_text()
    assert process.returncode == code, stderr
    assert took < STOPS_WITHIN, f"took {took:.1f} s to stop"
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    assert last.startswith("interrupted: ") and "go on with: spml-cache linear --resume runs/voc/" in last, stderr
    assert "Traceback" not in stderr
    assert not [pid for pid in workers if alive(pid)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_sigkill_of_the_parent_leaves_no_orphan(tmp_path, long_cache):
    process, workers = start_long_run(tmp_path, long_cache)
    process.kill()
    process.wait()
    deadline = time.monotonic() + STOPS_WITHIN
    while [pid for pid in workers if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if alive(pid)], "a worker outlived its parent"


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    return write_synthetic_cache(tmp_path_factory.mktemp("tiny") / "voc-resnet50-448.h5", train=40, val=16, test=20)


GRID = dict(losses=["an", "role"], lrs=[1e-2], batch_sizes=[4, 8], epochs=2)


def test_what_a_kill_leaves_half_written_is_never_read_back(tmp_path, tiny_cache, monkeypatch):
    whole = run_linear(cache=tiny_cache, out=tmp_path / "whole", console=quiet(), **GRID)
    run_dir = interrupted_run(tmp_path / "cut", tiny_cache, monkeypatch, parts=3, **GRID)
    jobs = sorted((run_dir / "jobs").glob("*.pt"))
    assert len(jobs) == 3
    # A kill during a write leaves its temporary file (half a checkpoint): its name is no part's.
    leftover = runs.temporary_path(run_dir / "jobs" / "role-seed0-batch8.pt")
    leftover.write_bytes(jobs[0].read_bytes()[:100])
    assert leftover not in set((run_dir / "jobs").glob("*.pt"))
    # A part damaged outside the atomic writes (a copy cut short): retrained, with a warning naming it.
    damaged = jobs[1]
    damaged.write_bytes(damaged.read_bytes()[:-200])
    with pytest.warns(UserWarning, match=re.escape(damaged.name) + " is damaged .*trained again"):
        resumed = run_linear(resume=run_dir, console=quiet())
    strip = lambda results: {n: {k: v for k, v in e.items() if k != "seconds"} for n, e in results["losses"].items()}
    assert strip(resumed.results) == strip(whole.results)


def test_one_writer_per_run_directory(tmp_path, tiny_cache, monkeypatch):
    run_dir = interrupted_run(tmp_path / "cut", tiny_cache, monkeypatch, parts=1, **GRID)
    with locks.held(run_dir, "the test's hold"):
        with pytest.raises(SpmlError, match=re.escape(f"run directory {run_dir} is being written by process {os.getpid()} (")):
            run_linear(resume=run_dir, console=quiet())
    assert len(list((run_dir / "jobs").glob("*.pt"))) == 1  # the refused resume trained nothing
    assert run_linear(resume=run_dir, console=quiet()).results["complete"]
    assert not locks.lock_path(run_dir).exists()  # released and removed


@pytest.mark.filterwarnings("ignore::spml_cache.backbones.checkpoints.RandomWeightsWarning")  # random weights on purpose
def test_one_writer_per_cache(tmp_path):
    from spml_cache.demo.data import make_demo_data

    make_demo_data(tmp_path / "data", num_train=4, num_test=2, size=32)
    out = tmp_path / "voc.h5"
    with locks.held(out, "the test's hold"):
        with pytest.raises(SpmlError, match=re.escape(f"the cache {out} is being written by process {os.getpid()} (")):
            extract("voc", tmp_path / "data", out=out, weights="none", resolution=32, workers=0, force=True)
    assert not out.exists() and not list(tmp_path.glob("*.partial"))
    torch.manual_seed(0)
    assert extract("voc", tmp_path / "data", out=out, weights="none", resolution=32, workers=0).status == "written"


def _slow_starting_worker(started) -> None:
    started.set()
    time.sleep(0.5)  # a worker still in its first moments, before its initializer has run
    from spml_cache.runtime.children import ignore_interrupts

    ignore_interrupts()
    time.sleep(0.2)


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="POSIX signal masks")
@pytest.mark.parametrize("held", [True, False])
def test_a_ctrl_c_while_a_worker_starts_is_held_until_it_ignores_it(held):
    """The race behind a traceback on Ctrl-C right after `linear` starts its workers: a SIGINT reaching a child
    before its initializer ignores it. Started with interrupts held back, the child drops it and ends cleanly;
    without, the same SIGINT kills it (the check is not blind)."""
    import contextlib
    import multiprocessing

    from spml_cache.runtime.children import interrupts_held_back

    context = multiprocessing.get_context("fork")
    started = context.Event()
    holding = interrupts_held_back() if held else contextlib.nullcontext()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a child inherits it: SIGINT raises
    try:
        with holding:
            child = context.Process(target=_slow_starting_worker, args=(started,))
            child.start()
        assert started.wait(10)
        os.kill(child.pid, signal.SIGINT)  # the child alone
        child.join(10)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert child.exitcode == (0 if held else 1)
