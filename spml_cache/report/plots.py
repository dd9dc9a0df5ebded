"""The figures of `spml-cache report --plots`: five per dataset x stage x cache column of the table.

1. `*-val_curves`: validation mAP per epoch of each loss's selected config (metrics.jsonl, mean over seeds),
   one panel per loss family after one of the best losses (report/val_curves.py);
2. `*-per_class_ap`: test AP per class of two losses side by side, and their sorted difference (Zhou et al.
   Fig. 4c);
3. `*-train_histograms`: predicted probabilities on the training set for unobserved true positives versus
   unobserved true negatives (Cole et al. Fig. 2, Zhou et al. Fig. 4a-b): a loss that recovers missing labels
   pushes the first towards 1;
4. `*-label_recovery`: training-set mAP against the full labels next to test mAP (Cole et al. Table 2);
5. `*-sweeps`: validation mAP against each swept hyperparameter;
and per dataset x stage x cache with `entry:P` runs, `*-observed_fraction` (report/observed_fraction.py).

Figures are drawn on `matplotlib.figure.Figure` objects (Agg canvas, no pyplot state), every one before any is
written, laid out at the width they are printed at (`--figure-width`: a paper's column or text width, report/
layout.py), then written as report/figure_files.py says (`--figure-format`, `--dpi`) through a temporary file, so
an interrupted run leaves no half-written figure. Every text is at least `figure_files.MIN_POINTS` high at the saved
size, and none is drawn over another or over a legend (tests/figure_support.py); the losses are named as their
papers write them (`losses.display_name`).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.text import Text

from spml_cache import losses
from spml_cache.metrics import mean_average_precision
from spml_cache.options.report import parse_compare
from spml_cache.report import observed_fraction, val_curves
from spml_cache.report.collect import Run, collect_runs, in_spec_order, oracle_losses, select_newest
from spml_cache.report.figure_files import (
    DEFAULT_WIDTH, MIN_POINTS, WIDTH_RANGE, WIDTHS, FigureFiles, names_as_text, report_figure,
)
from spml_cache.report.layout import (
    AXES_SHARE, GLYPH_EM, LABEL_POINTS, TICKS_AND_LABEL, TITLE_POINTS, legend_height, legend_under, line_height,
    paper_text, set_height, side_by_side, wrapped,
)
from spml_cache.runs import read_npz, scores_path
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.progress import progress_bar

BINS = np.linspace(0, 1, 26)  # of the training-score histograms
CLASS_PITCH = 0.13  # inches per class in the per-class figure: room for a class name at MIN_POINTS, turned upright
CLASS_MARGIN = 0.6  # inches of that figure beside its bars: the y label, its ticks, the margins
AXES_HEIGHT = 1.9  # inches of a panel's plot, above its ticks and x label
HISTOGRAM_WIDTH = 1.6  # inches: the narrowest histogram panel, its legend (two lines an entry) within it
SWEEP_WIDTH = 2.6  # inches: the narrowest sweep panel
KINDS = ("val_curves", "per_class_ap", "train_histograms", "label_recovery", "sweeps")  # of each column, in turn
# Why a figure a column cannot have is left out: said only of a figure asked for by name (`--compare` names the
# per-class one), once; the others are simply not written where their data is missing.
WHY_SKIPPED = {"per_class_ap": "needs both losses of --compare in one column, with per_class_ap in results.json"}


def require_matplotlib():
    """The Figure class, or a clear error: the table works without matplotlib, the figures do not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SpmlError("--plots needs matplotlib: python -m pip install matplotlib (or leave out --plots)") from None
    return report_figure()  # names drawn as written


def write_plots(run_dirs: list[Path], out_dir: Path, *, compare=None, console: Console | None = None,
                files: FigureFiles = FigureFiles()) -> list[Path]:
    """Every figure for the runs in `run_dirs` (run directories or folders of them) into `out_dir`."""
    require_matplotlib()
    return plot_runs(collect_runs(run_dirs), out_dir, compare=compare, console=console, files=files)


