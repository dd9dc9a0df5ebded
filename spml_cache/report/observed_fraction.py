"""The figure of `spml-cache report --plots` over `entry:P` sweeps: test mAP against the fraction of labels
observed, one line per loss, one figure per dataset x stage x cache that has runs under two or more `entry:P`
rules (the partial-label papers' "known label proportion" curves). Written as `*-observed_fraction` (png, pdf or
svg: `--figure-format`).
"""

from __future__ import annotations

import re

from spml_cache.losses import display_name
from spml_cache.observation import parse_rule
from spml_cache.report.collect import Column, Run
from spml_cache.report.figure_files import DEFAULT_WIDTH, WIDTHS
from spml_cache.report.layout import (
    AXES_SHARE, LABEL_POINTS, TICKS_AND_LABEL, legend_height, legend_under, line_height, paper_text, set_height,
    wrapped,
)
from spml_cache.report.val_curves import repeats

SHOWN = 10  # losses drawn, the best at the largest fraction first


def sweep_points(per_column: list[tuple[Column, dict[str, Run]]]) -> dict[tuple, dict[str, list[tuple[float, float]]]]:
    """Per (dataset, stage, cache id), per loss: its (P, test mAP) points over the `entry:P` columns, by P."""
    sweeps: dict[tuple, dict[str, list[tuple[float, float]]]] = {}
    for column, by_loss in per_column:
        if not column.rule.startswith("entry:"):
            continue
        fraction = parse_rule(column.rule).param("p")
        curves = sweeps.setdefault((column.dataset, column.stage, column.cache_id), {})
        for loss, run in by_loss.items():
            curves.setdefault(loss, []).append((fraction, float(run.losses[loss]["test_map"])))
    return {where: {loss: sorted(points) for loss, points in curves.items()} for where, curves in sweeps.items()
            if len({p for points in curves.values() for p, _ in points}) >= 2}


def figures(Figure, per_column: list[tuple[Column, dict[str, Run]]],
            width: float = WIDTHS[DEFAULT_WIDTH]) -> list[tuple[str, object]]:
    """[(file stem, figure)] for every sweep of two or more fractions, each `width` inches wide."""
    drawn = []
    for (dataset, stage, cache_id), curves in sweep_points(per_column).items():
        title = next(c.label for c, _ in per_column if (c.dataset, c.stage, c.cache_id) == (dataset, stage, cache_id))
        title = re.sub(r" \(entry:[^)]*\)", "", title)
        drawn.append((f"{re.sub(r'[^A-Za-z0-9]+', '_', title).strip('_').lower()}-observed_fraction",
                      _figure(Figure, title, curves, width)))
    return drawn


def _figure(Figure, title: str, curves: dict[str, list[tuple[float, float]]], width: float = WIDTHS[DEFAULT_WIDTH]):
    """Test mAP against P, the best `SHOWN` losses at the largest fraction; the title says which were left out,
    and a loss whose line is another's exactly is dotted over it and says whose."""
    ranked = sorted(curves, key=lambda loss: -curves[loss][-1][1])
    shown = ranked[:SHOWN]
    same = repeats({loss: tuple(zip(*curves[loss])) for loss in shown})
    every = [p for points in curves.values() for p, _ in points]
    largest = max(every)
    which = {1: "the one loss", 2: "both losses"}.get(len(ranked), f"all {len(ranked)} losses")
    if len(ranked) > SHOWN:
        which = (f"the best {len(shown)} of {len(ranked)} losses at P = {largest:g} (left out:"
                 f" {', '.join(display_name(loss) for loss in ranked[SHOWN:])})")
    labels = {loss: display_name(loss) + (f" (same line as {display_name(same[loss])})" if loss in same else "")
              for loss in shown}
    across = 2 if width >= 5.0 else 1
    figure = Figure(figsize=(width, 1.0), layout="constrained")
    heading = wrapped(f"{title}: test mAP against the fraction of labels observed; {which}", figure, LABEL_POINTS,
                      AXES_SHARE)
    rows = [list(labels.values())[i::across] for i in range(across)]  # the legend's columns; its height the longest
    set_height(figure, 2.6 + TICKS_AND_LABEL + line_height(LABEL_POINTS, heading.count("\n") + 1)
                           + max(legend_height(column) for column in rows) + 0.2)
    axes = figure.add_subplot()
    for loss in shown:
        fractions, maps = zip(*curves[loss])
        axes.plot(fractions, maps, ":" if loss in same else "-", marker="o", label=labels[loss])
    if max(every) / min(every) >= 20:
        axes.set_xscale("log")
    axes.set(xlabel="fraction of training labels observed (entry:P)", ylabel="test mAP", title=heading)
    axes.grid(alpha=0.3)
    legend_under(axes, ncol=across)
    paper_text(figure)
    return figure
