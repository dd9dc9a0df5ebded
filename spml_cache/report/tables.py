"""Table-1 style tables from run directories: the table, its cells' text, and CSV, Markdown, JSON (the terminal's
is report/terminal.py, LaTeX's report/latex.py).

One row per loss, one column per dataset x stage x cache x observation rule (a rule other than `single` is named
in its column's label, so a table over rules is loss x rule); a cell is the test mAP at the selected epoch, mean +-
std over the run's seeds, or another metric (`--metric`, report/measures.py), with its bootstrap interval over the
test images (`--ci`, report/confidence.py) where asked. The file formats carry every metric. When a loss was run several times for the same column, the newest run (by the stamp
in its directory name) is used and the older ones are named in the notes (`collect.select_newest`), so
re-running one loss replaces just that row.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from spml_cache import losses
from spml_cache.observation import DEFAULT_RULE
from spml_cache.report.collect import (
    DATASET_LABELS, DEFAULT_BACKBONE, Column, Run, in_spec_order, oracle_losses, select_newest,
)
from spml_cache.report.measures import MAP, every_metric, title as metric_title, top_k_of
from spml_cache.report.paper import PAPERS, paper_number
from spml_cache.selection import diverged_after_selection


@dataclass
class Cell:
    mean: float | None  # None: n/a (a test split that scored no class), never ranked
    std: float | None  # None with one seed
    seeds: int
    run: Path
    best: bool = False
    paper: float | None = None
    source: str | None = None
    swept: dict | None = None  # the selected values of the hyperparameters the run swept (and its weight decay)
    start: float | None = None  # fine-tuned: the test mAP of its model before any step (epoch 0)
    key: str = ""  # the result's key in its run's files (`loss@rule` under a rule other than single)
    metrics: dict | None = None  # {metric: [mean, std or None]}, None where n/a (report/measures.py)
    interval: list | None = None  # [low, high]: the table metric's 95% bootstrap interval over the test images
    diverged: int | None = None  # the epoch its selected heads diverged, after the one reported: never the best

    @property
    def diff(self) -> float | None:
        return None if self.paper is None or self.mean is None else self.mean - self.paper

    @property
    def below_start(self) -> bool:
        """Fine-tuning ended below where it started (marked ↓ in the table)."""
        return self.start is not None and self.mean is not None and self.mean < self.start


@dataclass
class Table:
    columns: list[Column]
    rows: list[tuple[str, dict[str, Cell]]]  # (loss, {column label: cell})
    oracles: set[str]
    paper: bool
    notes: list[str] = field(default_factory=list)
    incomplete: list[Run] = field(default_factory=list)
    metric: str = MAP  # what the cells' mean and std are (report/measures.py's names)
    resamples: int | None = None  # the bootstrap resamples of the cells' intervals (--ci), None without
    comparisons: list = field(default_factory=list)  # --compare's paired differences (confidence.Comparison)


ZERO_SHOT = "zero-shot (reference)"  # the row of a CLIP cache's image-text similarity alone, no training


def _cell(run: Run, loss: str) -> Cell:
    result = run.losses[loss]
    seeds = len(result.get("per_seed") or []) or 1
    std = result.get("test_map_std") if seeds > 1 else None
    mean = None if run.test_unscored else float(result["test_map"])
    start = (result.get("start") or {}).get("test_map")
    selected = result.get("selected") or {}
    swept = {**(selected.get("swept") or {}), **({"wd": selected["wd"]} if "wd" in selected else {})}  # linear --wd
    return Cell(mean=mean, std=None if std is None or mean is None else float(std), seeds=seeds, run=run.path,
                swept=swept or None, start=None if start is None else float(start), key=run.key(loss),
                diverged=diverged_after_selection(result))


def build_table(runs: list[Run], *, paper: bool = False) -> Table:
    """The Table-1 layout: best single-positive loss per column marked (oracles excluded, as in the papers)."""
    columns, chosen, notes = select_newest(runs)
    oracles = oracle_losses()
    present = {loss for _, loss in chosen}
    rows, decays = [], {}
    for loss in in_spec_order(present):
        cells = {}
        for column in columns:
            run = chosen.get((column.label, loss))
            if run is None:
                continue
            cells[column.label] = cell = _cell(run, loss)
            if "wd" in (cell.swept or {}):
                decays.setdefault(column.label, set()).update(_swept_decays(run) or [cell.swept["wd"]])
            published = (paper and column.rule == DEFAULT_RULE and column.backbone == DEFAULT_BACKBONE
                         and paper_number(column.stage, column.dataset, loss))  # the papers' are ResNet-50's
            if published:
                cell.paper, cell.source = published
        rows.append((loss, cells))
    reference = _zero_shot_cells(columns, chosen)
    mark_best(columns, rows, oracles)
    for column in columns:
        if paper and column.backbone != DEFAULT_BACKBONE:
            notes.append(f"{column.label}: backbone {column.backbone}; the papers' numbers are ResNet-50's, so none"
                         " is shown beside it")
        elif paper and column.dataset in DATASET_LABELS and column.weights not in (None, "IMAGENET1K_V1"):
            notes.append(f"{column.label}: ResNet-50 weights '{column.weights}', the papers' IMAGENET1K_V1:"
                         " the comparison is not like for like")
    notes += [f"{label}: weight decay selected per loss from {', '.join(f'{wd:g}' for wd in sorted(wds))} (--wd);"
              " a cell names it where it is not 0" for label, wds in decays.items()]
    rows += [(ZERO_SHOT, reference)] if reference else []  # after the best marks: never the best loss
    return Table(columns, rows, oracles & present, paper, notes, [run for run in runs if run.results is None])


def _swept_decays(run: Run) -> list[float]:
    """The weight decays a linear run swept (`--wd`): config.json's `options`, or its `wds` in runs written before
    the options were stored whole."""
    return list((run.config.get("options") or {}).get("wds") or run.config.get("wds") or [])


def mark_best(columns: list[Column], rows: list, oracles: set[str]) -> None:
    """Star each column's best single-positive cell by its mean (oracles, n/a and diverged cells excluded)."""
    for column in columns:
        candidates = [cells[column.label] for loss, cells in rows if loss not in oracles and column.label in cells
                      and cells[column.label].mean is not None]
        for cell in candidates:
            cell.best = False
        candidates = [cell for cell in candidates if cell.diverged is None]
        if candidates:
            max(candidates, key=lambda c: c.mean).best = True


