"""Run the command line from a subprocess, the way a user types it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cli_environment(env: dict | None = None) -> dict:
    """The environment a command line runs in: this one without the user's SPML_* settings (a test that wants one
    passes it), with this checkout importable; `env`'s values added (None: that variable removed)."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("SPML_")}
    # Offline: no test downloads weights. Wide columns: rich tables print whole, so assertions can find cells.
    environment.update(PYTHONPATH=str(REPO), SPML_OFFLINE="1", COLUMNS="400")
    for key, value in (env or {}).items():
        if value is None:
            environment.pop(key, None)
        else:
            environment[key] = value
    return environment


def run_cli(*args: str, cwd, env: dict | None = None, timeout: float = 600, **popen) -> subprocess.CompletedProcess:
    """`python -m spml_cache ARGS` from `cwd`, the way a user types it, with this checkout importable."""
    command = [sys.executable, "-m", "spml_cache", *args]
    return subprocess.run(command, cwd=cwd, env=cli_environment(env), capture_output=True, text=True,
                          timeout=timeout, **popen)


def start_cli(*args: str, cwd, env: dict | None = None, ready, timeout: float = 300) -> subprocess.Popen:
    """`python -m spml_cache ARGS` in a process group of its own (as a terminal starts a command, so that
    `os.killpg` is a terminal's Ctrl-C), its output in `cwd`/out.txt and err.txt; returns once `ready()`, asserting
    until then that it still runs. End it with `ended`."""
    with open(Path(cwd) / "out.txt", "w") as out, open(Path(cwd) / "err.txt", "w") as err:
        process = subprocess.Popen([sys.executable, "-m", "spml_cache", *args], cwd=cwd, env=cli_environment(env),
                                   stdout=out, stderr=err, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            assert process.poll() is None, (Path(cwd) / "err.txt").read_text()
            assert time.monotonic() < deadline, f"not ready after {timeout} s"
            time.sleep(0.02)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):  # it may have ended: the assertion above says how
            os.killpg(process.pid, signal.SIGKILL)
        raise
    return process


def ended(process: subprocess.Popen, cwd, timeout: float = 120) -> str:
    """Wait for a `start_cli` command to end (its process group killed if it has not within `timeout`); its
    stderr."""
    try:
        process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    return (Path(cwd) / "err.txt").read_text()


def run_main(*args: str, cwd, monkeypatch, capsys) -> tuple[int, str]:
    """`spml-cache ARGS` in this process (`cli.main`, what the console script calls): (exit code, stderr). For
    the many variants of one error path; `run_cli` proves the real command line."""
    from spml_cache import cli

    monkeypatch.chdir(cwd)
    monkeypatch.setattr("sys.argv", ["spml-cache", *args])
    monkeypatch.setenv("COLUMNS", "400")  # one error line stays one line
    code = 0
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        cli.main()
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
    finally:  # main leaves signals ignored for the rest of the process it ends; this process goes on
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return code, capsys.readouterr().err


def assert_flags_exist(lines: list[str], cwd) -> None:
    """Every `--flag` of each printed `spml-cache COMMAND ...` line is in that command's `--help` (a script's
    dry run against the CLI it drives)."""
    import re

    helps = {}
    for line in lines:
        command = line.split()[1]
        if command not in helps:
            done = run_cli(command, "--help", cwd=cwd)
            assert done.returncode == 0, done.stderr
            helps[command] = done.stdout
        for flag in re.findall(r"--[a-z-]+", line):
            assert flag in helps[command], (command, flag)


def one_error_line(args: list[str], *, subprocess_too: bool, cwd, monkeypatch, capsys) -> str:
    """`spml-cache ARGS` from a subprocess (`subprocess_too`, as a user types it) or in this process; asserts it
    exits 1 with one `error:` line, and returns that line."""
    if subprocess_too:
        done = run_cli(*args, cwd=cwd)
        code, stderr = done.returncode, done.stderr
    else:
        code, stderr = run_main(*args, cwd=cwd, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1, stderr
    (line,) = stderr.strip().splitlines()
    assert line.startswith("error: "), line
    return line
