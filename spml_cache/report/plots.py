"""The figures of `spml-cache report --plots`: four PNGs per dataset x stage x cache column of the table.

1. `*-val_curves.png`: validation mAP per epoch of each loss's selected config (metrics.jsonl, mean over seeds);
2. `*-per_class_ap.png`: test AP per class of two losses side by side, and their sorted difference (Zhou et al.
   Fig. 4c);
3. `*-train_histograms.png`: predicted probabilities on the training set for unobserved true positives versus
   unobserved true negatives (Cole et al. Fig. 2, Zhou et al. Fig. 4a-b): a loss that recovers missing labels
   pushes the first towards 1;
4. `*-label_recovery.png`: training-set mAP against the full labels next to test mAP (Cole et al. Table 2).

Figures are drawn on `matplotlib.figure.Figure` objects (Agg canvas, no pyplot state) and written through a
temporary file, so an interrupted run leaves no half-written PNG.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.text import Text

from spml_cache.errors import SpmlError
from spml_cache.metrics import mean_average_precision
from spml_cache.report.collect import Run, collect_runs, in_spec_order, oracle_losses, select_newest
from spml_cache.runs import read_metrics, replace_atomically

BINS = np.linspace(0, 1, 26)  # of the training-score histograms
WHY_SKIPPED = {
    "val_curves": "no metrics.jsonl lines for the selected configs",
    "per_class_ap": "needs two losses with per_class_ap in results.json",
    "train_histograms": "no scores/<loss>.npz with labels.npz in the runs",
    "label_recovery": "no train_map in results.json and no training scores",
}


def require_matplotlib():
    """The Figure class, or a clear error: the table works without matplotlib, the figures do not."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise SpmlError("--plots needs matplotlib: python -m pip install matplotlib (or leave out --plots)") from None
    return Figure


def parse_compare(compare: str | None) -> tuple[str, str] | None:
    """`--compare a,b` as a pair of two different loss names (None when not given)."""
    names = [name.strip() for name in (compare or "").split(",") if name.strip()]
    if compare is not None and (len(names) != 2 or names[0] == names[1]):
        raise SpmlError(f"--compare {compare}: give two different loss names separated by a comma, e.g. an,role")
    return (names[0], names[1]) if names else None


def write_plots(run_dirs: list[Path], out_dir: Path, *, compare=None, console: Console | None = None) -> list[Path]:
    """Every figure for the runs in `run_dirs` (run directories or folders of them) into `out_dir`."""
    require_matplotlib()
    return plot_runs(collect_runs(run_dirs), out_dir, compare=compare, console=console)


def plot_runs(runs: list[Run], out_dir: Path, *, compare=None, console: Console | None = None) -> list[Path]:
    Figure = require_matplotlib()
    pair = parse_compare(compare) if isinstance(compare, str) else (tuple(compare) if compare else None)
    columns, chosen, _ = select_newest(runs)
    if not columns:
        raise SpmlError(f"no complete runs to plot among {len(runs)} run directories (none has results.json)")
    oracles = oracle_losses()
    per_column = []
    for column in columns:
        present = {loss: run for (label, loss), run in chosen.items() if label == column.label}
        per_column.append((column, {name: present[name] for name in in_spec_order(present)}))
    if pair is not None:
        missing = [name for name in pair if not any(name in by_loss for _, by_loss in per_column)]
        if missing:
            available = sorted({name for _, by_loss in per_column for name in by_loss})
            raise SpmlError(f"--compare: no run has loss {', '.join(missing)}; available: {', '.join(available)}")

    figures = []  # drawn first, written after, so a failure writes nothing
    for column, by_loss in per_column:
        stem = re.sub(r"[^A-Za-z0-9]+", "_", column.label).strip("_").lower()
        summaries = {loss: _train_summary(run, loss) for loss, run in by_loss.items()}
        drawn = {
            "val_curves": _val_curves(Figure, column.label, by_loss),
            "per_class_ap": _per_class_ap(Figure, column.label, by_loss, _pair_for(by_loss, pair, oracles)),
            "train_histograms": _train_histograms(Figure, column.label, summaries),
            "label_recovery": _label_recovery(Figure, column.label, by_loss, summaries),
        }
        for kind, figure in drawn.items():
            if figure is None:
                if console is not None:
                    console.print(Text(f"{column.label}: no {kind} figure ({WHY_SKIPPED[kind]})", style="dim"))
                continue
            figures.append((out_dir / f"{stem}-{kind}.png", figure))
    out_dir.mkdir(parents=True, exist_ok=True)
    for path, figure in figures:
        replace_atomically(path, lambda partial: figure.savefig(partial, format="png", dpi=100))
    return [path for path, _ in figures]


