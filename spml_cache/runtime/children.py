"""Child processes that never outlive their parent: stage two's job workers and the image loaders' workers.

A child asks Linux to kill it the moment its parent dies (`PR_SET_PDEATHSIG`: a SIGKILL of the parent leaves no
orphan holding the training data or a lock), and checks that the parent it was started for is still its parent
(one that died before the request was made is not watched). Elsewhere (macOS, Windows) the request is not
available; torch's loader workers watch their parent themselves, and stage two's workers are terminated by the
parent on every exit it lives to see.
"""

from __future__ import annotations

import ctypes
import functools
from contextlib import contextmanager
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """In a child process of `parent_pid`: be killed when it dies; exit now if it already has."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # no libc to ask: the parent's own cleanup is what is left
            pass
    if os.getppid() != parent_pid:
        os._exit(1)


@contextmanager
def interrupts_held_back():
    """Ctrl-C held back (blocked, not lost) while worker processes start. A child inherits the block, so a SIGINT
    to the process group in its first milliseconds stays pending until its initializer ignores it
    (`ignore_interrupts`) instead of killing it with a traceback; the parent gets its own copy on leaving."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX: nothing to hold
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def ignore_interrupts() -> None:
    """In a worker: Ctrl-C reaches the whole process group, and the parent handles it (it stops the workers);
    one held back while the worker started is dropped here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _init_loader_worker(worker_id: int, parent_pid: int) -> None:
    die_with_parent(parent_pid)


def loader_worker_init():
    """A `worker_init_fn` for a torch `DataLoader` made in this process: its workers die with it."""
    return functools.partial(_init_loader_worker, parent_pid=os.getpid())
