"""The exceptions the command line turns into a single line: `SpmlError` (exit code 1) and `Interrupted` (Ctrl-C,
exit code 130)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path


class SpmlError(Exception):
    """A problem the user can fix: the message names the file or flag and what to do."""


class DiskFull(SpmlError):
    """No space left where a file was being written: the message names the file, the space left and how to go on
    once there is room (`then`; a stage that knows a better way than running the same command passes it with
    `going_on`)."""

    def __init__(self, path: Path, then: str = "run the command again") -> None:
        try:
            free = f"{shutil.disk_usage(Path(path).parent).free / 2**20:.1f} MiB free"
        except OSError:
            free = "no free space"
        super().__init__(f"no space left on the disk to write {path} ({free}): free some space, then {then}")
        self.path = path

    def going_on(self, then: str) -> "DiskFull":
        return DiskFull(self.path, then)

    @staticmethod
    def caused(err: BaseException) -> bool:
        """Whether `err` (an OSError, or the RuntimeError torch or h5py make of one) is a full disk or quota."""
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(err)
        return "No space left on device" in text or "errno = 28" in text or "file write failed" in text


class Interrupted(Exception):
    """Ctrl-C during a stage: `kept` says what was kept, `command` the command that goes on (None: the same
    command again)."""

    def __init__(self, kept: str, command: str | None = None) -> None:
        super().__init__(kept)
        self.kept, self.command = kept, command
