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
from spml_cache.runtime import disk
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


def start_linear(tmp_path: Path, cache_path: Path, flags: list[str], ready) -> subprocess.Popen:
    """`spml-cache linear --cache CACHE FLAGS` in its own process group (as a terminal starts it), its stderr in
    err.txt; returns once `ready(process)`."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SPML_")}
    env.update(PYTHONPATH=str(REPO), COLUMNS="400")
    err = open(tmp_path / "err.txt", "w")
    process = subprocess.Popen([sys.executable, "-m", "spml_cache", "linear", "--cache", str(cache_path), *flags],
                               cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    err.close()
    deadline = time.monotonic() + 120
    while not ready(process):
        assert process.poll() is None, (tmp_path / "err.txt").read_text()
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.02)
    return process


def start_long_run(tmp_path: Path, cache_path: Path) -> tuple[subprocess.Popen, set[int]]:
    """`spml-cache linear` of 3 losses x 40 epochs with 2 worker processes; returns once both workers are
    training."""
    process = start_linear(tmp_path, cache_path, LONG, lambda process: len(children(process.pid)) >= 2)
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


# --- a signal is a request the training loop takes at its next step -------------------------------------------

OUT_OF_CORE = ["--loss", "an", "--lr", "1e-2,1e-3", "--batch-size", "4,8", "--epochs", "300", "--workers", "1",
               "--memory-budget", "200KB"]  # the features stream from the cache: h5py reads at every chunk
IN_MEMORY = ["--loss", "an", "--lr", "1e-2,1e-3", "--batch-size", "4,8", "--epochs", "300", "--workers", "1"]


def start_training(tmp_path: Path, cache_path: Path, flags: list[str]) -> subprocess.Popen:
    """`spml-cache linear FLAGS`; returns once its run directory holds the labels (written under the run's lock,
    right before the first step)."""
    return start_linear(tmp_path, cache_path, flags,
                        lambda process: list((tmp_path / "runs").glob("voc/*/labels.npz")))


@pytest.mark.parametrize("flags, signum, code, delay", [
    (OUT_OF_CORE, signal.SIGINT, 130, 0.0), (OUT_OF_CORE, signal.SIGINT, 130, 0.6),
    (OUT_OF_CORE, signal.SIGTERM, 143, 1.5), (OUT_OF_CORE, signal.SIGINT, 130, 3.0),
    (IN_MEMORY, signal.SIGINT, 130, 0.3), (IN_MEMORY, signal.SIGTERM, 143, 2.0),
], ids=["ooc-int-0s", "ooc-int-0.6s", "ooc-term-1.5s", "ooc-int-3s", "mem-int-0.3s", "mem-term-2s"])
def test_a_signal_during_training_ends_the_run_with_the_one_line(tmp_path, long_cache, flags, signum, code, delay):
    process = start_training(tmp_path, long_cache, flags)
    time.sleep(delay)
    os.killpg(process.pid, signum) if signum == signal.SIGINT else process.send_signal(signum)
    took = ended_within(process, STOPS_WITHIN)
    stderr = (tmp_path / "err.txt").read_text()
    assert process.returncode == code, stderr
    assert took < STOPS_WITHIN, f"took {took:.1f} s to stop"
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    going_on = f"go on with: spml-cache linear --resume runs/voc/{run_dir.name}"
    assert last.startswith("interrupted: ") and going_on in last, stderr
    assert last.endswith("--memory-budget 200KB") == (flags is OUT_OF_CORE), last  # the budget that shaped it
    assert not (run_dir / "results.json").exists()


def test_a_signal_landing_in_a_library_callback_still_stops_the_run(tmp_path, tiny_cache, monkeypatch):
    """Python runs a signal's handler wherever the main thread is, a weakref callback of h5py's included, where a
    KeyboardInterrupt is printed ("Exception ignored in ...") and lost: the run trained on to the end, exit 0. The
    stop is a request that the loop takes at its next step."""
    import weakref

    from spml_cache.cli.stopping import stopping_on_signals
    from spml_cache.linear.engine import HeadStack
    from spml_cache.runtime.errors import Interrupted

    steps, train_step = [], HeadStack.train_step

    class Held:  # an object whose last reference goes, as h5py's do at every read
        pass

    def step_with_a_signal_in_a_callback(self, *args):
        steps.append(1)
        if len(steps) == 3:
            held = Held()
            weakref.finalize(held, signal.getsignal(signal.SIGINT), signal.SIGINT, None)
            del held  # the handler runs inside the finalizer's callback
        return train_step(self, *args)

    monkeypatch.setattr(HeadStack, "train_step", step_with_a_signal_in_a_callback)
    with stopping_on_signals(), pytest.raises(Interrupted) as stopped:
        run_linear(cache=tiny_cache, out=tmp_path, console=quiet(), memory_budget="200KB", **GRID)
    assert len(steps) == 3  # the next step's check took it
    assert stopped.value.command.endswith("--memory-budget 200KB")


def test_a_signal_before_the_stage_runs_is_one_line_and_its_exit_code(tmp_path, tiny_cache, monkeypatch, capsys):
    """A signal while the command is still starting (importing torch) reached typer as a KeyboardInterrupt, which it
    turned into a silent exit 130, even for SIGTERM."""
    from cli_support import run_main

    from spml_cache.runtime import memory

    def signalled(text, flag=memory.FLAG):
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)

    monkeypatch.setattr(memory, "parse_size", signalled)
    code, err = run_main("linear", "--cache", str(tiny_cache), "--loss", "an", cwd=tmp_path, monkeypatch=monkeypatch,
                         capsys=capsys)
    assert code == 143 and [line for line in err.splitlines() if line.strip()] == [
        f"interrupted; go on with: spml-cache linear --cache {tiny_cache} --loss an"], err


# --- under torchrun ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("launcher", [True, False])
def test_a_second_signal_stops_at_once_unless_it_is_torchruns_copy_of_the_first(monkeypatch, launcher):
    """torchrun passes a Ctrl-C it receives on to every process, which the terminal has signalled already: that copy
    is the same stop (it used to end rank 0 at once, before it could say what was kept). A second signal from a
    user, or outside torchrun, still stops at once."""
    from spml_cache.cli import stopping
    from spml_cache.runtime.errors import stop_requested, stops_deferred

    class ExitedAtOnce(Exception):
        pass

    def exit_at_once(code):
        raise ExitedAtOnce(code)

    monkeypatch.setattr(os, "_exit", exit_at_once)
    if launcher:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with stopping.stopping_on_signals(), stops_deferred():
        handler = signal.getsignal(signal.SIGINT)
        handler(signal.SIGINT, None)  # the terminal's
        assert stop_requested() == signal.SIGINT
        if launcher:
            handler(signal.SIGINT, None)  # the launcher's copy, a moment later
            monkeypatch.setattr(stopping, "LAUNCHER_ECHO_S", 0.0)  # much later: a user's second Ctrl-C
        with pytest.raises(ExitedAtOnce, match="130"):
            handler(signal.SIGINT, None)


def test_under_torchrun_the_line_is_also_the_error_file_torchrun_reports(tmp_path, monkeypatch, capsys):
    """torchrun's failure report shows a failed process's error file as its message (else a link to its docs)."""
    import json

    from cli_support import run_main

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    code, err = run_main("linear", "--cache", str(tmp_path / "x.h5"), "--loss", "an", "--memory-budget", "huge",
                         cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and json.loads(error_file.read_text())["message"] == line


# --- what a killed process leaves, and import-features' Ctrl-C (issue 48) ---------------------------------------


def an_ended_process() -> subprocess.Popen:
    """A process that has ended (and been reaped): its id is free on this machine."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    return ended


