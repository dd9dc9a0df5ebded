"""`report --ci` and `report --compare a,b`: the test set's spread of each cell, and the paired difference of two
losses, from bootstrap resamples of the test images (report/bootstrap.py; docs/protocol.md, "Intervals over the
test images").

Every cell of a dataset is scored on the same resamples (drawn from a fixed seed for its number of test images),
so the difference of two losses on one resample is paired: what is left of it is the losses' own difference, not
two independent draws of the test set.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from spml_cache import labels as label_matrix
from spml_cache.options.report import DEFAULT_RESAMPLES, MIN_RESAMPLES
from spml_cache.report import bootstrap
from spml_cache.report.measures import StoredTests, left_out_note, title
from spml_cache.runs import StoredTest
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.memory import DEFAULT_SHARE, describe, room_left


def check_room(count: int, stored: StoredTest, metric: str) -> None:
    """Refuse, before allocating, `count` resamples of `stored`'s test images that would not fit in the memory left
    to this process (a limit on it counted: `memory.room_left`), naming the most that would."""
    shape = (len(stored.labels), stored.labels.shape[1], _most_positives(stored.labels), metric)
    need, free = bootstrap.bytes_needed(count, *shape), room_left()
    room = int(DEFAULT_SHARE * free)  # the rest for the process's other arrays
    if need <= room:
        return
    fit = bootstrap.most_that_fit(room, *shape)
    head = (f"--resamples {count:,}: the bootstrap of {shape[0]:,} test images ({shape[1]:,} classes) would take"
            f" about {describe(need)} of memory, and {describe(free)} is free to this process")
    if fit < MIN_RESAMPLES:
        raise SpmlError(f"{head}: free some memory, or leave out --ci and --compare")
    raise SpmlError(f"{head}: give --resamples {fit // 1000 * 1000 or fit:,} or fewer ({DEFAULT_RESAMPLES:,}, the"
                    " default, is enough for a 95% interval)")


def _most_positives(labels) -> int:
    """The positives of the largest class (dense or sparse labels, a bounded block of classes at a time)."""
    return max(int((label_matrix.columns(labels, low, high) > 0).sum(axis=0).max(initial=0))
               for low, high in label_matrix.class_blocks(labels))


class Resampling:
    """The resamples of each test-set size and the resampled values of each result, made once per report."""

    def __init__(self, count: int, tests: StoredTests, metric: str) -> None:
        self.count, self.tests, self.metric = count, tests, metric
        self.resamples: dict[int, bootstrap.Resamples] = {}
        self.values: dict[tuple, np.ndarray] = {}

    def of(self, cell) -> np.ndarray | None:
        """The table metric of `cell` on every resample of its test set (`[B]`), None where its run kept no scores."""
        stored = self.tests.get(cell.run, cell.key) if cell.key and cell.mean is not None else None
        if stored is None:
            return None
        if (cell.run, cell.key) not in self.values:
            rows = len(stored.labels)
            if rows not in self.resamples:
                check_room(self.count, stored, self.metric)
                self.resamples[rows] = bootstrap.Resamples.draw(rows, self.count)
            self.values[cell.run, cell.key] = bootstrap.resampled(stored, self.metric, self.resamples[rows])
        return self.values[cell.run, cell.key]

    def observed(self, stored: StoredTest) -> float:
        """The metric on the test set itself (every image once): the point the resamples spread around."""
        whole = bootstrap.Resamples(np.ones((len(stored.labels), 1), dtype=np.uint8))
        return float(bootstrap.resampled(stored, self.metric, whole)[0])


def add_intervals(table, resampling: Resampling) -> None:
    """Each cell's 95% percentile interval of the table's metric over the test images (`cell.interval`)."""
    lacking = []
    for _, cells in table.rows:
        for cell in cells.values():
            values = resampling.of(cell)
            if values is not None:
                cell.interval = list(bootstrap.interval(values))
            elif cell.key and cell.mean is not None:
                lacking.append(str(cell.run))
    table.resamples = resampling.count
    if lacking and left_out_note(lacking) not in table.notes:
        table.notes.append(left_out_note(lacking))
    note_few_resamples(table, resampling)


def note_few_resamples(table, resampling: Resampling) -> None:
    """A note on each test split too small for its resamples to differ: N images have C(2N - 1, N) distinct
    resamples (multisets of N of them), 10 for 3 images, so resamples beyond those repeat them, and the intervals
    and p-values rest on a handful of values (p = 1 from a split of 3 images says nothing)."""
    for rows in sorted(resampling.resamples):
        distinct = math.comb(2 * rows - 1, rows) if rows else 1
        if distinct >= resampling.count:
            continue
        labels = sorted({label for _, cells in table.rows for label, cell in cells.items() if cell.key
                         and (stored := resampling.tests.get(cell.run, cell.key)) is not None
                         and len(stored.labels) == rows})
        note = (f"{', '.join(labels)}: the test split has {rows} images, so only {distinct:,} distinct resamples of"
                f" it exist and the {resampling.count:,} drawn repeat them: its intervals and p-values say little"
                " (they need a larger test split)")
        if note not in table.notes:
            table.notes.append(note)


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """`first - second` of one column's table metric: on the test set, and its paired bootstrap interval and
    p-value; `problem` says why a column holding both losses could not compare them."""

    column: str
    first: str
    second: str
    metric: str
    resamples: int
    difference: float | None = None
    low: float | None = None
    high: float | None = None
    p_value: float | None = None
    seeds: str = ""  # the two cells as the table shows them: the seeds' spread, named apart from the test set's
    problem: str | None = None

    @property
    def contains_zero(self) -> bool:
        return self.low is not None and self.low <= 0.0 <= self.high

    def text(self) -> str:
        head = f"{self.column}: {self.first} - {self.second}"
        if self.problem:
            return f"{head}: not compared ({self.problem})"
        text = (f"{head} = {self.difference:+.2f} {title(self.metric)}, 95% interval over the test images"
                f" [{self.low:+.2f}, {self.high:+.2f}] (paired bootstrap, {self.resamples:,} resamples), p = "
                f"{self.p_value:.3g}; over seeds: {self.seeds}")
        return text + ("; the interval contains 0: the test set's noise can explain the difference"
                       if self.contains_zero else "")

    def as_dict(self) -> dict:
        return {**asdict(self), "contains_zero": self.contains_zero}


def compare(table, pair: tuple[str, str], resampling: Resampling) -> list[Comparison]:
    """`first - second` in every column that has both losses (their newest runs), on the same resamples."""
    first, second = pair
    found = []
    for column in table.columns:
        cells = {loss: row[column.label] for loss, row in table.rows if loss in pair and column.label in row}
        if len(cells) < 2:
            continue
        a, b = cells[first], cells[second]
        seeds = f"{first} {_spread(a)}, {second} {_spread(b)}"
        base = {"column": column.label, "first": first, "second": second, "metric": resampling.metric,
                "resamples": resampling.count, "seeds": seeds}
        stored = [resampling.tests.get(cell.run, cell.key) if cell.mean is not None else None for cell in (a, b)]
        if None in stored:
            found.append(Comparison(**base, problem="a run kept no per-seed test scores; run it again"))
        elif not _same_images(*stored):
            found.append(Comparison(**base, problem="the two runs were scored on different test images"))
        else:
            differences = resampling.of(a) - resampling.of(b)
            low, high = bootstrap.interval(differences)
            point = resampling.observed(stored[0]) - resampling.observed(stored[1])
            found.append(Comparison(**base, difference=point, low=low, high=high,
                                    p_value=bootstrap.p_value(differences)))
    if not found:
        raise SpmlError(f"--compare {first},{second}: no column of the table has both; name two losses of one"
                        " dataset and stage")
    note_few_resamples(table, resampling)
    return found


def _spread(cell) -> str:
    if cell.mean is None:
        return "n/a"
    return f"{cell.mean:.2f}" + (f" ± {cell.std:.2f} ({cell.seeds} seeds)" if cell.std is not None else " (1 seed)")


def _same_images(first: StoredTest, second: StoredTest) -> bool:
    """Whether two results were scored on the same test rows (same labels, same mask): pairing needs it."""
    if first.scores.shape[1:] != second.scores.shape[1:] or not label_matrix.same(first.labels, second.labels):
        return False
    if (first.mask is None) != (second.mask is None):
        return False
    return first.mask is None or label_matrix.same(first.mask, second.mask)