def plot_runs(runs: list[Run], out_dir: Path, *, compare=None, console: Console | None = None,
              files: FigureFiles = FigureFiles()) -> list[Path]:
    """Every figure of `runs`, drawn first, then written into `out_dir` as `files` says: a failure writes none. The
    folder is made first, so that one that cannot be is said before the figures take their time to draw (and is
    taken away again, empty, when drawing fails)."""
    made = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        drawn = draw_runs(runs, compare=compare, console=console, width=files.width)
    except BaseException:
        if made and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise
    figures = [(files.path(out_dir, stem), figure) for stem, figure in drawn]
    with progress_bar(f"writing the figures into {out_dir}", len(figures), "figures") as bar:
        for path, figure in figures:
            files.write(path, figure)
            bar.advance()
    return [path for path, _ in figures]


@names_as_text()
def draw_runs(runs: list[Run], *, compare=None, console: Console | None = None,
              width: float = WIDTHS[DEFAULT_WIDTH]) -> list[tuple[str, object]]:
    """[(file stem, figure)] of every figure of `runs`, each `width` inches wide: per column, those its data allows."""
    Figure = require_matplotlib()
    pair = parse_compare(compare) if isinstance(compare, str) else (tuple(compare) if compare else None)
    columns, chosen, _ = select_newest(runs)
    if not columns:
        raise SpmlError(f"no complete runs to plot among {len(runs)} run directories (none has results.json)")
    oracles = oracle_losses()
    per_column = []
    for column in columns:
        present = {loss: run for (label, loss), run in chosen.items()
                   if label == column.label and not run.test_unscored}  # test mAP n/a: never ranked, not drawn
        per_column.append((column, {name: present[name] for name in in_spec_order(present)}))
    if pair is not None:
        missing = [name for name in pair if not any(name in by_loss for _, by_loss in per_column)]
        if missing:
            available = sorted({name for _, by_loss in per_column for name in by_loss})
            raise SpmlError(f"--compare: no run has loss {', '.join(missing)}; available: {', '.join(available)}")

    figures, lacking = [], []
    with progress_bar("drawing the figures", len(per_column) * len(KINDS), "figures") as bar:
        for column, by_loss in per_column:
            stem = re.sub(r"[^A-Za-z0-9]+", "_", column.label).strip("_").lower()
            summaries = {loss: _train_summary(run, loss) for loss, run in by_loss.items()}
            draws = {
                "val_curves": lambda: val_curves.draw(Figure, column.label, by_loss, oracles, width),
                "per_class_ap": lambda: _per_class_ap(Figure, column.label, by_loss, _pair_for(by_loss, pair, oracles),
                                                      width),
                "train_histograms": lambda: _train_histograms(Figure, column.label, summaries, width),
                "label_recovery": lambda: _label_recovery(Figure, column.label, by_loss, summaries, width),
                "sweeps": lambda: _sweeps(Figure, column.label, by_loss, width),
            }
            drawn = {}
            for kind in KINDS:  # a figure of 28 panels takes seconds: the bar moves with each
                drawn[kind] = draws[kind]()
                bar.advance()
            figures += [(f"{stem}-{kind}", figure) for kind, figure in drawn.items() if figure is not None]
            lacking += [column.label] if drawn["per_class_ap"] is None else []
    if pair is not None and lacking and console is not None:
        console.print(Text(f"no per_class_ap figure of {' vs '.join(pair)} for {', '.join(lacking)}"
                           f" ({WHY_SKIPPED['per_class_ap']})", style="dim"))
    return figures + observed_fraction.figures(Figure, per_column, width)


def _pair_for(by_loss: dict[str, Run], pair, oracles: set[str]) -> tuple[str, str] | None:
    """The asked pair when this column has both, else its two best single-positive losses by test mAP."""
    if pair is not None:
        return pair if all(name in by_loss for name in pair) else None
    ranked = sorted(
        (name for name in by_loss if name not in oracles), key=lambda n: -by_loss[n].losses[n]["test_map"]
    )
    return (ranked[1], ranked[0]) if len(ranked) >= 2 else None


