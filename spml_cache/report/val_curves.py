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

from spml_cache.report.collect import Run, loss_family
from spml_cache.observation import DEFAULT_RULE
from spml_cache.runs import read_metrics

TOP = 4  # single-positive losses in the first panel
SINGLE_PANEL = 6  # this many curves or fewer: one panel
MAX_LINES = 10  # tab10's distinct colours


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
    panels = [(f"best {len(best)} single-positive losses" + (" and best oracle" if best_oracle else ""),
               best + best_oracle)]
    families: dict[str, list[str]] = {}
    for name in curves:  # spec order, so families come in the order of docs/losses.md
        families.setdefault(loss_family(name), []).append(name)
    for family, names in families.items():
        parts = math.ceil(len(names) / MAX_LINES)
        for part in range(parts):
            chunk = names[part * MAX_LINES:(part + 1) * MAX_LINES]
            suffix = f", part {part + 1}/{parts}" if parts > 1 else ""
            panels.append((f"{family.replace('_', ' ')} ({len(names)} loss{'es' if len(names) > 1 else ''}{suffix})",
                           chunk))
    return panels, best


def draw(Figure, title: str, by_loss: dict[str, Run], oracles: set[str]):
    """The figure, or None when metrics.jsonl has no line for any selected config."""
    from matplotlib import colormaps

    curves = read_curves(by_loss)
    if not curves:
        return None
    test_map = {name: float(by_loss[name].losses[name]["test_map"]) for name in curves}
    panels, best = panels_for(curves, test_map, oracles)
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(max(9.0, 5.4 * columns), 3.7 * rows + 0.9))
    palette = colormaps["tab10"]
    every_value = [v for _, values, _ in curves.values() for v in values]
    every_epoch = [e for epochs, _, _ in curves.values() for e in epochs]
    pad_y = max(0.5, 0.04 * (max(every_value) - min(every_value)))
    limits = {"ylim": (min(every_value) - pad_y, max(every_value) + pad_y),
              "xlim": (min(every_epoch) - 0.3, max(every_epoch) + 0.3)}
    for index, (panel_title, names) in enumerate(panels):
        axes = figure.add_subplot(rows, columns, index + 1)
        # the best losses keep their colour (tab10's first ones) in every panel; the others take the rest in turn
        free = iter([c for c in range(MAX_LINES) if c not in {best.index(n) for n in names if n in best}])
        for name in names:
            epochs, values, selected = curves[name]
            rank = f"#{best.index(name) + 1} " if name in best else ""
            decay = f", wd {selected['wd']:g}" if "wd" in selected else ""
            config = f" (lr {selected['lr']:g}{decay}, batch {selected.get('batch_size')})" if "lr" in selected else ""
            label = f"{rank}{name}: test {test_map[name]:.1f}{config}"
            colour = palette(best.index(name) if name in best else next(free))
            axes.plot(epochs, values, "--" if name in oracles else "-", color=colour, linewidth=2.4 if rank else 1.3,
                      marker="." if len(epochs) < 30 else None, label=label)
        axes.set(xlabel="epoch", ylabel="validation mAP", title=panel_title, **limits)
        axes.title.set_fontsize(10)
        axes.xaxis.get_major_locator().set_params(integer=True)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7, loc="best", framealpha=0.85)
    notes = [f"bold: best {len(best)} single-positive losses by test mAP (#rank)"] if best else []
    notes += ["dashed: oracle (full labels)"] if oracles & set(curves) else []
    heading = f"{title}: validation mAP per epoch (selected config, mean over seeds)"
    figure.suptitle("\n".join([heading, "; ".join(notes)]) if notes else heading, fontsize=11)
    figure.tight_layout()  # leaves room for the suptitle (matplotlib >= 3.3)
    return figure
