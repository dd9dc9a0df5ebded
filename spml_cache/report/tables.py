"""Table-1 style tables from run directories: terminal, CSV, Markdown, JSON.

One row per loss, one column per dataset x stage x cache x observation rule (a rule other than `single` is named
in its column's label, so a table over rules is loss x rule); a cell is the test mAP at the selected epoch, mean +-
std over the run's seeds. When a loss was run several times for the same column, the newest run (by the stamp
in its directory name) is used and the older ones are named in the notes (`collect.select_newest`), so
re-running one loss replaces just that row.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table as RichTable
from rich.text import Text

from spml_cache.observation import DEFAULT_RULE
from spml_cache.runtime.errors import SpmlError, unknown_name
from spml_cache.report.collect import (
    DATASET_LABELS, DEFAULT_BACKBONE, Column, Run, in_spec_order, oracle_losses, select_newest,
)
from spml_cache.report.paper import PAPERS, paper_number


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
                swept=swept or None, start=None if start is None else float(start))


def build_table(runs: list[Run], *, paper: bool = False) -> Table:
    """The Table-1 layout: best single-positive loss per column marked (oracles excluded, as in the papers)."""
    columns, chosen, notes = select_newest(runs)
    oracles = oracle_losses()
    present = {loss for _, loss in chosen}
    rows = []
    for loss in in_spec_order(present):
        cells = {}
        for column in columns:
            run = chosen.get((column.label, loss))
            if run is None:
                continue
            cells[column.label] = cell = _cell(run, loss)
            published = (paper and column.rule == DEFAULT_RULE and column.backbone == DEFAULT_BACKBONE
                         and paper_number(column.stage, column.dataset, loss))  # the papers' are ResNet-50's
            if published:
                cell.paper, cell.source = published
        rows.append((loss, cells))
    reference = _zero_shot_cells(columns, chosen)
    for column in columns:
        candidates = [cells[column.label] for loss, cells in rows if loss not in oracles and column.label in cells
                      and cells[column.label].mean is not None]
        if candidates:
            max(candidates, key=lambda c: c.mean).best = True
        if paper and column.backbone != DEFAULT_BACKBONE:
            notes.append(f"{column.label}: backbone {column.backbone}; the papers' numbers are ResNet-50's, so none"
                         " is shown beside it")
        elif paper and column.dataset in DATASET_LABELS and column.weights not in (None, "IMAGENET1K_V1"):
            notes.append(f"{column.label}: ResNet-50 weights '{column.weights}', the papers' IMAGENET1K_V1:"
                         " the comparison is not like for like")
    rows += [(ZERO_SHOT, reference)] if reference else []  # after the best marks: never the best loss
    return Table(columns, rows, oracles & present, paper, notes, [run for run in runs if run.results is None])


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


def cell_text(cell: Cell | None) -> str:
    if cell is None:
        return "-"
    if cell.mean is None:
        return "n/a"
    text = f"{cell.mean:.2f}" + (f" ± {cell.std:.2f}" if cell.std is not None else "")
    text += " ↓" if cell.below_start else ""
    return text + (" (" + " ".join(f"{key}={value:g}" for key, value in cell.swept.items()) + ")" if cell.swept else "")


def _grid(table: Table, mark_best) -> tuple[list[str], list[list[str]]]:
    """Header and text rows shared by the terminal and Markdown tables; `mark_best` decorates best cells. With
    --paper, a "paper" and a "Δ" column follow each column that has a published number, and no other."""
    published = {label for _, cells in table.rows for label, cell in cells.items() if cell.paper is not None}
    header = ["loss"]
    for column in table.columns:
        header += [column.label] + (["paper", "Δ"] if column.label in published else [])
    rows = []
    for loss, cells in table.rows:
        row = [f"{loss} (oracle)" if loss in table.oracles else loss]
        for column in table.columns:
            cell = cells.get(column.label)
            row.append(mark_best(cell_text(cell)) if cell is not None and cell.best else cell_text(cell))
            if column.label in published:
                # the published number as the paper prints it, then ours minus it
                has_paper = cell is not None and cell.paper is not None
                row += [str(cell.paper), f"{cell.diff:+.2f}"] if has_paper else ["", ""]
        rows.append(row)
    return header, rows


def footnotes(table: Table) -> list[str]:
    notes = ["best single-positive loss per column in bold (*); oracles (full labels) excluded"] if table.rows else []
    notes += table.notes
    notes += [f"↓ {loss}, {label}: fine-tuning ended below its start (test mAP {cell.start:.2f} before any step,"
              " epoch 0)" for loss, cells in table.rows for label, cell in cells.items() if cell.below_start]
    used = sorted({cell.source for _, cells in table.rows for cell in cells.values() if cell.source})
    if used:
        notes.append(f"paper numbers: {'; '.join(used)}")
        notes += [f"{paper}: {PAPERS[paper]}" for paper in PAPERS if any(source.startswith(paper) for source in used)]
    notes += [f"incomplete, not tabulated: {run.path} ({run.problem})" for run in table.incomplete]
    return notes


def to_csv(table: Table) -> str:
    """Wide CSV for spreadsheets: per column `mean`, `std`, `seeds`, `best` (and `paper`, `diff`, `source`)."""
    fields = ["mean", "std", "seeds", "best"] + (["paper", "diff", "source"] if table.paper else [])
    fields += ["swept"] if any(cell.swept for _, cells in table.rows for cell in cells.values()) else []
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["loss"] + [f"{column.label} {name}" for column in table.columns for name in fields])
    for loss, cells in table.rows:
        row = [loss]
        for column in table.columns:
            cell = cells.get(column.label)
            values = {} if cell is None else {**vars(cell), "best": int(cell.best), "diff": cell.diff,
                                              "swept": json.dumps(cell.swept) if cell.swept else None}
            row += ["" if values.get(name) is None else values[name] for name in fields]
        writer.writerow(row)
    return buffer.getvalue()


def to_markdown(table: Table) -> str:
    header, rows = _grid(table, lambda text: f"**{text}**")
    lines = ["| " + " | ".join(row) + " |" for row in [header, ["---"] * len(header), *rows]]
    lines += [""] + [f"- {note}" for note in footnotes(table)] if footnotes(table) else []
    return "\n".join(lines) + "\n"


def to_json(table: Table) -> str:
    payload = {
        "metric": "test mAP (0-100) at the selected epoch; mean and std over the run's seeds",
        "columns": [vars(column) for column in table.columns],
        "rows": [{"loss": loss, "oracle": loss in table.oracles,
                  "cells": {label: {**vars(cell), "run": str(cell.run), "diff": cell.diff} for label, cell in cells.items()}}
                 for loss, cells in table.rows],
        "notes": table.notes,
        "incomplete": [{"path": str(run.path), "problem": run.problem} for run in table.incomplete],
        "paper_sources": PAPERS if table.paper else {},
    }
    return json.dumps(payload, indent=2) + "\n"


def formatter(fmt: str):
    """The function that renders a table as `fmt` (csv, md, json)."""
    formatters = {"csv": to_csv, "md": to_markdown, "json": to_json}
    if fmt not in formatters:
        raise SpmlError(f"--format {fmt}: {unknown_name('format', fmt, formatters)}; use one of {', '.join(formatters)}")
    return formatters[fmt]


def print_table(table: Table, console: Console) -> None:
    # Text, never markup: column labels hold backbones in brackets ([clip:ViT-B-32]) that markup would eat
    header, rows = _grid(table, lambda text: Text(f"{text} *", style="bold green"))
    title = "Test mAP at the selected epoch (mean ± std over seeds)"
    rich_table = RichTable(title=title, title_justify="left", min_width=len(title))
    for i, name in enumerate(header):  # the losses' names whole on their line: the cells wrap first
        rich_table.add_column(Text(name), justify="left" if i == 0 else "right", style="dim" if name == "paper" else None,
                              no_wrap=i == 0)
    losses = [loss for loss, _ in table.rows] + [None]
    for i, row in enumerate(rows):
        cells = [cell if isinstance(cell, Text) else Text(cell) for cell in row]
        # the papers' break between the oracles and the single-positive losses
        rich_table.add_row(*cells, end_section=losses[i] in table.oracles and losses[i + 1] not in table.oracles)
    console.print(rich_table if rows else "no complete runs to tabulate")
    print_notes(table, console)


def print_notes(table: Table, console: Console) -> None:
    for note in footnotes(table):
        console.print(Text(note, style="dim"))  # Text: paths and names are not rich markup
