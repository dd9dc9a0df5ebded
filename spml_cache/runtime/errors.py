"""The exceptions the command line turns into a single line: `SpmlError` (exit code 1) and `Interrupted` (Ctrl-C,
exit code 130); and the stop a signal asks for, which long loops check at their safe points (`check_stop`)."""

from __future__ import annotations

import difflib
import errno
import shutil
import signal
import time
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path


class SpmlError(Exception):
    """A problem the user can fix: the message names the file or flag and what to do."""


def unknown_name(kind: str, name: str, valid: Iterable[str]) -> str:
    """`unknown <kind> '<name>'`, with the closest of the `valid` names as a suggestion when one is close
    (`rolee` -> ` (did you mean role?)`): the one wording of every registry's refusal (losses, observation rules,
    backbones, datasets), which each follows with its own list of valid names."""
    close = closest(name, valid)
    return f"unknown {kind} '{name}'" + (f" (did you mean {close}?)" if close else "")


def closest(name: str, valid: Iterable[str]) -> str | None:
    """The one of `valid` that `name` is likely a misspelling of, or None."""
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return close[0] if close else None


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
        """Whether `err` (an OSError, or the RuntimeError torch or h5py make of one) is a full disk or quota. The
        chain is followed: torch.save's "unexpected pos" RuntimeError carries the OSError it began with as its
        context."""
        seen = set()
        while err is not None and id(err) not in seen:
            if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
                return True
            text = str(err)
            if "No space left on device" in text or "errno = 28" in text or "file write failed" in text:
                return True
            seen.add(id(err))
            err = err.__cause__ or err.__context__
        return False


class Interrupted(Exception):
    """Ctrl-C during a stage: `kept` says what was kept, `command` the command that goes on (None: the same
    command again)."""

    def __init__(self, kept: str, command: str | None = None) -> None:
        super().__init__(kept)
        self.kept, self.command = kept, command


# The stop a signal asked for: the signal and when (cli/stopping.py's handler sets it), and whether the code running
# now checks it itself (`stops_deferred`) rather than taking a KeyboardInterrupt wherever the handler lands.
# `finished`: the command's work is done and written (`finished()`), so a stop has nothing left to stop.
_stop: dict = {"by": None, "at": 0.0, "deferred": 0, "finished": False}


def request_stop(signum: int) -> bool:
    """A signal asks the command to stop; True when the running code checks for it at its safe points, or has
    finished its work (the handler then returns), False when the handler is to raise KeyboardInterrupt itself."""
    _stop.update(by=signum, at=time.monotonic())
    return _stop["deferred"] > 0 or _stop["finished"]


def finished() -> None:
    """The command's work is done and written (a cache sealed, a run's results, every part handed over): a stop
    asked for from now on is only recorded, and one asked for but not yet taken is forgotten, so that what the
    command did is printed as done and it ends as without a stop. (Under torchrun a Ctrl-C that came as the run
    ended said "interrupted" over a complete run.)"""
    _stop.update(by=None, finished=True)


def more_work() -> None:
    """A stage whose door said `finished` was one step of the command (the demo runs stage after stage): a stop asks
    again to stop, and one asked for meanwhile, only recorded, is taken here."""
    _stop["finished"] = False
    check_stop()


def work_finished() -> bool:
    """Whether the command's work is done and written (`finished`): a stop asked for since changes nothing."""
    return _stop["finished"]


def stop_requested() -> int | None:
    """The signal that asked this command to stop, or None."""
    return _stop["by"]


def stop_exit_code() -> int:
    """128 + the signal that stopped the command (SIGINT's 130 when Ctrl-C reached Python some other way, or the
    stop came from elsewhere: another torchrun process ending)."""
    return 128 + (_stop["by"] or signal.SIGINT)


def seconds_since_stop() -> float:
    return time.monotonic() - _stop["at"]


def clear_stop() -> None:
    _stop.update(by=None, at=0.0, finished=False)


def check_stop() -> None:
    """A safe point: KeyboardInterrupt here when a signal asked for a stop. A KeyboardInterrupt raised by a signal
    handler lands in whatever Python code runs, a library's weakref callback included (h5py's), where it is
    printed and lost; the request itself is never lost, and the loop ends at its next check."""
    if _stop["by"] is not None:
        raise KeyboardInterrupt


@contextmanager
def stops_deferred():
    """Within the block a signal only asks for a stop, which the block's loops take at their `check_stop`s (they
    check often enough to end within a second or two)."""
    _stop["deferred"] += 1
    try:
        check_stop()  # one asked for before the block
        yield
    finally:
        _stop["deferred"] -= 1


@contextmanager
def stops_at_once():
    """Within the block a signal raises KeyboardInterrupt where the code is, even inside `stops_deferred`: for code
    with no safe points of its own (a plugin's import, which may never return), where a deferred stop would wait
    forever."""
    deferred, _stop["deferred"] = _stop["deferred"], 0
    try:
        check_stop()  # one asked for before the block
        yield
    finally:
        _stop["deferred"] = deferred
