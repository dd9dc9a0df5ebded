"""Run the command line from a subprocess, the way a user types it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cwd, env: dict | None = None, timeout: float = 600, **popen) -> subprocess.CompletedProcess:
    """`python -m spml_cache ARGS` from `cwd`, the way a user types it, with this checkout importable."""
    # The user's own SPML_* settings must not leak into tests; a test that wants one passes it in `env`.
    environment = {key: value for key, value in os.environ.items() if not key.startswith("SPML_")}
    # Offline: no test downloads weights. Wide columns: rich tables print whole, so assertions can find cells.
    environment.update(PYTHONPATH=str(REPO), SPML_OFFLINE="1", COLUMNS="400")
    for key, value in (env or {}).items():
        if value is None:
            environment.pop(key, None)
        else:
            environment[key] = value
    command = [sys.executable, "-m", "spml_cache", *args]
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout, **popen)


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