def by_metric(table: Table, metric: str) -> None:
    """Make `metric` the table's: each cell's mean and std are that metric's (`measures.add_metrics`; n/a where the
    run kept no scores), the best cells marked again by it; fine-tuning's start (an mAP) is not compared with it."""
    table.metric = metric
    for _, cells in table.rows:
        for cell in cells.values():
            cell.mean, cell.std = (cell.metrics or {}).get(metric) or [None, None]
            cell.start = None
    mark_best(table.columns, table.rows, table.oracles)


def _zero_shot_cells(columns: list[Column], chosen: dict[tuple[str, str], Run]) -> dict[str, Cell]:
    """Per column, the zero-shot reference (test mAP of the image-text similarity) its newest run recorded."""
    cells = {}
    for column in columns:
        found = [run for (label, _), run in chosen.items() if label == column.label
                 and ((run.results or {}).get("reference") or {}).get("zero_shot")]
        if found:
            run = max(found, key=lambda r: (r.stamp, r.path.name))
            cells[column.label] = Cell(mean=float(run.results["reference"]["zero_shot"]["test_map"]), std=None,
                                       seeds=1, run=run.path)
    return cells


def shown_swept(cell: Cell) -> dict:
    """The selected values a cell names: every swept hyperparameter's, and the weight decay where it is not 0 (the
    papers' grid; that a column's runs swept it is said once, in a note: `decay_notes`)."""
    return {key: value for key, value in (cell.swept or {}).items() if not (key == "wd" and value == 0)}


@dataclass(frozen=True, kw_only=True)
class CellStyle:
    """How a cell's parts are written: as the terminal, Markdown and CSV show them, or typeset (latex.py)."""

    missing: str = "-"  # no run for this loss and column
    spread: str = " ± "  # before the seeds' standard deviation
    below_start: str = " ↓"  # a fine-tuned result below its epoch 0
    diverged: str = " †"  # a result whose heads diverged after it
    swept: str = "{key}={value:g}"  # one selected hyperparameter
    between: str = " "  # between two of them
    name: Callable[[str], str] = str  # a hyperparameter's name as written