def _pair_for(by_loss: dict[str, Run], pair, oracles: set[str]) -> tuple[str, str] | None:
    """The asked pair when this column has both, else its two best single-positive losses by test mAP."""
    if pair is not None:
        return pair if all(name in by_loss for name in pair) else None
    ranked = sorted(
        (name for name in by_loss if name not in oracles), key=lambda n: -by_loss[n].losses[n]["test_map"]
    )
    return (ranked[1], ranked[0]) if len(ranked) >= 2 else None


def _colours(count: int):
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    return [cmap(i % 20) for i in range(count)]


def _val_curves(Figure, title: str, by_loss: dict[str, Run]):
    metrics_of: dict[Path, list[dict]] = {}
    curves = {}
    for loss, run in by_loss.items():
        selected = run.losses[loss].get("selected", {})
        lines = metrics_of.setdefault(run.path, read_metrics(run.path))
        by_epoch: dict[int, list[float]] = {}
        for line in lines:
            same = line.get("loss") == loss and all(line.get(k) == selected.get(k) for k in ("lr", "batch_size"))
            if line.get("val_map") is None:  # the epoch a head diverged
                continue
            if same and ("hparams" not in line or line["hparams"] == selected.get("hparams")):
                by_epoch.setdefault(int(line["epoch"]), []).append(float(line["val_map"]))
        if by_epoch:
            epochs = sorted(by_epoch)
            curves[loss] = (epochs, [float(np.mean(by_epoch[e])) for e in epochs], selected)
    if not curves:
        return None
    figure = Figure(figsize=(10, 5.5))
    axes = figure.add_subplot()
    for index, (loss, (epochs, values, selected)) in enumerate(curves.items()):
        style = "-" if index < 20 else "--"  # tab20 repeats its colours after 20 losses
        colour = _colours(len(curves))[index]
        label = f"{loss} (lr {selected.get('lr')}, batch {selected.get('batch_size')})"
        axes.plot(epochs, values, style, color=colour, marker="." if len(epochs) < 30 else None, label=label)
    axes.set(xlabel="epoch", ylabel="validation mAP", title=f"{title}: validation mAP per epoch (selected config, mean over seeds)")
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.grid(alpha=0.3)
    axes.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7)
    figure.tight_layout()
    return figure


def _per_class_ap(Figure, title: str, by_loss: dict[str, Run], pair):
    if pair is None:
        return None
    (first, second) = pair
    ap_first = np.asarray(by_loss[first].losses[first].get("per_class_ap") or [], dtype=float)
    ap_second = np.asarray(by_loss[second].losses[second].get("per_class_ap") or [], dtype=float)
    if ap_first.size == 0 or ap_first.shape != ap_second.shape:
        return None
    classes = by_loss[first].config.get("classes") or [f"class {i}" for i in range(ap_first.size)]
    count = ap_first.size
    figure = Figure(figsize=(max(8, min(0.35 * count, 24)), 8))
    top, bottom = figure.subplots(2, 1)
    positions = np.arange(count)
    top.bar(positions - 0.2, ap_first, width=0.4, label=f"{first} (mean AP {ap_first.mean():.2f})")
    top.bar(positions + 0.2, ap_second, width=0.4, label=f"{second} (mean AP {ap_second.mean():.2f})")
    top.set(ylabel="test AP", title=f"{title}: per-class test AP, {first} vs {second}")
    top.legend(fontsize=8)
    order = np.argsort(ap_second - ap_first)[::-1]
    difference = (ap_second - ap_first)[order]
    better = float((difference > 0).mean() * 100)
    bottom.bar(positions, difference, color=np.where(difference > 0, "tab:green", "tab:red"))
    if count <= 60:  # beyond that the names are unreadable; the shape of the curve is the message
        top.set_xticks(positions, classes, rotation=90, fontsize=7)
        bottom.set_xticks(positions, [classes[i] for i in order], rotation=90, fontsize=7)
    else:
        top.set_xticks([])
        bottom.set_xticks([])
    bottom.axhline(0, color="black", linewidth=0.8)
    bottom.set(xlabel="classes, sorted by difference", ylabel=f"AP {second} - {first}",
               title=f"{second} better on {better:.0f}% of classes")
    figure.tight_layout()
    return figure


