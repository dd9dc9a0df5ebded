"""The figure of `spml-cache report --plots` over `entry:P` sweeps: test mAP against the fraction of labels
observed, one line per loss, one figure per dataset x stage x cache that has runs under two or more `entry:P`
rules (the partial-label papers' "known label proportion" curves). Written as `*-observed_fraction` (png, pdf or
svg: `--figure-format`).
"""

from __future__ import annotations

import re

from spml_cache.observation import parse_rule
from spml_cache.report.collect import Column, Run
from spml_cache.report.figure_files import MIN_POINTS
from spml_cache.report.layout import wrapped
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


def figures(Figure, per_column: list[tuple[Column, dict[str, Run]]]) -> list[tuple[str, object]]:
    """[(file stem, figure)] for every sweep of two or more fractions."""
    drawn = []
    for (dataset, stage, cache_id), curves in sweep_points(per_column).items():
        title = next(c.label for c, _ in per_column if (c.dataset, c.stage, c.cache_id) == (dataset, stage, cache_id))
        title = re.sub(r" \(entry:[^)]*\)", "", title)
        drawn.append((f"{re.sub(r'[^A-Za-z0-9]+', '_', title).strip('_').lower()}-observed_fraction",
                      _figure(Figure, title, curves)))
    return drawn


def _figure(Figure, title: str, curves: dict[str, list[tuple[float, float]]]):
    """Test mAP against P, the best `SHOWN` losses at the largest fraction; the title says which were left out,
    and a loss whose line is another's exactly is dotted over it and says whose."""
    ranked = sorted(curves, key=lambda loss: -curves[loss][-1][1])
    shown = ranked[:SHOWN]
    same = repeats({loss: tuple(zip(*curves[loss])) for loss in shown})
    figure = Figure(figsize=(7.5, 4.8))
    axes = figure.add_subplot()
    for loss in shown:
        fractions, maps = zip(*curves[loss])
        label = loss + (f" (same line as {same[loss]})" if loss in same else "")
        axes.plot(fractions, maps, ":" if loss in same else "-", marker="o", label=label)
    every = [p for points in curves.values() for p, _ in points]
    if max(every) / min(every) >= 20:
        axes.set_xscale("log")
    largest = max(every)
    which = {1: "the one loss", 2: "both losses"}.get(len(ranked), f"all {len(ranked)} losses")
    if len(ranked) > SHOWN:
        which = f"the best {len(shown)} of {len(ranked)} losses at P = {largest:g} (left out: {', '.join(ranked[SHOWN:])})"
    axes.set(xlabel="fraction of training labels observed (entry:P)", ylabel="test mAP")
    heading = f"{title}: test mAP against the fraction of labels observed; {which}"
    axes.set_title(wrapped(heading, figure, 10), fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=MIN_POINTS, ncol=2)
    figure.tight_layout()
    return figure