def _per_class_ap(Figure, title: str, by_loss: dict[str, Run], pair, width: float = WIDTHS[DEFAULT_WIDTH]):
    if pair is None:
        return None
    (first, second) = pair
    ap_first = np.asarray(by_loss[first].losses[first].get("per_class_ap") or [], dtype=float)
    ap_second = np.asarray(by_loss[second].losses[second].get("per_class_ap") or [], dtype=float)
    if ap_first.size == 0 or ap_first.shape != ap_second.shape:
        return None
    from matplotlib.patches import Patch

    classes = by_loss[first].config.get("classes") or [f"class {i}" for i in range(ap_first.size)]
    count, shown_first, shown_second = ap_first.size, losses.display_name(first), losses.display_name(second)
    needed = CLASS_MARGIN + CLASS_PITCH * count  # the width at which every class is named, turned upright
    named = needed <= width  # narrower, the names would overlap: the bars' profile is the message
    names_height = max(len(name) for name in classes) * MIN_POINTS * GLYPH_EM / 72 if named else 0.0
    figure = Figure(figsize=(width, 1.0), layout="constrained")
    headings = [wrapped(f"{title}: per-class test AP, {shown_first} vs {shown_second}", figure, LABEL_POINTS,
                        AXES_SHARE),
                wrapped(f"{shown_second} better on {float((ap_second > ap_first).mean() * 100):.0f}% of classes",
                        figure, LABEL_POINTS, AXES_SHARE)]
    set_height(figure, sum(AXES_HEIGHT + TICKS_AND_LABEL + names_height + line_height(
        LABEL_POINTS, heading.count("\n") + 1) for heading in headings) + 0.1)
    top, bottom = figure.subplots(2, 1)
    positions = np.arange(count)
    labels = [f"{shown_first} (mean AP {ap_first.mean():.2f})", f"{shown_second} (mean AP {ap_second.mean():.2f})"]
    across = sum(len(label) + 6 for label in labels) * MIN_POINTS * GLYPH_EM / 72 <= width - 1.0  # both on one row
    top.bar(positions - 0.2, ap_first, width=0.4, label=labels[0])
    top.bar(positions + 0.2, ap_second, width=0.4, label=labels[1])
    top.set(ylabel="test AP", title=headings[0])
    top.set_ylim(0, (1.25 if across else 1.45) * max(ap_first.max(), ap_second.max(), 1e-9))  # room for the legend
    top.legend(fontsize=MIN_POINTS, loc="upper center", ncol=2 if across else 1)
    order = np.argsort(ap_second - ap_first)[::-1]
    difference = (ap_second - ap_first)[order]
    bottom.bar(positions, difference, color=np.where(difference > 0, "tab:green", "tab:red"))
    bottom.legend(handles=[Patch(color="tab:green", label=f"{shown_second} better"),
                           Patch(color="tab:red", label=f"{shown_first} better")], fontsize=MIN_POINTS,
                  loc="upper right")
    if named:
        top.set_xticks(positions, classes, rotation=90)
        bottom.set_xticks(positions, [classes[i] for i in order], rotation=90)
        top.set_xlabel("class")
    else:
        top.set_xticks([])
        bottom.set_xticks([])
        top.set_xlabel(f"{count} classes (named from --figure-width {math.ceil(needed * 10) / 10:g})"
                       if needed <= WIDTH_RANGE[1] else f"{count} classes")
    bottom.axhline(0, color="black", linewidth=0.8)
    bottom.set(xlabel="classes, sorted by difference", ylabel=f"AP {shown_second} - {shown_first}", title=headings[1])
    paper_text(figure)
    return figure


