"""Run the command line from a subprocess, the way a user types it."""

from __future__ import annotations

import os
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
    try:
        cli.main()
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
    return code, capsys.readouterr().err
