"""`spml-cache report --pivot backbone`: the loss x backbone table of one dataset's frozen features, and its figure.

Rows are the losses, columns the backbones with their feature kind (`vit_b_16`, `vit_b_16+last4`: what
`collect.run_backbone` names), each cell the linear probe's test mAP under the single-positive rule. The columns
of other stages and rules are left out, said in a note; runs of several datasets are refused in one line (the
pivot compares backbones on one dataset).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np

from spml_cache.observation import DEFAULT_RULE
from spml_cache.report.collect import DATASET_LABELS
from spml_cache.report.figure_files import DEFAULT_WIDTH, MIN_POINTS, WIDTHS, FigureFiles, names_as_text
from spml_cache.report.layout import (
    AXES_SHARE, GLYPH_EM, LABEL_POINTS, TICKS_AND_LABEL, legend_height, legend_under, line_height, paper_text,
    set_height, wrapped,
)
from spml_cache.report.measures import title
from spml_cache.report.tables import ZERO_SHOT, Table, row_name
from spml_cache.runtime.errors import SpmlError

def pivot_backbone(table: Table) -> Table:
    """`table`'s linear, single-positive columns of its one dataset, each labelled by its backbone (and cache id
    where one backbone has several caches: the label's own suffix)."""
    kept = [column for column in table.columns if column.stage == "linear" and column.rule == DEFAULT_RULE]
    datasets = sorted({column.dataset for column in kept})
    if len(datasets) > 1:
        raise SpmlError(f"--pivot backbone: the runs are of {', '.join(datasets)}: name one dataset's runs, e.g."
                        f" spml-cache report runs/{datasets[0]} --pivot backbone")
    if not kept:
        raise SpmlError("--pivot backbone: no complete linear run under the single-positive rule to tabulate")
    left_out = [column.label for column in table.columns if column not in kept]
    labels = {column.label: column.backbone + _cache_suffix(column.label) for column in kept}
    columns = [replace(column, label=labels[column.label]) for column in kept]
    rows = [(loss, {labels[label]: cell for label, cell in cells.items() if label in labels})
            for loss, cells in table.rows]
    rows = [(loss, cells) for loss, cells in rows if cells]
    notes = [f"{DATASET_LABELS.get(datasets[0], datasets[0])}: linear probe, test {title(table.metric)} per loss and"
             " backbone"]
    notes += [f"left out of the pivot (another stage or rule): {', '.join(left_out)}"] if left_out else []
    return replace(table, columns=columns, rows=rows, notes=notes + table.notes)


def _cache_suffix(label: str) -> str:
    found = re.search(r" \(cache [0-9a-f]+\)$", label)
    return found.group(0) if found else ""


@names_as_text()
def plot_backbones(Figure, table: Table, out_dir: Path, files: FigureFiles = FigureFiles()) -> Path:
    """`<dataset>-loss_by_backbone.<format>`: each loss's test mAP (mean, with its std over seeds) per backbone, one
    marker per backbone on the loss's row; the best loss of each backbone circled."""
    figure = draw_backbones(Figure, table, files.width)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = files.path(out_dir, f"{table.columns[0].dataset}-loss_by_backbone")
    files.write(path, figure)
    return path


def draw_backbones(Figure, table: Table, width: float = WIDTHS[DEFAULT_WIDTH]):
    """The figure of `plot_backbones`, `width` inches wide; its legend, under the x label, shows each backbone's
    marker alone."""
    from matplotlib.lines import Line2D

    dataset = table.columns[0].dataset
    losses = [loss for loss, _ in table.rows if loss != ZERO_SHOT]
    figure = Figure(figsize=(width, 1.0), layout="constrained")
    heading = wrapped(f"{DATASET_LABELS.get(dataset, dataset)}: linear probe per loss and backbone\n(circled: each"
                      " backbone's best single-positive loss)", figure, LABEL_POINTS, AXES_SHARE)
    labels = [column.label for column in table.columns]
    entry = (max((len(label) for label in labels), default=1) + 5) * MIN_POINTS * GLYPH_EM  # points
    per_row = max(1, min(len(labels), int(width * 72 * 0.9 / entry)))
    set_height(figure, 0.22 * len(losses) + 0.4 + TICKS_AND_LABEL + line_height(
        LABEL_POINTS, heading.count("\n") + 1) + legend_height(labels[::per_row]) + 0.2)
    axes = figure.subplots()
    positions = np.arange(len(losses))[::-1]  # the first loss on top
    offsets = np.linspace(-0.25, 0.25, len(table.columns)) if len(table.columns) > 1 else [0.0]
    cells_of = dict(table.rows)
    handles = []
    for offset, column in zip(offsets, table.columns):
        found = [(y + offset, cells_of[loss][column.label]) for y, loss in zip(positions, losses)
                 if column.label in cells_of[loss] and cells_of[loss][column.label].mean is not None]  # n/a: none
        if not found:
            continue
        ys, cells = zip(*found)
        line = axes.errorbar([cell.mean for cell in cells], ys, xerr=[cell.std or 0.0 for cell in cells], fmt="o",
                             markersize=5, capsize=2)
        colour = line[0].get_color()
        handles.append(Line2D([], [], marker="o", markersize=5, linestyle="none", color=colour, label=column.label))
        best = [(cell.mean, y) for y, cell in found if cell.best]
        if best:
            axes.scatter(*zip(*best), s=140, facecolors="none", edgecolors=colour, linewidths=1.5)
    axes.set_yticks(positions, [row_name(table, loss) for loss in losses])
    axes.set_ylim(-0.6, len(losses) - 0.4)
    axes.set_xlabel(f"test {title(table.metric)} (mean ± std over seeds)")
    axes.set_title(heading)
    axes.grid(axis="x", alpha=0.3)
    # below the axes, under the x label: inside, it would hide the markers of some loss
    legend_under(axes, handles=handles, ncol=per_row)
    paper_text(figure)
    return figure