PLAIN = CellStyle()


def cell_text(cell: Cell | None, style: CellStyle = PLAIN) -> str:
    """`85.00 ± 0.82 [84.10, 85.90] ↓ (delta=0.002)`: the mean, the seeds' spread, the --ci interval, the mark of a
    result below its start, the selected swept values; `-` without a run, `n/a` without a score."""
    if cell is None:
        return style.missing
    if cell.mean is None:
        return "n/a"
    text = f"{cell.mean:.2f}" + (f"{style.spread}{cell.std:.2f}" if cell.std is not None else "")
    text += f" [{cell.interval[0]:.2f}, {cell.interval[1]:.2f}]" if cell.interval else ""
    text += style.below_start if cell.below_start else ""
    text += style.diverged if cell.diverged is not None else ""
    swept = [style.swept.format(key=style.name(key), value=value) for key, value in shown_swept(cell).items()]
    return text + (" (" + style.between.join(swept) + ")" if swept else "")


def text_grid(table: Table, mark_best) -> tuple[list[str], list[list[str]]]:
    """Header and text rows shared by the terminal and Markdown tables; `mark_best` decorates best cells. With
    --paper, a "paper" and a "Δ" column follow each column that has a published number, and no other."""
    published = {label for _, cells in table.rows for label, cell in cells.items() if cell.paper is not None}
    header = ["loss"]
    for column in table.columns:
        header += [column.label] + (["paper", "Δ"] if column.label in published else [])
    rows = []
    for loss, cells in table.rows:
        row = [row_name(table, loss)]
        for column in table.columns:
            cell = cells.get(column.label)
            row.append(mark_best(cell_text(cell)) if cell is not None and cell.best else cell_text(cell))
            if column.label in published:
                # the published number as the paper prints it, then ours minus it
                has_paper = cell is not None and cell.paper is not None
                row += [str(cell.paper), f"{cell.diff:+.2f}"] if has_paper else ["", ""]
        rows.append(row)
    return header, rows


def row_name(table: Table, loss: str) -> str:
    """A row's loss as the papers write it (`AN-LS`, `EM+APL`; losses.display_name), an oracle said to be one; CSV
    and JSON keep the registry name, which the flags and run files use."""
    shown = losses.display_name(loss)
    return f"{shown} (oracle)" if loss in table.oracles else shown


def heading(table: Table) -> str:
    """What a cell holds: the metric, the seeds' spread and, with --ci, the test set's (named apart)."""
    text = f"Test {metric_title(table.metric)} at the selected epoch (mean ± std over seeds"
    if table.resamples:
        text += f"; [95% bootstrap interval over the test images, {table.resamples:,} resamples]"
    return text + ")"


def footnotes(table: Table) -> list[str]:
    notes = ["best single-positive loss per column in bold (*); oracles (full labels) excluded"] if table.rows else []
    if table.resamples:
        notes.append("± is the seeds' spread (population std over the run's seeds); [low, high] the test set's: the"
                     " 2.5th and 97.5th percentiles of the mean over seeds on bootstrap resamples of the test images,"
                     " the same resamples for every loss of a dataset")
    notes += table.notes
    notes += [f"↓ {loss}, {label}: fine-tuning ended below its start (test mAP {cell.start:.2f} before any step,"
              " epoch 0)" for loss, cells in table.rows for label, cell in cells.items() if cell.below_start]
    notes += [f"† {loss}, {label}: its selected heads diverged (a non-finite loss or score) at epoch {cell.diverged},"
              " after the epoch reported: no converged result, never marked best (try a lower --lr, or check the"
              " loss)" for loss, cells in table.rows for label, cell in cells.items() if cell.diverged is not None]
    used = sorted({cell.source for _, cells in table.rows for cell in cells.values() if cell.source})
    if used:
        notes.append(f"paper numbers: {'; '.join(used)}")
        notes += [f"{paper}: {PAPERS[paper]}" for paper in PAPERS if any(source.startswith(paper) for source in used)]
    notes += [f"incomplete, not tabulated: {run.path} ({run.problem})" for run in table.incomplete]
    return notes