def _train_summary(run: Run, loss: str) -> dict:
    """What figures 3 and 4 need from the selected head's training scores, reduced at once so that only one
    loss's `[N_train, C]` matrix is in memory at a time: per-bin densities and mean score of unobserved
    positives and negatives, and the training mAP against the full labels (results.json's, else computed)."""
    summary = {"train_map": run.losses[loss].get("train_map")}
    score_file, label_file = scores_path(run.path, run.key(loss)), run.path / "labels.npz"
    if not (score_file.exists() and label_file.exists()):
        return summary
    labels = read_npz(label_file, (run.observed_key, "train_observed", "train_labels"))
    observed = labels[run.observed_key if run.observed_key in labels else "train_observed"]
    train, full = read_npz(score_file, ("train",))["train"].astype(np.float32), labels["train_labels"]
    if train.shape != full.shape or full.shape != observed.shape:
        raise SpmlError(f"{score_file}: train scores {train.shape} do not match {label_file} {full.shape}; re-run the stage")
    unobserved = observed == 0
    for name, mask in (("positives", unobserved & (full == 1)), ("negatives", unobserved & (full == 0))):
        values = train[mask]
        density, _ = np.histogram(values, bins=BINS, density=values.size > 0)
        summary[name] = (density, float(values.mean()) if values.size else float("nan"))
    if summary["train_map"] is None:
        summary["train_map"] = mean_average_precision(train, full)
    return summary


def _train_histograms(Figure, title: str, summaries: dict[str, dict], width: float = WIDTHS[DEFAULT_WIDTH]):
    from matplotlib.ticker import NullLocator

    available = {loss: summary for loss, summary in summaries.items() if "positives" in summary}
    if not available:
        return None
    columns = side_by_side(width, len(available), HISTOGRAM_WIDTH)
    rows = math.ceil(len(available) / columns)
    narrow = width / columns < 2.2  # a narrow panel: its legend entries in two lines, its labels at MIN_POINTS
    separator = "\n" if narrow else " "
    figure = Figure(figsize=(width, 1.0), layout="constrained")
    heading = wrapped(f"{title}: predicted probability on the training set for the unobserved labels (true"
                      " positives vs true negatives)", figure, TITLE_POINTS)
    set_height(figure, line_height(TITLE_POINTS, heading.count("\n") + 1) + rows * (
        1.6 + TICKS_AND_LABEL + line_height(LABEL_POINTS)) + 0.1)
    densities = np.concatenate([s[k][0] for s in available.values() for k in ("positives", "negatives")])
    positive = densities[densities > 0]
    # one y range for every panel, so that heights compare, with room at the top for the legend; log: negatives
    # pile up near 0 and would hide the rest
    ylim = (positive.min() / 2, positive.max() * 300) if positive.size else (0.01, 3000)
    for i, (loss, summary) in enumerate(available.items()):
        axes = figure.add_subplot(rows, columns, i + 1)
        (negatives, mean_neg), (positives, mean_pos) = summary["negatives"], summary["positives"]
        for values, mean, colour, name in ((negatives, mean_neg, "tab:blue", "negatives"),
                                           (positives, mean_pos, "tab:orange", "positives")):
            axes.stairs(values, BINS, fill=True, alpha=0.55, color=colour,
                        label=f"true {name},{separator}mean {mean:.2f}")
        axes.set_yscale("log")
        # a tick per decade reads the heights; the minor ticks of 28 panels tripled tight_layout's time (1.4 s)
        axes.yaxis.set_minor_locator(NullLocator())
        axes.set(xlim=(0, 1), ylim=ylim, xlabel="predicted probability", ylabel="density (log)")
        axes.set_title(wrapped(losses.display_name(loss), figure, LABEL_POINTS, 1 / columns))
        axes.legend(fontsize=MIN_POINTS, loc="upper right", framealpha=0.85, handlelength=1.0, handletextpad=0.4,
                    borderpad=0.3, borderaxespad=0.3)
    paper_text(figure, MIN_POINTS if narrow else LABEL_POINTS)
    figure.suptitle(heading, fontsize=TITLE_POINTS)
    return figure


