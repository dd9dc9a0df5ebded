"""What every tracker is handed, whatever the tool: the run (`RunInfo`: its options as parameters, its tags), each
head's epochs as they are written (`Epoch` of a `Head`), and at the end each result's selected config and test
metrics with the run's files (`Outcome`); and the one contract each tool's tracker keeps (`Tracker`).

A head is one (loss, rule, lr, weight decay, batch size, seed, swept hyperparameters) of the grid: what
metrics.jsonl has one line of per epoch, and what selection picks among.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

TRACKERS_FILE = "trackers.json"  # in the run directory: each tracker's run ids and how far it logged each head


class TrackerFailed(Exception):
    """A tracker's own refusal (not logged in, a store it cannot use), said as its one line."""


def number_text(value) -> str:
    """A grid value as a head's name shows it: whole numbers as they are, others as Python writes them (lossless:
    two learning rates never share a name)."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else repr(float(value))


@dataclass(frozen=True, kw_only=True)
class Head:
    """One head of the grid: its result key (`an`, or `an@entry:0.1` under another observation rule), its name
    within the key (`lr_0.01-bs_8-seed_0`), and its parameters (loss, rule, lr, wd, batch size, seed, swept values)."""

    key: str
    name: str
    params: dict

    @property
    def id(self) -> str:
        """The head within the run (`an/lr_0.01-bs_8-seed_0`): what the ledger counts its logged epochs by."""
        return f"{self.key}/{self.name}"


@dataclass(frozen=True, kw_only=True)
class Epoch:
    """One epoch of one head as metrics.jsonl has it: its values (`train_loss`, `val_map`; epoch 0, the starting
    model of a fine-tuning, has `val_map` alone; a diverged epoch none), and whether it is the head's last
    (its every epoch trained, or stopped early, or diverged)."""

    head: Head
    epoch: int
    values: dict
    last: bool


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """The run a tracker logs: its directory, stage and dataset, its options (config.json's `options`, nested, and
    `params`, flattened to `key.sub` names and plain values), its tags (what it trains on), its epochs."""

    run_dir: Path
    stage: str
    dataset: str
    epochs: int
    options: dict
    params: dict
    tags: dict

    @property
    def name(self) -> str:
        return self.run_dir.name


@dataclass(frozen=True, kw_only=True)
class Result:
    """One result of the run (a loss, or a loss under a rule): its selected config (results.json's `selected`, with
    `best_epoch`), its metrics (mean over seeds: val and test mAP with their spreads, train mAP, and the test split's
    F1 family at the threshold and for the top k, as `spml-cache report --metric` names them), the names of the
    selected config's heads (one per seed), or why nothing was selected (`error`)."""

    key: str
    selected: dict | None
    metrics: dict
    heads: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """A finished run: its results by key, and the files a tracker keeps as artifacts."""

    results: dict[str, Result]
    files: list[Path]


class Tracker:
    """One tool's tracker. Its thread calls `start` once, then `epochs` (each epoch once: the ledger leaves out
    what was logged before a resume), then `finish` or `stop`. Whatever it raises is one warning line and the end
    of it for this run; the training never waits for it.

    The thread gives it `took(epochs)`, to be called as soon as epochs are stored (what the ledger counts as
    logged, and a resume does not send again), and `stopping`, set when the run stops: a tracker that is behind
    (a slow server) returns from `epochs` at its next request, so that a stop ends within its second or two."""

    name: str = ""
    took: Callable[[list[Epoch]], None]
    stopping: threading.Event

    def start(self, run: RunInfo, record: dict) -> None:
        """Open the tool's run, or go on in the one `record` names (what this tracker kept in trackers.json when the
        run began: a resumed run's ids), and put into `record` what a resume needs to find it again."""
        raise NotImplementedError

    def epochs(self, epochs: list[Epoch]) -> None:
        raise NotImplementedError

    def finish(self, outcome: Outcome) -> str:
        """Log the results and the files, and close the tool's run; returns one line saying where the run is."""
        raise NotImplementedError

    def stop(self, failed: bool) -> None:
        """The run stopped (Ctrl-C, SIGTERM) or failed: close the tool's run as such, to be gone on with by a resume."""
        raise NotImplementedError

    def explain(self, err: Exception) -> str | None:
        """What went wrong, in a few words, where the tool's own message would not say it in one short line."""
        return None
