"""What every writer needs from the disk: whether it has room for what is about to be written, and the hidden
temporaries (`.<name>.tmp-<host>-<pid>`) a process writes before renaming them into place, which a process killed
with SIGKILL (or a power cut) leaves behind: those of a process that no longer runs are nobody's, and the next
writer of the same name removes them.

A process id means something on its own machine only, and a folder on a shared disk (the nodes of a torchrun job,
a cluster's home) can hold a temporary of a process running elsewhere under an id that is free here: so a
temporary carries its machine's name, and only this machine's are judged. One without a machine's name (written
before names carried it) is judged by its id here, as it was then. Another machine's left beside a name being
written is said once per folder (a warning: where, how many, whose, how old, and the command that removes them
once that machine's process is known to have ended), never removed from here.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import time
import warnings
from functools import cache
from pathlib import Path

from spml_cache.runtime.errors import SpmlError

ROOM_MARGIN = 16 * 2**20  # bytes beyond an estimate: HDF5's own structures, and the estimate's error


def require_room(path: Path, needed: int, margin: int = ROOM_MARGIN, disk: Path | None = None) -> None:
    """The disk `path` is written on (that of the folder `disk`, by default its parent) has room for `needed` more
    bytes (and `margin`), else one line with both figures."""
    free = shutil.disk_usage(_existing(Path(path).parent if disk is None else Path(disk))).free
    if free < needed + margin:
        raise SpmlError(f"not enough space for {path}: it needs about {(needed + margin) / 2**20:.1f} MiB, and"
                        f" {free / 2**20:.1f} MiB are free on that disk: free some space, or pick another --out")


def _existing(folder: Path) -> Path:
    """`folder`, or the nearest folder above it that exists (on the disk it will be made on)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


@cache
def machine_name() -> str:
    """This machine's name as a temporary carries it: its host name's letters and digits (so that the temporary's
    name parses back)."""
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:64] or "host"


def temporary_path(path: Path) -> Path:
    """Where `path` is written before it is renamed into place: a hidden name that ends in `.tmp-<host>-<pid>`, so
    that no reader's pattern (`*.pt`, `*.json`, ...) ever matches it, and two processes never share one."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{machine_name()}-{os.getpid()}")


def process_runs(pid: int) -> bool:
    """Whether a process with this id runs on this machine (another user's counts)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:  # an id beyond the system's range: no such process
        return False
    return True


def stale_temporaries(folder: Path, name: str) -> list[Path]:
    """The temporaries of `name` in `folder` (`.<name>.tmp-<host>-<pid>`, files or folders) written on this machine
    by a process that has ended (another machine's are left to it)."""
    return sorted(entry for entry, host, pid in _temporaries(folder, name)
                  if host in (None, machine_name()) and not process_runs(pid))


def _temporaries(folder: Path, name: str | None) -> list[tuple[Path, str | None, int]]:
    """(path, machine or None, process id) of each temporary of `name` (None: of any name) in `folder`."""
    named = ".+" if name is None else re.escape(name)
    pattern = re.compile(rf"\.{named}\.tmp-(?:([A-Za-z0-9]+)-)?(\d+)")
    try:
        entries = list(Path(folder).iterdir())
    except OSError:  # no folder yet, or one this process cannot list: nothing of its own is there
        return []
    return [(entry, match.group(1), int(match.group(2))) for entry in entries
            if (match := pattern.fullmatch(entry.name))]


class OtherMachinesTemporaries(UserWarning):
    """Temporaries another machine's processes left in a folder this process writes in (`say_other_machines`)."""


_TOLD: set[str] = set()  # the folders whose other machines' temporaries were said, once per process


def say_other_machines(folder: Path, name: str) -> None:
    """Warn, once per folder, where `folder` holds a temporary of `name` that another machine wrote, of every
    temporary other machines wrote there: their processes cannot be seen from here, so they are left, and said (a
    writer killed on a node of a shared disk leaves one that only that node's next write of the file removes)."""
    folder = Path(folder).resolve()  # where, said whole: the same folder from another node's working folder
    if str(folder) in _TOLD or all(host in (None, machine_name()) for _, host, _ in _temporaries(folder, name)):
        return
    _TOLD.add(str(folder))
    others = sorted((entry, host) for entry, host, _ in _temporaries(folder, None)
                    if host not in (None, machine_name()))
    hosts = sorted({host for _, host in others})
    try:
        age = max(0.0, time.time() - max(entry.lstat().st_mtime for entry, _ in others)) / 3600
    except OSError:  # removed meanwhile: its machine's process is alive, or another writer took it
        return
    removal = " ".join(shlex.quote(f"{folder}/.") + f"*.tmp-{host}-*" for host in hosts)
    warnings.warn(OtherMachinesTemporaries(
        f"{folder} holds {len(others)} temporary file{'' if len(others) == 1 else 's'} (.NAME.tmp-HOST-PID) that"
        f" {'another machine' if len(hosts) == 1 else 'other machines'} ({', '.join(hosts)}) wrote, the newest"
        f" {age:.1f} h ago, which only that machine's next write of each file removes (a process killed there"
        f" leaves one); once no spml-cache runs there, remove them: rm -rf {removal}"), stacklevel=3)


def remove_stale_temporaries(folder: Path, name: str) -> list[Path]:
    """Remove the temporaries of `name` in `folder` left by processes that have ended; returns those removed (one
    that cannot be removed is left, unnamed: the write that follows does not depend on it)."""
    say_other_machines(folder, name)
    removed = []
    for entry in stale_temporaries(folder, name):
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError:
            continue
        removed.append(entry)
    return removed