def _label_recovery(Figure, title: str, by_loss: dict[str, Run], summaries: dict[str, dict],
                    width: float = WIDTHS[DEFAULT_WIDTH]):
    values = {loss: float(s["train_map"]) for loss, s in summaries.items() if s["train_map"] is not None}
    if not values:
        return None
    names = list(values)
    positions = np.arange(len(names))
    figure = Figure(figsize=(width, 1.0), layout="constrained")
    heading = wrapped(f"{title}: label recovery (training-set mAP against the full labels)", figure, LABEL_POINTS,
                      AXES_SHARE)
    entries = ["train mAP vs full labels", "test mAP"]
    across = width >= 4.0  # the two entries side by side
    set_height(figure, 0.27 * len(names) + TICKS_AND_LABEL + line_height(LABEL_POINTS, heading.count(
        "\n") + 1) + legend_height(entries if not across else entries[:1]) + 0.45)
    axes = figure.add_subplot()
    train = [values[n] for n in names]
    test = [float(by_loss[n].losses[n]["test_map"]) for n in names]
    axes.barh(positions - 0.2, train, height=0.4, color="tab:purple", label=entries[0])
    axes.barh(positions + 0.2, test, height=0.4, color="tab:gray", label=entries[1])
    for y, value in zip(positions - 0.2, train):
        axes.text(value, y, f" {value:.1f}", va="center", fontsize=MIN_POINTS)
    axes.set_yticks(positions, [losses.display_name(name) for name in names])
    axes.set_ylim(len(names) - 0.4, -0.6)  # the first loss on top, each row's two bars whole
    axes.set(xlabel="mAP", ylabel="loss", xlim=(0, 1.15 * max(train + test)), title=heading)
    legend_under(axes, ncol=2 if across else 1)
    paper_text(figure)
    return figure


def sweep_curves(by_loss: dict[str, Run]) -> dict[tuple[str, str], tuple[list[float], list[float], float]]:
    """Per (loss, swept key): its values, the best val mAP at each (over lrs, batch sizes and the other swept
    values; mean over seeds), and the selected value."""
    curves = {}
    for loss, run in by_loss.items():
        result = run.losses[loss]
        chosen = (result.get("selected") or {}).get("swept") or {}
        by_config: dict[tuple, list[float]] = {}
        for config in result.get("configs", []):
            if config.get("hparams") and config.get("val_map") is not None:
                key = (config["lr"], config["batch_size"], json.dumps(config["hparams"], sort_keys=True))
                by_config.setdefault(key, []).append(config["val_map"])
        for key in chosen:
            best: dict[float, float] = {}
            for (_, _, hparams), maps in by_config.items():
                value = json.loads(hparams)[key]
                best[value] = max(best.get(value, -math.inf), float(np.mean(maps)))
            if len(best) > 1:
                values = sorted(best)
                curves[(loss, key)] = (values, [best[v] for v in values], chosen[key])
    return curves


def _sweeps(Figure, title: str, by_loss: dict[str, Run], width: float = WIDTHS[DEFAULT_WIDTH]):
    curves = sweep_curves(by_loss)
    if not curves:
        return None
    columns = side_by_side(width, len(curves), SWEEP_WIDTH)
    rows = math.ceil(len(curves) / columns)
    figure = Figure(figsize=(width, 1.0), layout="constrained")
    heading = wrapped(f"{title}: validation mAP against each swept hyperparameter (best over lr, batch size and the"
                      " other swept values)", figure, TITLE_POINTS)
    set_height(figure, line_height(TITLE_POINTS, heading.count("\n") + 1) + rows * (
        AXES_HEIGHT + TICKS_AND_LABEL + line_height(LABEL_POINTS, 2)) + 0.1)
    for i, ((loss, key), (values, maps, chosen)) in enumerate(curves.items()):
        axes = figure.add_subplot(rows, columns, i + 1)
        axes.plot(values, maps, marker="o", color="tab:blue", label="best val mAP at this value")
        axes.plot([chosen], [maps[values.index(chosen)]], marker="*", markersize=10, linestyle="none",
                  color="tab:red", label=f"selected: {key}={chosen:g}")
        axes.set(xlabel=key, ylabel="validation mAP")
        axes.set_title(wrapped(f"{losses.display_name(loss)}: {key}", figure, LABEL_POINTS, 1 / columns))
        if all(v > 0 for v in values) and max(values) / min(values) >= 20:
            axes.set_xscale("log")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=MIN_POINTS)
    paper_text(figure)
    figure.suptitle(heading, fontsize=TITLE_POINTS)
    return figure
