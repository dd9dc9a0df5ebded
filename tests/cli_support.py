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
