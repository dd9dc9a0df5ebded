"""Reading run directories back: which are finished, their results, and an interrupted one to resume."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from spml_cache.losses import plugins
from spml_cache.runs.files import read_json, write_json
from spml_cache.runs.layout import RESULTS
from spml_cache.runtime import locks
from spml_cache.runtime.errors import SpmlError


def run_stamp(run_dir: Path | str) -> tuple[str, int]:
    """(YYYYmmdd-HHMMSS, same-second counter) from a run directory's name: orders runs, newest last."""
    found = re.search(r"(\d{8}-\d{6})(?:-(\d+))?$", Path(run_dir).name)
    return (found.group(1), int(found.group(2) or 1)) if found else ("", 0)


def is_complete(run_dir: Path | str) -> bool:
    return (Path(run_dir) / RESULTS).exists()


def load_results(run_dir: Path | str) -> dict:
    """`results.json` of a finished run; a clear error for a run that never finished."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SpmlError(f"{run_dir} is not a run directory")
    if not is_complete(run_dir):
        raise SpmlError(f"{run_dir} has no {RESULTS}: the run did not finish; run it again")
    return read_json(run_dir / RESULTS, dict)


def open_for_resume(run_dir: Path | str, stage: str, renewable: Callable[[str], bool] | None = None) -> dict:
    """`--resume RUN`: the `config.json` of an interrupted run of `stage`; a clear error for anything else. Its
    plugin losses are loaded, the very same code or refused, but for those `renewable(name)` says nothing was kept
    of: those go on with the code found now, which config.json records from then on."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise SpmlError(f"--resume {run_dir}: not a run directory (no config.json)")
    config = read_json(run_dir / "config.json", dict)
    if config.get("stage") != stage:
        raise SpmlError(f"--resume {run_dir}: a {config.get('stage')} run; resume it with"
                        f" spml-cache {config.get('stage')} --resume {run_dir}")
    if is_complete(run_dir):
        raise SpmlError(f"--resume {run_dir}: that run is already complete ({RESULTS})")
    renewed = plugins.load_recorded(config.get("plugins"), run_dir=run_dir, strict=True, renewable=renewable)
    if renewed:  # not while another process trains the run (with the code it recorded): that one is refused
        with locks.held(run_dir, f"run directory {run_dir}"):
            config["plugins"] = {**config["plugins"], **renewed}
            write_json(run_dir / "config.json", config)
    return config
