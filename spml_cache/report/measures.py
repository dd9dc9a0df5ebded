"""The metrics of `spml-cache report --metric`: mAP from results.json; from the test scores every run keeps per
seed, the rankings other evaluators report (VOC 2007's 11-point interpolated mAP, `map11`; label ranking average
precision, `lrap`) and the F1 family of the multi-label literature (CP, CR, CF1, OP, OR, OF1, at the 0.5
threshold and for the top k labels of each image) (docs/protocol.md, "The metric", "Decisions at a threshold").

A metric's name is `map`, `map11`, `lrap`, or one of `metrics.F1_FAMILY` at the threshold (`cf1`), or with `@k`
for each image's k highest scores at or above the threshold (`cf1@3`, `metrics.predicted`). A run written before the per-seed scores were kept has mAP alone: its other
metrics are n/a, said once in a note.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np

from spml_cache import metrics
from spml_cache.options.report import MAP, RANKINGS
from spml_cache.runs import StoredTest, read_stored_test

TITLES = {"map": "mAP", "map11": "mAP (VOC07 11-point)", "lrap": "LRAP", "cp": "CP", "cr": "CR", "cf1": "CF1",
          "op": "OP", "or": "OR", "of1": "OF1"}


def left_out_note(runs: list[str]) -> str:
    """The one note naming the runs that kept no per-seed test scores (said once however many cells lack them)."""
    return (f"n/a: {', '.join(sorted(set(runs)))} kept no per-seed test scores (written before they were, or scored"
            " out of core): mAP only; run the stage again for the metrics beside mAP, --ci and --compare")


def every_metric(top_k: int = metrics.TOP_K) -> list[str]:
    """The names a file format carries: mAP, the other rankings, the F1 family at the threshold, and the family for
    the top k."""
    return [MAP, *RANKINGS, *metrics.F1_FAMILY, *(f"{name}@{top_k}" for name in metrics.F1_FAMILY)]


def top_k_of(metric: str) -> int:
    """The k of the top-k variants a table carries: the one `metric` names, else the default (3)."""
    return int(metric.partition("@")[2] or metrics.TOP_K)


def title(metric: str) -> str:
    """`CF1`, `CF1 (top 3)`, `mAP`: how the table names a metric."""
    name, _, k = metric.partition("@")
    return TITLES[name] + (f" (top {k})" if k else "")


def seed_values(stored: StoredTest, top_k: int = metrics.TOP_K) -> dict[str, np.ndarray]:
    """Each seed's rankings (`map11`, `lrap`) and F1 family at the threshold and for the top `top_k` (0..100, `[S]`
    per name), from its stored test scores against the run's test labels (partial labels: annotated entries only;
    sparse labels stay sparse)."""
    return {**stored.rankings(), **stored.f1_family(top_k)}


class StoredTests:
    """The stored test scores of a report's cells by (run directory, result key), the last few read kept: a COCO
    table of 28 losses and 3 seeds would hold a GB of them, and each cell's work reads its own once or twice."""

    KEPT = 4  # a --compare pair and its neighbours

    def __init__(self) -> None:
        self.found: OrderedDict[tuple[Path, str], StoredTest | None] = OrderedDict()

    def get(self, run: Path, key: str) -> StoredTest | None:
        if (run, key) not in self.found:
            self.found[run, key] = read_stored_test(run, key)
            while len(self.found) > self.KEPT:
                self.found.popitem(last=False)
        self.found.move_to_end((run, key))
        return self.found[run, key]


def add_metrics(table, tests: StoredTests) -> None:
    """Every cell's every metric (`cell.metrics`: {name: [mean, std over seeds or None]}): mAP as results.json
    has it, the F1 family from the stored test scores; [None, None] where the run kept none (named in a note)."""
    names, top_k, lacking = every_metric(top_k_of(table.metric)), top_k_of(table.metric), []
    for _, cells in table.rows:
        for cell in cells.values():
            found = {name: [None, None] for name in names}
            found[MAP] = [cell.mean, cell.std]
            stored = tests.get(cell.run, cell.key) if cell.key and cell.mean is not None else None
            if stored is not None:
                for name, values in seed_values(stored, top_k).items():
                    found[name] = [float(values.mean()), float(values.std()) if len(values) > 1 else None]
            elif cell.key and cell.mean is not None:
                lacking.append(str(cell.run))
            cell.metrics = found
    if lacking:
        table.notes.append(left_out_note(lacking))