def _every(table: Table) -> list[str]:
    return every_metric(top_k_of(table.metric))


def to_csv(table: Table) -> str:
    """Wide CSV for spreadsheets: per column `mean`, `std`, `seeds`, `best` of the table's metric (with --ci `ci
    low`, `ci high`; with --paper `paper`, `diff`, `source`), then every metric's `<name>` and `<name> std`."""
    fields = ["mean", "std", "seeds", "best"] + (["ci low", "ci high"] if table.resamples else [])
    fields += ["paper", "diff", "source"] if table.paper else []
    fields += ["swept"] if any(cell.swept for _, cells in table.rows for cell in cells.values()) else []
    fields += [f"{name}{part}" for name in _every(table) for part in ("", " std")]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["loss"] + [f"{column.label} {name}" for column in table.columns for name in fields])
    for loss, cells in table.rows:
        row = [loss]
        for column in table.columns:
            cell = cells.get(column.label)
            values = {} if cell is None else {**vars(cell), "best": int(cell.best), "diff": cell.diff,
                                              "swept": json.dumps(cell.swept) if cell.swept else None,
                                              **_metric_fields(cell)}
            row += ["" if values.get(name) is None else values[name] for name in fields]
        writer.writerow(row)
    return buffer.getvalue()


def _metric_fields(cell: Cell) -> dict:
    """A cell's CSV fields beyond the table's metric: its interval, and every metric's mean and std."""
    found = {"ci low": cell.interval[0], "ci high": cell.interval[1]} if cell.interval else {}
    for name, (mean, std) in (cell.metrics or {}).items():
        found.update({name: mean, f"{name} std": std})
    return found


def _markdown_rows(rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(row) + " |" for row in [rows[0], ["---"] * len(rows[0]), *rows[1:]]]


def _every_metric_tables(table: Table) -> list[str]:
    """Markdown: per column, every metric of every loss (mean ± std over seeds; n/a where the run kept no scores)."""
    names, lines = _every(table), []
    for column in table.columns:
        rows = [["loss", *(metric_title(name) for name in names)]]
        for loss, cells in table.rows:
            cell = cells.get(column.label)
            if cell is not None and cell.metrics:
                rows.append([losses.display_name(loss), *(_mean_std(cell.metrics.get(name)) for name in names)])
        if len(rows) > 1:
            lines += ["", f"Every metric, {column.label} (test, selected epoch; mean ± std over seeds):", "",
                      *_markdown_rows(rows)]
    return lines


def _mean_std(value) -> str:
    if value is None or value[0] is None:
        return "n/a"
    return f"{value[0]:.2f}" + (f" ± {value[1]:.2f}" if value[1] is not None else "")


def to_markdown(table: Table) -> str:
    header, rows = text_grid(table, lambda text: f"**{text}**")
    lines = _markdown_rows([header, *rows])  # the table first: scripts read it from the first line
    lines += ["", f"- {heading(table)}"] + [f"- {note}" for note in footnotes(table)]
    lines += ["", "Paired comparisons:", ""] + [f"- {c.text()}" for c in table.comparisons] if table.comparisons else []
    lines += _every_metric_tables(table)
    return "\n".join(lines) + "\n"


def to_json(table: Table) -> str:
    payload = {
        "metric": heading(table), "metric_name": table.metric, "every_metric": _every(table),
        "resamples": table.resamples,
        "columns": [vars(column) for column in table.columns],
        "rows": [{"loss": loss, "display_name": losses.display_name(loss), "oracle": loss in table.oracles,
                  "cells": {label: {**vars(cell), "run": str(cell.run), "diff": cell.diff} for label, cell in cells.items()}}
                 for loss, cells in table.rows],
        "notes": table.notes,
        "incomplete": [{"path": str(run.path), "problem": run.problem} for run in table.incomplete],
        "paper_sources": PAPERS if table.paper else {},
        "comparisons": [comparison.as_dict() for comparison in table.comparisons],
    }
    return json.dumps(payload, indent=2) + "\n"