def test_a_killed_writers_temporary_is_removed_by_the_next_write_of_that_file(tmp_path):
    """SIGKILL during an atomic write (a run directory's files, report's figures and tables) leaves its hidden
    `.NAME.tmp-HOST-PID`, which no later run read but none removed either: the next write of NAME removes those of
    this machine's processes that no longer run (and those named before temporaries named their machine), and
    leaves a running one's and another machine's (on a shared disk its process id says nothing here)."""
    ended, here = an_ended_process(), disk.machine_name()
    killed = [tmp_path / f".figure.png.tmp-{here}-{ended.pid}", tmp_path / f".figure.png.tmp-{ended.pid}"]
    for path in killed:
        path.write_bytes(b"\x89PNG half")
    running = tmp_path / f".figure.png.tmp-{here}-{os.getppid()}"  # pytest's parent: a process that runs
    elsewhere = tmp_path / f".figure.png.tmp-{here}x-{ended.pid}"  # another machine's, under an id free here
    for path in (running, elsewhere):
        path.write_bytes(b"\x89PNG its own")
    from spml_cache.runtime.disk import OtherMachinesTemporaries

    with pytest.warns(OtherMachinesTemporaries, match=re.escape(elsewhere.name.split("-")[-2])):  # said (issue 56)
        runs.replace_atomically(tmp_path / "figure.png", lambda file: file.write(b"\x89PNG whole"))
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(["figure.png", running.name, elsewhere.name])
    assert runs.temporary_path(tmp_path / "figure.png").name == f".figure.png.tmp-{here}-{os.getpid()}"


