"""Ctrl-C and SIGTERM (a scheduler, `timeout`, systemd) stop a command the same way: the first as an interruption
that each stage turns into what it kept and how to go on, exit 130 or 143; a second, during that, at once.

The first signal only asks for a stop (`errors.request_stop`): where the running code checks the request at its
own safe points (`errors.stops_deferred`: stage two's loops) the handler returns and the loop ends at its next
check; elsewhere it raises KeyboardInterrupt, as Python's own handler does. Under torchrun the launcher passes a
Ctrl-C it receives on to every process, which a terminal has already signalled: that copy is the same stop.
Once the command's work is done and written (`errors.finished`) a stop has nothing to stop: the command ends as
done, exit 0, whether the signal comes while it prints its last lines or as the interpreter winds down after them.
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager

from spml_cache.runtime.errors import (
    clear_stop, request_stop, seconds_since_stop, stop_exit_code, stop_requested, work_finished,
)

# Seconds after a first signal within which, under torchrun, a second is the launcher's copy of it, not a user's
# second Ctrl-C (the launcher forwards at once; a person presses again later).
LAUNCHER_ECHO_S = 2.0


def under_torchrun() -> bool:
    """Whether torchrun (torch's elastic launcher) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _stop_on_signal(signum, frame) -> None:
    first = stop_requested()
    if first is not None:
        if under_torchrun() and seconds_since_stop() < LAUNCHER_ECHO_S:
            return
        # The children die with this process (children.py); a command whose work is done ends as done.
        os._exit(0 if work_finished() else 128 + first)
    if not request_stop(signum):
        raise KeyboardInterrupt


exit_code = stop_exit_code  # 128 + the signal that stopped the command (130: Ctrl-C, or a stop from elsewhere)


@contextmanager
def stopping_on_signals(ending_the_process: bool = False):
    """SIGINT and SIGTERM stop the command within the block; the handlers before are put back after it (the
    command line may run inside another program: the tests). `ending_the_process`: the block ends the program
    (the command line's SystemExit), whose exit code is then decided and its last line printed, so a signal from
    then on is ignored and the process ends with that code. Python's handlers, put back, killed it by the signal
    (130 or 143 over a complete, printed run) while the interpreter took its second to tear torch down; SIG_IGN is
    the one handler Python's own teardown keeps, and it lets the exit handlers (a tracker's upload) finish."""
    clear_stop()  # a command run before this one in the same process (the tests) stopped, or finished
    before = {signum: signal.signal(signum, _stop_on_signal) for signum in SIGNALS}
    try:
        yield
    except SystemExit:
        if ending_the_process:
            before = {signum: signal.SIG_IGN for signum in SIGNALS}
        raise
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        clear_stop()


SIGNALS = (signal.SIGINT, signal.SIGTERM)
