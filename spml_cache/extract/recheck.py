"""Resuming a partial cache whose plugin backbone's code changed since the file was started: the usual case is a
backbone that failed on a batch and was fixed, as its error line asks. The images done are kept when the code found
now gives them the features they have, checked on the last of them (the ones nearest the fault); otherwise the
resume is refused in one line: the kept rows and new ones would come from two different networks.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from spml_cache import cache
from spml_cache.cache.columns import read_wide
from spml_cache.extract.batches import BatchRun, run_batches
from spml_cache.runtime.errors import SpmlError

CHECKED_ROWS = 8  # the last rows done, recomputed with the code found now
# How far a recomputed row may be from the kept one, relative to the row's largest value: another batch around it
# rounds otherwise (float32; float16 and bfloat16 keep 11 and 8 bits), where other code gives other numbers.
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 2e-2}


class _Sample:
    """What `run_batches` reads and writes of a partial cache, for a few of its rows done: they are pending here,
    and their features are kept in memory, the file left as it is."""

    def __init__(self, partial, rows: dict[str, np.ndarray]) -> None:
        self.partial, self.final, self.rows, self.features = partial, partial.final, rows, {}

    def pending(self, split: str) -> np.ndarray:
        return self.rows.get(split, np.zeros(0, dtype=np.int64))

    def num_done(self) -> int:
        return self.partial.num_done()

    def write_rows(self, split: str, rows: np.ndarray, features: np.ndarray, bad: np.ndarray, recomputed=None) -> None:
        self.features.setdefault(split, {}).update({int(row): features[i] for i, row in enumerate(rows) if not bad[i]})


def last_done(partial, count: int = CHECKED_ROWS) -> dict[str, np.ndarray]:
    """The last `count` rows done (and not left out as bad), per split, in the order they were extracted."""
    found, left = {}, count
    for split in reversed(cache.SPLITS):  # test last, then val, then train: run_batches' order backwards
        group = partial.file[split]
        done = np.flatnonzero(group["done"][...] & ~group["bad"][...])[-left:] if left else []
        if len(done):
            found[split], left = done, left - len(done)
    return found


def keep_or_refuse(partial, paths, trunk, run: BatchRun, change: str) -> str:
    """The note that says the images done are kept with the backbone's changed code (`change`, in words), once
    they are checked to give the same features; a refusal naming the change and the fix when they do not."""
    rows = last_done(partial)
    if not rows:
        return f"the backbone {run.backbone}'s code changed since {_name(partial)} was started ({change})"
    sample = _Sample(partial, rows)
    run_batches(sample, paths, trunk, replace(run, label="", skip_bad=True))
    tolerance = TOLERANCE.get(run.precision, TOLERANCE["bf16"])
    for split, done in rows.items():
        kept = np.concatenate([read_wide(partial.file[split], slice(int(row), int(row) + 1)) for row in done])
        now = np.stack([sample.features.get(split, {}).get(int(row), np.full(kept.shape[1], np.nan)) for row in done])
        scale = np.maximum(np.abs(kept).max(axis=1, keepdims=True), 1e-6)
        if not (np.abs(now - kept) <= tolerance * scale).all():
            raise SpmlError(f"{_name(partial)} was started with other code of the backbone {run.backbone}"
                            f" ({change}), which gives other features for the images done: restore that code to go"
                            f" on, or pass --force to start over (its {partial.num_done()} images are extracted"
                            " again)")
    checked = sum(len(done) for done in rows.values())
    return (f"the backbone {run.backbone}'s code changed since {_name(partial)} was started ({change}); it"
            f" gives the same features for the last {checked} images done, so the {partial.num_done()} done are kept")


def _name(partial) -> str:
    return str(cache.partial_path(partial.final))
