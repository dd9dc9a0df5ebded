"""The files of a run directory, each written whole or not at all: a temporary name no reader's pattern matches,
flushed to the disk and renamed into place (`replace_atomically`); `metrics.jsonl` grows one complete line at a
time, and a torn last line is passed over when read."""

from __future__ import annotations

import json
import math
import os
import pickle
import zipfile
import zlib
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable

import numpy as np
import torch
from numpy.lib.npyio import NpzFile

from spml_cache.runtime.disk import remove_stale_temporaries, temporary_path
from spml_cache.runtime.errors import DiskFull, SpmlError


def jsonable(value: Any) -> Any:
    """Plain JSON values from numpy/torch scalars and arrays, paths and tuples; non-finite floats become null."""
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, torch.Tensor):
        return jsonable(value.detach().cpu().tolist())
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Enum):
        return jsonable(value.value)
    if isinstance(value, (Path, torch.device, torch.dtype)):
        return str(value)
    return value


def replace_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """`write(file)` into a temporary file, flushed to the disk, then renamed to `path`: a reader sees the old
    file or the whole new one, never a part. Nothing is left behind on failure, and what a killed process left
    behind for the same name is removed first."""
    path = Path(path)
    remove_stale_temporaries(path.parent, path.name)
    temporary = temporary_path(path)
    try:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as err:
        temporary.unlink(missing_ok=True)
        if isinstance(err, Exception) and DiskFull.caused(err):
            raise DiskFull(path) from None
        raise


def write_json(path: Path | str, data: Any) -> Path:
    """Write `data` as indented JSON, atomically."""
    path = Path(path)
    text = json.dumps(jsonable(data), indent=2, allow_nan=False) + "\n"
    replace_atomically(path, lambda file: file.write(text.encode("utf-8")))
    return path


def read_json(path: Path | str, expect: type | None = None, fix: str = "") -> Any:
    """A JSON file's contents; `expect` (dict for the object a run directory's files hold): anything else is one
    line naming the file (`fix`: what a file that is not JSON is told after it, e.g. a cut-short run's record)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpmlError(f"{path} does not exist") from None
    except json.JSONDecodeError as err:
        raise SpmlError(f"{path} is not valid JSON ({err}){fix}") from None
    if expect is not None and not isinstance(data, expect):
        raise SpmlError(f"{path} holds a JSON {type(data).__name__}, not the object spml-cache writes there (damaged,"
                        " or written by hand): run that stage again")
    return data


def append_metrics(run_dir: Path | str, rows: Iterable[dict]) -> None:
    """Append one JSON line per row to `metrics.jsonl` (one line per head per epoch); then hand the rows, as
    written, to whatever watches the run directory's metrics (`watch_metrics`)."""
    rows = [jsonable(row) for row in rows]
    lines = "".join(json.dumps(row, allow_nan=False) + "\n" for row in rows)
    path = Path(run_dir) / "metrics.jsonl"
    try:
        with open(path, "a", encoding="utf-8") as file:
            file.write(lines)
    except OSError as err:
        if DiskFull.caused(err):
            raise DiskFull(path) from None
        raise
    for watcher in _WATCHERS.get(Path(run_dir).resolve(), ()):
        watcher(rows)


# The watchers of each run directory's metrics (trackers/: `--log`), by the directory's resolved path.
_WATCHERS: dict[Path, list[Callable[[list[dict]], None]]] = {}


@contextmanager
def watch_metrics(run_dir: Path | str, watcher: Callable[[list[dict]], None]):
    """Within the block, `watcher(rows)` after each `append_metrics` into `run_dir`, with the rows as written:
    both stages write every epoch's lines through `append_metrics` (a resumed run first writes again those it
    kept), so a watcher sees what `metrics.jsonl` holds, as it grows, and nothing else. It is called in the
    writing thread and should only take the rows (a tracker's thread sends them)."""
    key = Path(run_dir).resolve()
    _WATCHERS.setdefault(key, []).append(watcher)
    try:
        yield
    finally:
        _WATCHERS[key].remove(watcher)
        if not _WATCHERS[key]:
            del _WATCHERS[key]


def read_metrics(run_dir: Path | str) -> list[dict]:
    """The lines of `metrics.jsonl`; a torn last line (the process ended mid-write) is left out."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise SpmlError(f"{path}, line {number}, is not JSON: the file was edited or damaged") from None
    return rows


def save_checkpoint(path: Path | str, state: dict) -> Path:
    """`torch.save` atomically; keep `state` to tensors and plain values so `weights_only=True` loads it."""
    path = Path(path)
    replace_atomically(path, lambda file: torch.save(state, file))
    return path


def load_checkpoint(path: Path | str) -> dict:
    path = Path(path)
    if not path.exists():
        raise SpmlError(f"{path} does not exist: is {path.parent} a finished run directory?")
    return torch.load(path, map_location="cpu", weights_only=True)


def write_npz(path: Path | str, **arrays: np.ndarray) -> Path:
    """`numpy.savez_compressed`, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path, lambda file: np.savez_compressed(file, **arrays))
    return path


def read_npz(path: Path, keys: tuple[str, ...] | None = None, required: bool = True) -> dict[str, np.ndarray]:
    """The arrays `keys` (every array when None) of an .npz file a run wrote, those it holds (the last key required
    unless not `required`), or one line naming the file: a file damaged or replaced by something else stops the
    report, not as a traceback."""
    try:
        found = np.load(path)
        if not isinstance(found, NpzFile):
            raise ValueError("an .npy array, not an .npz archive")
        with found:
            if keys and required and keys[-1] not in found:
                raise ValueError(f"no {keys[-1]!r} array in it")
            return {key: found[key] for key in (keys or found.files) if key in found}
    except (OSError, ValueError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, zlib.error) as err:
        raise SpmlError(f"{path} is not the .npz file of a run ({err}): run that stage again, or remove the"
                        " file") from None