@pytest.fixture(scope="module")
def authors_folder(tmp_path_factory):
    from test_import_features import write_authors_files

    folder = tmp_path_factory.mktemp("authors")
    write_authors_files(folder, num_train=20000, num_test=5000, dim=256)  # ~25 MB to write: time to signal it
    return folder


def test_ctrl_c_during_import_features_writes_nothing_and_says_so(tmp_path, authors_folder):
    """A Ctrl-C landing in one of h5py's weakref callbacks was printed there ("Exception ignored in ...") and lost:
    the cache was written, then "interrupted", exit 130. It is a request the writer takes between blocks."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SPML_")}
    env.update(PYTHONPATH=str(REPO), COLUMNS="400")
    out = tmp_path / "voc.h5"
    process = subprocess.Popen([sys.executable, "-m", "spml_cache", "import-features", str(authors_folder),
                                "--dataset", "voc", "--out", str(out)], cwd=tmp_path, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not out.with_name("voc.h5.partial").exists():  # writing: the window the stop was lost in
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.002)
    os.killpg(process.pid, signal.SIGINT)
    stderr = process.communicate(timeout=60)[1]
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert stderr.strip().splitlines() == [f"interrupted: nothing was written; go on with: spml-cache import-features"
                                           f" {authors_folder} --dataset voc --out {out}"], stderr
    assert list(tmp_path.iterdir()) == []


def test_a_signal_landing_in_a_library_callback_still_stops_an_import(tmp_path, monkeypatch):
    """The same, made certain: the handler runs inside a weakref finalizer while the features are written."""
    import weakref

    from test_import_features import write_authors_files

    from spml_cache.cache import writing
    from spml_cache.cli.stopping import stopping_on_signals
    from spml_cache.extract import import_features
    from spml_cache.runtime.errors import Interrupted

    write_authors_files(tmp_path / "authors")
    rows, blocks = writing._feature_rows, []

    class Held:  # an object whose last reference goes, as h5py's do at every write
        pass

    def block_with_a_signal_in_a_callback(features, start, stop):
        blocks.append(start)
        if len(blocks) == 1:
            held = Held()
            weakref.finalize(held, signal.getsignal(signal.SIGINT), signal.SIGINT, None)
            del held  # the handler runs inside the finalizer's callback
        return rows(features, start, stop)

    monkeypatch.setattr(writing, "_feature_rows", block_with_a_signal_in_a_callback)
    with stopping_on_signals(), pytest.raises(Interrupted, match="nothing was written"):
        import_features(tmp_path / "authors", dataset="voc", out=tmp_path / "voc.h5")
    assert len(blocks) == 1  # the next block's check took it
    assert not list(tmp_path.glob("voc.h5*"))


def test_a_stop_after_the_run_is_written_is_no_interruption(tmp_path, tiny_cache, monkeypatch, capsys):
    """A Ctrl-C as the run ended (under torchrun: the launcher's copy) reached the command while it printed its
    results: "interrupted" over a complete run, exit 130. Once the results are written a stop has nothing to stop:
    the command prints them and ends as without one."""
    from cli_support import run_main

    import spml_cache.linear

    table = spml_cache.linear.summary_table

    def signalled_while_printing(results):
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
        return table(results)

    monkeypatch.setattr(spml_cache.linear, "summary_table", signalled_while_printing)
    code, err = run_main("linear", "--cache", str(tiny_cache), "--loss", "an", "--lr", "1e-2", "--batch-size", "8",
                         "--epochs", "1", "--out", str(tmp_path / "runs"), cwd=tmp_path, monkeypatch=monkeypatch,
                         capsys=capsys)
    assert code == 0 and "interrupted" not in err, err
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    assert (run_dir / "results.json").exists()


# --- a stop after the last line is no stop (issue 56) -----------------------------------------------------------


def signalled_after_its_last_line(args: list[str], last: str, cwd: Path, signum: int) -> tuple[int, list[str], str]:
    """`spml-cache ARGS` from a subprocess, signalled (SIGINT: the terminal's whole group) a moment after it printed
    the line starting with `last`: (exit code, the lines it printed, stderr)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SPML_")}
    env.update(PYTHONPATH=str(REPO), COLUMNS="400", SPML_OFFLINE="1")
    with open(cwd / "err.txt", "w") as err:
        process = subprocess.Popen([sys.executable, "-m", "spml_cache", *args], cwd=cwd, env=env,
                                   stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    printed = []
    for line in process.stdout:
        printed.append(line.rstrip("\n"))
        if line.startswith(last):
            time.sleep(0.1)  # the interpreter winds down: torch's and h5py's teardown take a second here
            os.killpg(process.pid, signum) if signum == signal.SIGINT else process.send_signal(signum)
            break
    printed += process.stdout.read().splitlines()
    ended_within(process, STOPS_WITHIN)
    return process.returncode, printed, (cwd / "err.txt").read_text()


@pytest.fixture(scope="module")
def finished_inputs(tmp_path_factory, tiny_cache):
    """What each command below reads: demo images for extract, the authors' files for import-features, a run for
    report."""
    from test_import_features import write_authors_files

    from spml_cache.demo.data import make_demo_data

    folder = tmp_path_factory.mktemp("inputs")
    make_demo_data(folder / "data", num_train=4, num_test=2, size=32)
    write_authors_files(folder / "authors")
    run = run_linear(cache=tiny_cache, out=folder / "runs", losses=["an"], lrs=[1e-2], batch_sizes=[8], epochs=1,
                     console=quiet())
    return folder, run.run_dir


@pytest.mark.parametrize("command, signum", [("linear", signal.SIGINT), ("linear", signal.SIGTERM),
                                             ("extract", signal.SIGTERM), ("import-features", signal.SIGINT),
                                             ("report --plots", signal.SIGTERM)])
def test_a_stop_after_the_last_line_ends_the_command_as_done(tmp_path, tiny_cache, finished_inputs, command, signum):
    """A signal as the command winds down, its work written and its last line printed, killed it by that signal:
    130 or 143 over a complete, printed result (a scheduler's SIGTERM at the end marked the job failed)."""
    inputs, run_dir = finished_inputs
    args, last = {
        "linear": (["linear", "--cache", str(tiny_cache), "--loss", "an", "--epochs", "1"], "run directory: "),
        "extract": (["extract", "voc", "--root", str(inputs / "data"), "--weights", "none", "--resolution", "32",
                     "--workers", "0", "--out", "voc.h5"], "extracted "),
        "import-features": (["import-features", str(inputs / "authors"), "--dataset", "voc", "--out", "voc.h5"],
                            "wrote voc.h5 "),
        "report --plots": (["report", str(run_dir), "--plots", "figures"], "wrote figures/voc_linear-label_recovery"),
    }[command]
    code, printed, stderr = signalled_after_its_last_line(args, last, tmp_path, signum)
    assert code == 0 and "interrupted" not in stderr and "Traceback" not in stderr, (code, stderr)
    assert printed[-1].startswith(last), printed  # the signal came after the last line


def test_a_stop_while_report_prints_what_it_wrote_is_no_interruption(tmp_path, finished_inputs, monkeypatch, capsys):
    """Every figure is written before report names them: a stop then has nothing to stop."""
    from cli_support import run_main

    from spml_cache.cli.text import CONSOLE

    print_line, signalled = CONSOLE.print, []

    def signalled_while_printing(text, *args, **kwargs):
        if str(text).startswith("wrote") and not signalled:  # one signal: a second one ends the process at once
            signalled.append(signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None))
        return print_line(text, *args, **kwargs)

    monkeypatch.setattr(CONSOLE, "print", signalled_while_printing)
    code, err = run_main("report", str(finished_inputs[1]), "--plots", str(tmp_path / "figures"), cwd=tmp_path,
                         monkeypatch=monkeypatch, capsys=capsys)
    assert signalled and code == 0 and "interrupted" not in err, err
    assert len(list((tmp_path / "figures").glob("*.png"))) == 3


def test_another_machines_temporaries_are_said_once_and_never_removed_from_here(tmp_path):
    """A writer killed on another node of a shared disk leaves `.NAME.tmp-HOST-PID`, which no process here may
    judge (its id means nothing here) and nothing said (issue 56): the next write beside it says, once per folder,
    where they are, how many, whose and how old, and the command that removes them once that machine runs none."""
    from spml_cache.runtime.disk import OtherMachinesTemporaries

    ended, here = an_ended_process(), disk.machine_name()
    theirs = [tmp_path / f".results.json.tmp-{here}node7-{os.getpid()}", tmp_path / f".best.pt.tmp-{here}node7-42"]
    for path in theirs:
        path.write_bytes(b"half")
    ours = tmp_path / f".results.json.tmp-{here}-{ended.pid}"
    ours.write_bytes(b"half")
    with pytest.warns(OtherMachinesTemporaries) as said:
        runs.write_json(tmp_path / "results.json", {"complete": True})
        runs.write_json(tmp_path / "results.json", {"complete": True})  # the same folder: said once
    (warning,) = said
    assert str(warning.message) == (
        f"{tmp_path} holds 2 temporary files (.NAME.tmp-HOST-PID) that another machine ({here}node7) wrote, the newest"
        " 0.0 h ago, which only that machine's next write of each file removes (a process killed there leaves one);"
        f" once no spml-cache runs there, remove them: rm -rf {tmp_path}/.*.tmp-{here}node7-*")
    assert sorted(tmp_path.iterdir()) == sorted([*theirs, tmp_path / "results.json"])  # ours removed, theirs left
    command = str(warning.message).split("remove them: ")[1]
    subprocess.run(command, shell=True, check=True)  # the command said removes theirs, and nothing else
    assert sorted(tmp_path.iterdir()) == [tmp_path / "results.json"]


def test_the_command_line_says_another_machines_temporaries_in_one_warning_line(tmp_path):
    from test_report import make_run

    run = make_run(tmp_path / "runs", "voc", "linear", {"an": [60.0]}, stamp="20240101-000000")
    (tmp_path / f".table.md.tmp-{disk.machine_name()}other-99").write_text("| half")
    done = subprocess.run([sys.executable, "-m", "spml_cache", "report", str(run), "--out", "table.md"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "400"}, capture_output=True,
                          text=True)
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 0 and line.startswith(f"warning: {tmp_path} holds 1 temporary file (.NAME.tmp-HOST-PID)"
                                                    f" that another machine ({disk.machine_name()}other) wrote"), line
    assert (tmp_path / "table.md").exists() and (tmp_path / f".table.md.tmp-{disk.machine_name()}other-99").exists()