def _train_summary(run: Run, loss: str) -> dict:
    """What figures 3 and 4 need from the selected head's training scores, reduced at once so that only one
    loss's `[N_train, C]` matrix is in memory at a time: per-bin densities and mean score of unobserved
    positives and negatives, and the training mAP against the full labels (results.json's, else computed)."""
    summary = {"train_map": run.losses[loss].get("train_map")}
    score_file, label_file = run.path / "scores" / f"{loss}.npz", run.path / "labels.npz"
    if not (score_file.exists() and label_file.exists()):
        return summary
    with np.load(score_file) as scores, np.load(label_file) as labels:
        train, full, observed = scores["train"].astype(np.float32), labels["train_labels"], labels["train_observed"]
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


def _train_histograms(Figure, title: str, summaries: dict[str, dict]):
    available = {loss: summary for loss, summary in summaries.items() if "positives" in summary}
    if not available:
        return None
    columns = min(4, len(available))
    rows = math.ceil(len(available) / columns)
    figure = Figure(figsize=(max(7.0, 3.2 * columns), 2.6 * rows + 0.8))
    for i, (loss, summary) in enumerate(available.items()):
        axes = figure.add_subplot(rows, columns, i + 1)
        (negatives, mean_neg), (positives, mean_pos) = summary["negatives"], summary["positives"]
        axes.stairs(negatives, BINS, fill=True, alpha=0.55, color="tab:blue", label="unobserved negatives")
        axes.stairs(positives, BINS, fill=True, alpha=0.55, color="tab:orange", label="unobserved positives")
        axes.set_title(f"{loss}: mean p {mean_pos:.2f} (pos) vs {mean_neg:.2f} (neg)", fontsize=9)
        axes.set_yscale("log")  # negatives pile up near 0; a linear scale would hide the positives
        axes.set_xlim(0, 1)
        if i == 0:
            axes.legend(fontsize=7)
    figure.suptitle(f"{title}: predicted probability on the training set, unobserved labels (density, log scale)")
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.45 / figure.get_figheight()))  # room for the suptitle
    return figure


def _label_recovery(Figure, title: str, by_loss: dict[str, Run], summaries: dict[str, dict]):
    values = {loss: float(s["train_map"]) for loss, s in summaries.items() if s["train_map"] is not None}
    if not values:
        return None
    names = list(values)
    positions = np.arange(len(names))
    figure = Figure(figsize=(8, max(3.5, 1.2 + 0.38 * len(names))))
    axes = figure.add_subplot()
    train = [values[n] for n in names]
    test = [float(by_loss[n].losses[n]["test_map"]) for n in names]
    axes.barh(positions - 0.2, train, height=0.4, color="tab:purple", label="train mAP vs full labels")
    axes.barh(positions + 0.2, test, height=0.4, color="tab:gray", label="test mAP")
    for y, value in zip(positions - 0.2, train):
        axes.text(value, y, f" {value:.1f}", va="center", fontsize=7)
    axes.set_yticks(positions, names)
    axes.invert_yaxis()
    axes.set(xlabel="mAP", xlim=(0, 1.1 * max(train + test)),
             title=f"{title}: label recovery (training-set mAP against the full labels)")
    # the legend goes in a strip of fixed height under the axes, whatever the number of losses
    strip = 0.35 / figure.get_figheight()
    legend = axes.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 0), bbox_transform=figure.transFigure,
                         ncol=2)
    legend.set_in_layout(False)
    figure.tight_layout(rect=(0, strip, 1, 1))
    return figure
