"""Figure 1 of `spml-cache report --plots`: validation mAP per epoch of each loss's selected config
(metrics.jsonl, mean over seeds).

Twenty-odd losses on one axes need more colours than the eye tells apart, so with more than `SINGLE_PANEL`
losses the figure has a first panel with the best `TOP` single-positive losses by test mAP (the table's ranking)
and the best oracle, then one panel per loss family (the module of spml_cache/losses/ that registers the loss),
each with at most `MAX_LINES` lines in distinct tab10 colours. The best losses are drawn bold in their family's
panel too, oracles dashed. Every panel has its labels and legend, and all share the axis ranges.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from spml_cache.losses import display_name
from spml_cache.observation import DEFAULT_RULE
from spml_cache.report.collect import Run, loss_family
from spml_cache.report.figure_files import DEFAULT_WIDTH, WIDTHS
from spml_cache.report.layout import (
    LABEL_POINTS, TICKS_AND_LABEL, TITLE_POINTS, counted, fitted, legend_height, legend_under, line_height, paper_text,
    set_height, side_by_side, wrapped,
)
from spml_cache.runs import read_metrics

TOP = 4  # single-positive losses in the first panel
SINGLE_PANEL = 6  # this many curves or fewer: one panel
MAX_LINES = 10  # tab10's distinct colours
PANEL_WIDTH = 3.2  # inches: the narrowest panel, whose legend entries fit its width in a line or two at 7 pt
AXES_HEIGHT = 1.9  # inches of a panel's plot, above its ticks, x label and legend


def read_curves(by_loss: dict[str, Run]) -> dict[str, tuple[list[int], list[float], dict]]:
    """Per loss, (epochs, validation mAP per epoch averaged over seeds, selected config), from metrics.jsonl."""
    metrics_of: dict[Path, list[dict]] = {}
    curves = {}
    for loss, run in by_loss.items():
        selected = run.losses[loss].get("selected") or {}
        lines = metrics_of.setdefault(run.path, read_metrics(run.path))
        by_epoch: dict[int, list[float]] = {}
        for line in lines:
            same = (line.get("loss") == loss and line.get("rule", DEFAULT_RULE) == run.rule
                    and all(line.get(k) == selected.get(k) for k in ("lr", "batch_size", "wd")))  # wd: --wd
            if line.get("val_map") is None:  # the epoch a head diverged
                continue
            if same and line.get("hparams", {}) == selected.get("swept", {}):  # the selected values of a sweep
                by_epoch.setdefault(int(line["epoch"]), []).append(float(line["val_map"]))
        if by_epoch:
            epochs = sorted(by_epoch)
            curves[loss] = (epochs, [float(np.mean(by_epoch[e])) for e in epochs], selected)
    return curves


def panels_for(curves: dict, test_map: dict[str, float], oracles: set[str]) -> tuple[list[tuple[str, list]], list]:
    """[(panel title, loss names)] and the best single-positive losses, best first."""
    best = sorted((n for n in curves if n not in oracles), key=lambda n: -test_map[n])[:TOP]
    if len(curves) <= SINGLE_PANEL:
        return [("all losses", list(curves))], best
    best_oracle = sorted((n for n in curves if n in oracles), key=lambda n: -test_map[n])[:1]
    panels = [(_best(len(best)) + (" and the best oracle" if best_oracle else ""), best + best_oracle)]
    families: dict[str, list[str]] = {}
    for name in curves:  # spec order, so families come in the order of docs/losses.md
        families.setdefault(loss_family(name), []).append(name)
    for family, names in families.items():
        parts = math.ceil(len(names) / MAX_LINES)
        for part in range(parts):
            chunk = names[part * MAX_LINES:(part + 1) * MAX_LINES]
            suffix = f", part {part + 1}/{parts}" if parts > 1 else ""
            panels.append((f"{family.replace('_', ' ')} ({counted(len(names), 'loss')}{suffix})", chunk))
    return panels, best


def _best(count: int) -> str:
    """`the best single-positive loss`, `the best 4 single-positive losses`."""
    return "the best single-positive loss" if count == 1 else f"the best {count} single-positive losses"


def repeats(curves: dict[str, tuple]) -> dict[str, str]:
    """Per loss whose curve (x values, y values) is an earlier loss's exactly, that earlier loss: losses equal by
    design (`opml` at its defaults is `zlpr`) draw one line over the other, so the figure must say so."""
    first: dict[tuple, str] = {}
    same = {}
    for name, (xs, ys, *_) in curves.items():
        key = (tuple(xs), tuple(round(float(y), 9) for y in ys))
        if key in first:
            same[name] = first[key]
        else:
            first[key] = name
    return same


def draw(Figure, title: str, by_loss: dict[str, Run], oracles: set[str], width: float = WIDTHS[DEFAULT_WIDTH]):
    """The figure, `width` inches wide (its panels as many side by side as hold `PANEL_WIDTH`), or None when
    metrics.jsonl has no line for any selected config."""
    from matplotlib.ticker import MaxNLocator

    curves = read_curves(by_loss)
    if not curves:
        return None
    test_map = {name: float(by_loss[name].losses[name]["test_map"]) for name in curves}
    panels, best = panels_for(curves, test_map, oracles)
    columns = side_by_side(width, len(panels), PANEL_WIDTH)
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(width, 1.0), layout="constrained")
    same = repeats(curves)
    labels = {name: fitted(_label(name, curves, test_map, best, same), width / columns - 0.1) for name in curves}
    heading = wrapped(_heading(title, best, oracles, curves, same), figure, TITLE_POINTS)
    titles = [wrapped(panel_title, figure, LABEL_POINTS, 1 / columns) for panel_title, _ in panels]
    row_heights = _row_heights(panels, titles, labels, columns)
    set_height(figure, line_height(TITLE_POINTS, heading.count("\n") + 1) + sum(row_heights) + 0.1)
    every_value = [v for _, values, _ in curves.values() for v in values]
    every_epoch = [e for epochs, _, _ in curves.values() for e in epochs]
    pad_y = max(0.5, 0.04 * (max(every_value) - min(every_value)))
    # half an epoch either side: one epoch is a point at a whole number, not a dot on a 0.7-1.3 axis
    limits = {"ylim": (min(every_value) - pad_y, max(every_value) + pad_y),
              "xlim": (min(every_epoch) - 0.5, max(every_epoch) + 0.5)}
    grid = figure.add_gridspec(rows, columns, height_ratios=row_heights)
    for index, ((_, names), panel_title) in enumerate(zip(panels, titles)):
        axes = figure.add_subplot(grid[index // columns, index % columns])
        _panel(axes, names, curves, labels, best, oracles, same)
        axes.set(xlabel="epoch", ylabel="validation mAP", **limits)
        axes.set_title(panel_title)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        axes.grid(alpha=0.3)
        legend_under(axes)
    paper_text(figure)
    figure.suptitle(heading, fontsize=TITLE_POINTS)
    return figure


def _row_heights(panels, titles: list[str], labels: dict[str, str], columns: int) -> list[float]:
    """Inches per row of panels: the axes, its ticks and x label, the tallest title and legend of the row."""
    heights = []
    for first in range(0, len(panels), columns):
        needs = [line_height(LABEL_POINTS, title.count("\n") + 1) + legend_height([labels[name] for name in names])
                 for title, (_, names) in zip(titles[first:first + columns], panels[first:first + columns])]
        heights.append(AXES_HEIGHT + TICKS_AND_LABEL + max(needs) + 0.15)
    return heights


def _heading(title: str, best: list[str], oracles: set[str], curves: dict, same: dict) -> str:
    every_epoch = {e for epochs, _, _ in curves.values() for e in epochs}
    notes = [f"bold: {_best(len(best))} by test mAP" + (" (#rank)" if len(best) > 1 else "")] if best else []
    notes += ["dashed: oracle (full labels)"] if oracles & set(curves) else []
    notes += ["dotted: the same curve as an earlier loss, drawn over it"] if same else []
    notes += ["one epoch: one point per loss"] if len(every_epoch) == 1 else []
    lines = [f"{title}: validation mAP per epoch (selected config, mean over seeds)"]
    return "\n".join(lines + (["; ".join(notes)] if notes else []))


def _label(name: str, curves: dict, test_map: dict[str, float], best: list[str], same: dict[str, str]) -> str:
    """A curve's legend entry: its rank among the best, the loss as its papers name it, its test mAP and config,
    and the loss whose curve it repeats."""
    _, _, selected = curves[name]
    rank = f"#{best.index(name) + 1} " if name in best else ""
    decay = f", wd {selected['wd']:g}" if selected.get("wd") else ""  # 0, the papers' grid, goes unsaid
    config = f" (lr {selected['lr']:g}{decay}, batch {selected.get('batch_size')})" if "lr" in selected else ""
    label = f"{rank}{display_name(name)}: test {test_map[name]:.1f}{config}"
    return label + (f", same curve as {display_name(same[name])}" if name in same else "")


def _panel(axes, names: list[str], curves: dict, labels: dict[str, str], best: list[str], oracles: set[str],
           same: dict[str, str]) -> None:
    """One panel's lines: the best losses keep their colour (tab10's first ones) in every panel, the others take
    the rest in turn; a loss that repeats another's curve is dotted and says whose."""
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    free = iter([c for c in range(MAX_LINES) if c not in {best.index(n) for n in names if n in best}])
    for name in names:
        epochs, values, _ = curves[name]
        style = ":" if name in same else "--" if name in oracles else "-"
        colour = palette(best.index(name) if name in best else next(free))
        marker = {"marker": "o", "markersize": 6} if len(epochs) == 1 else {"marker": "."} if len(epochs) < 30 else {}
        axes.plot(epochs, values, style, color=colour, linewidth=2.0 if name in best else 1.0, label=labels[name],
                  **marker)
