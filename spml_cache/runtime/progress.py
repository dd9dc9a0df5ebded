"""Progress reporting shared by the long-running stages: a rich bar on a terminal (or in a notebook), plain lines
elsewhere; nothing at all while a Python door runs quiet (`reporting_to`)."""

from __future__ import annotations

import io
import sys
import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.text import Text

console = Console(stderr=True)  # the command line's: progress and notes on stderr, what it prints on stdout
_reporting: ContextVar[Console | None] = ContextVar("reporting", default=None)


def quiet_console() -> Console:
    """A console that shows nothing (a Python door's, unless asked for progress)."""
    return Console(file=io.StringIO(), quiet=True)


def door_console(progress: bool) -> Console:
    """The console a Python door reports to: the command line's (rich: a terminal's bars, or a notebook's) when
    `progress`, else one that shows nothing."""
    return console if progress else quiet_console()


@contextmanager
def reporting_to(shown: Console) -> Iterator[Console]:
    """Within it, progress bars go to `shown` (a quiet console: none at all)."""
    token = _reporting.set(shown)
    try:
        yield shown
    finally:
        _reporting.reset(token)


def live(shown: Console) -> bool:
    """Whether `shown` redraws a live display: a terminal, or a notebook (rich renders there too)."""
    return shown.is_terminal or shown.is_jupyter


class _PlainProgress:
    """Periodic one-line reports for logs and CI, where a live bar would only be noise."""

    def __init__(self, description: str, total: int, unit: str, every_s: float) -> None:
        self.description, self.total, self.unit, self.every_s = description, total, unit, every_s
        self.done = 0
        self.start = self.last = time.perf_counter()

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last >= self.every_s or self.done >= self.total:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            print(
                f"{self.description}: {self.done}/{self.total} {self.unit} ({rate:.1f} {self.unit}/s, ETA {eta:.0f} s)",
                file=sys.stderr,
                flush=True,
            )


class _Silent:
    def advance(self, n: int = 1) -> None:
        pass


class _RateColumn(ProgressColumn):
    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task) -> Text:
        return Text(f"{task.speed:.1f} {self.unit}/s" if task.speed else f"- {self.unit}/s")


class _RichProgress:
    def __init__(self, progress: Progress, task) -> None:
        self.progress, self.task = progress, task

    def advance(self, n: int = 1) -> None:
        self.progress.advance(self.task, n)


@contextmanager
def progress_bar(description: str, total: int, unit: str = "it", every_s: float = 10.0) -> Iterator:
    """Yields an object with `.advance(n)`; shows rate and ETA either way (within `reporting_to` a quiet console:
    nothing)."""
    shown = _reporting.get() or console
    if shown.quiet:
        yield _Silent()
    elif live(shown):
        columns = (
            TextColumn("{task.description}", markup=False),  # descriptions hold names, never markup
            BarColumn(),
            MofNCompleteColumn(),
            _RateColumn(unit),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=shown, transient=False) as progress:
            yield _RichProgress(progress, progress.add_task(description, total=total))
    else:
        yield _PlainProgress(description, total, unit, every_s)
