"""Progress reporting shared by the long-running stages: a rich bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.text import Text

console = Console(stderr=True)


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
    """Yields an object with `.advance(n)`; shows rate and ETA either way."""
    if console.is_terminal:
        columns = (
            TextColumn("{task.description}", markup=False),  # descriptions hold names, never markup
            BarColumn(),
            MofNCompleteColumn(),
            _RateColumn(unit),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=console, transient=False) as progress:
            yield _RichProgress(progress, progress.add_task(description, total=total))
    else:
        yield _PlainProgress(description, total, unit, every_s)
