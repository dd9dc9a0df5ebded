"""One writer at a time: an exclusive lock on what a command is writing (a cache being extracted, a run directory
being trained), held for the whole command and released by the system when the process ends, however it ends.

The lock is `flock` on a small hidden file beside what it guards, which names the process that holds it, so the
one line a second writer gets says who to wait for. Where `fcntl` does not exist (Windows) nothing is locked.
"""

from __future__ import annotations

import os
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path

from spml_cache.runtime.errors import DiskFull, SpmlError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None


def lock_path(guarded: Path) -> Path:
    """The lock file of a file or folder: `.<name>.lock` beside a file, `.lock` inside a folder."""
    guarded = Path(guarded)
    return guarded / ".lock" if guarded.is_dir() else guarded.with_name(f".{guarded.name}.lock")


@contextmanager
def held(guarded: Path, what: str):
    """Hold the lock of `guarded` for the block; `what` names it in the error a second writer gets. The lock file
    is removed when the block ends (while still held: a process that opened it meanwhile finds it gone and tries
    the new one), so nothing is left beside a finished cache or in a finished run directory."""
    path = lock_path(guarded)
    if fcntl is None:
        yield
        return
    file = _lock(path, what)
    try:
        _name_holder(file, path)
        yield
    finally:
        path.unlink(missing_ok=True)
        file.close()


def _name_holder(file, path: Path) -> None:
    """Write this process and its command into the locked file (unbuffered: nothing is left to flush at close, so
    a full disk is this one line, not a second error from `close`)."""
    holder = f"process {os.getpid()} ({shlex.join(['spml-cache', *sys.argv[1:]])})\n".encode("utf-8")
    try:
        os.ftruncate(file.fileno(), 0)
        os.pwrite(file.fileno(), holder, 0)
    except OSError as err:
        if DiskFull.caused(err):
            raise DiskFull(path) from None
        raise SpmlError(f"cannot write the lock file {path} ({err.strerror or err}): is {path.parent}"
                        " writable?") from None


def _lock(path: Path, what: str):
    """The open, locked lock file at `path` (the one there now, not one removed while this waited for it)."""
    while True:
        try:
            file = open(path, "a+", encoding="utf-8")
        except OSError as err:
            if DiskFull.caused(err):
                raise DiskFull(path) from None
            raise SpmlError(f"cannot create the lock file {path} ({err.strerror or err}): is {path.parent}"
                            " writable?") from None
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "another process"
            file.close()
            raise SpmlError(f"{what} is being written by {holder}: wait for it to finish, or stop it") from None
        try:
            current = os.stat(path).st_ino == os.fstat(file.fileno()).st_ino
        except FileNotFoundError:
            current = False
        if current:
            return file
        file.close()


def opened_by(path: Path) -> list[str]:
    """`process PID (NAME)` of each other process that has `path` open (Linux's /proc; those of other users this
    process may not look into are not seen): whom a refusal to write it asks to close it."""
    target, found = os.path.realpath(path), []
    for fds in Path("/proc").glob("[0-9]*/fd"):
        pid = int(fds.parent.name)
        if pid == os.getpid():
            continue
        try:
            if any(os.readlink(fd) == target for fd in fds.iterdir()):
                found.append(f"process {pid} ({(fds.parent / 'comm').read_text().strip()})")
        except OSError:  # ended meanwhile, or another user's
            continue
    return found
