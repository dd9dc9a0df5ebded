"""Model selection of stage two (spec/protocol.md, "Training and selection") and its tables.

Per head: the first epoch with the highest val mAP (a later epoch replaces it only when strictly greater).
Per loss: the (lr, batch size) config with the highest val mAP, averaged over seeds when there are several
(strictly greater replaces, in grid order). Reported: the test mAP of each seed's head at its best epoch,
as mean ± std over seeds (population std, 0 for one seed).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.live import Live
from rich.table import Table

from spml_cache.protocol import mean_average_precision
from spml_cache.runs import write_npz


@dataclass
class HeadRecord:
    """One head's history and its best epoch (spec/protocol.md: the first epoch with the highest val mAP)."""

    loss: str
    lr: float
    batch_size: int
    seed: int
    train_loss: list = field(default_factory=list)  # per finished epoch
    val_map: list = field(default_factory=list)
    test_map: list = field(default_factory=list)
    diverged_epoch: int | None = None
    best_epoch: int | None = None
    best_val_map: float = -math.inf
    best_test_ap: np.ndarray | None = None  # per-class test AP (0..1) at the best epoch
    best_state: dict | None = None  # {"head": nn.Linear layout, "loss_state": num_heads=1 state} at the best epoch

    def add_epoch(self, epoch: int, train_loss: float, val_map: float, test_map: float, test_ap: np.ndarray) -> bool:
        """Record a finished epoch; True when it becomes the best epoch. Strictly greater replaces: on ties the
        earlier epoch stays selected, and NaN never does."""
        self.train_loss.append(train_loss)
        self.val_map.append(val_map)
        self.test_map.append(test_map)
        if not val_map > self.best_val_map:
            return False
        self.best_val_map, self.best_epoch, self.best_test_ap = val_map, epoch, np.array(test_ap, copy=True)
        return True


def best_so_far(records: list[HeadRecord]) -> dict | None:
    """The head with the best val mAP so far among `records` (for live display): a small picklable summary."""
    best = max(records, key=lambda r: r.best_val_map)
    if best.best_epoch is None:
        return None
    return {"val_map": best.best_val_map, "test_map": best.test_map[best.best_epoch - 1], "lr": best.lr,
            "batch_size": best.batch_size, "epoch": best.best_epoch}


@torch.no_grad()
def head_scores(state: dict, features: torch.Tensor) -> torch.Tensor:
    """Sigmoid scores `[N, C]` of one head in `nn.Linear` layout."""
    weight = state["weight"].to(features.device)
    return torch.sigmoid(torch.addmm(state["bias"].to(features.device), features, weight.t()))


@dataclass(frozen=True)
class Selection:
    lr: float
    batch_size: int
    records: list[HeadRecord]  # the selected config's head of every seed, in seed order
    mean_val_map: float

    @property
    def representative(self) -> HeadRecord:
        """The seed whose head goes to best.pt and scores/: the best val mAP (first seed on ties)."""
        return max(self.records, key=lambda record: (record.best_val_map, -record.seed))


def select_config(records: list[HeadRecord]) -> Selection | None:
    """The config with the highest mean (over seeds) best-epoch val mAP; None when every head diverged at once."""
    configs: dict[tuple[float, int], list[HeadRecord]] = {}
    for record in records:  # grid order: lr, then batch size, as given on the command line
        configs.setdefault((record.lr, record.batch_size), []).append(record)
    chosen, best = None, -math.inf
    for (lr, batch_size), heads in configs.items():
        mean_val = float(np.mean([head.best_val_map for head in heads]))
        if mean_val > best:
            chosen, best = Selection(lr, batch_size, sorted(heads, key=lambda h: h.seed), mean_val), mean_val
    return chosen


def loss_results(records: list[HeadRecord], selection: Selection | None, hparams: dict, train_maps: list[float],
                 seconds: float) -> dict:
    """The `results.json` entry of one loss (docs/internals.md, "run directories")."""
    configs = [
        {
            "lr": r.lr, "batch_size": r.batch_size, "seed": r.seed, "best_epoch": r.best_epoch,
            "val_map": r.best_val_map if r.best_epoch else None,
            "test_map": r.test_map[r.best_epoch - 1] if r.best_epoch else None,
            "diverged_epoch": r.diverged_epoch,
        }
        for r in records
    ]
    if selection is None:
        return {"selected": None, "error": "no config has a scored epoch in every seed: heads diverged in their first"
                " epoch", "configs": configs, "seconds": seconds}
    chosen = selection.records
    val = [r.best_val_map for r in chosen]
    test = [r.test_map[r.best_epoch - 1] for r in chosen]
    return {
        "selected": {"lr": selection.lr, "batch_size": selection.batch_size, "hparams": hparams},
        "best_epoch": [r.best_epoch for r in chosen],
        "val_map": float(np.mean(val)),
        "val_map_std": float(np.std(val)),
        "test_map": float(np.mean(test)),
        "test_map_std": float(np.std(test)),
        "train_map": float(np.mean(train_maps)),
        "per_class_ap": (100 * np.mean([r.best_test_ap for r in chosen], axis=0)).tolist(),
        "per_seed": [
            {"seed": r.seed, "best_epoch": r.best_epoch, "val_map": v, "test_map": t, "train_map": m}
            for r, v, t, m in zip(chosen, val, test, train_maps)
        ],
        "configs": configs,
        "seconds": seconds,
    }


def finish_loss(run_dir: Path, name: str, records: list[HeadRecord], hparams: dict, data, seconds: float):
    """Select one loss's config, write `scores/<name>.npz`; its `results.json` entry and `best.pt` entry.

    `data` is the run's `LinearData`. The selected head (the best seed of the selected config) goes to best.pt
    with its `num_heads=1` loss state; train mAP is measured against the full training labels.
    """
    selection = select_config(records)
    if selection is None:
        return loss_results(records, None, hparams, [], seconds), None
    train_maps = [
        mean_average_precision(head_scores(r.best_state["head"], data.train_features), data.train_labels)
        for r in selection.records
    ]
    best = selection.representative
    train = head_scores(best.best_state["head"], data.train_features)
    evaluated = head_scores(best.best_state["head"], data.eval_features)
    scores = {"train": train, "val": evaluated[: data.num_val], "test": evaluated[data.num_val :]}
    write_npz(Path(run_dir) / "scores" / f"{name}.npz", **{k: v.cpu().numpy().astype(np.float16) for k, v in scores.items()})
    checkpoint = {
        "head": best.best_state["head"], "loss_state": best.best_state["loss_state"], "lr": best.lr,
        "batch_size": best.batch_size, "seed": best.seed, "epoch": best.best_epoch, "hparams": hparams,
    }
    return loss_results(records, selection, hparams, train_maps, seconds), checkpoint


def _mean_std(result: dict, key: str) -> str:
    if result.get(key) is None:
        return "-"
    std = result.get(f"{key}_std")
    seeds = len(result.get("per_seed") or [])
    return f"{result[key]:.2f}" + (f" ± {std:.2f}" if seeds > 1 and std is not None else "")


def summary_table(results: dict, title: str = "linear heads: best config per loss") -> Table:
    """One row per loss: val and test mAP of the selected config, the config, its best epoch, time."""
    table = Table(title=title)
    for column in ("loss", "val mAP", "test mAP", "lr", "batch", "best epoch", "time"):
        table.add_column(column, justify="left" if column == "loss" else "right")
    for name, result in results["losses"].items():
        selected = result.get("selected")
        if selected is None:
            table.add_row(name, "-", "-", "-", "-", "diverged", f"{result['seconds']:.1f} s")
            continue
        table.add_row(
            name, _mean_std(result, "val_map"), _mean_std(result, "test_map"), f"{selected['lr']:g}",
            str(selected["batch_size"]), ",".join(str(e) for e in result["best_epoch"]), f"{result['seconds']:.1f} s",
        )
    return table


class LiveTable:
    """The best val/test mAP per loss while training: a live rich table on a terminal, plain lines elsewhere."""

    def __init__(self, losses: list[str], num_seeds: int, epochs: int, console: Console, every_s: float = 10.0) -> None:
        self.console, self.num_seeds, self.epochs, self.every_s = console, num_seeds, epochs, every_s
        self.rows = {name: ["waiting", "", "", ""] for name in losses}
        self.live = Live(self._table(), console=console, refresh_per_second=4) if console.is_terminal else None
        self.last_line = time.perf_counter()

    def __enter__(self) -> "LiveTable":
        return self  # the live display starts with the first update: worker processes are forked before it

    def __exit__(self, *exc) -> None:
        if self.live and self.live.is_started:
            self.live.stop()

    def _table(self) -> Table:
        table = Table(title="training linear heads")
        for column in ("loss", "progress", "best val mAP", "its test mAP", "config"):
            table.add_column(column, justify="left" if column in ("loss", "progress", "config") else "right")
        for name, row in self.rows.items():
            table.add_row(name, *row)
        return table

    def epoch(self, loss: str, seed_index: int, epoch: int, best: dict | None) -> None:
        """After each epoch of one (loss, seed): `best_so_far` of that seed's heads."""
        progress = f"seed {seed_index + 1}/{self.num_seeds}, epoch {epoch}/{self.epochs}"
        if best is None:
            self.rows[loss] = [progress, "-", "-", ""]
        else:
            config = f"lr {best['lr']:g}, batch {best['batch_size']}, epoch {best['epoch']}"
            self.rows[loss] = [progress, f"{best['val_map']:.2f}", f"{best['test_map']:.2f}", config]
        self._show(f"{loss}: {progress}, best val mAP {self.rows[loss][1]} (test {self.rows[loss][2]})")

    def loss_done(self, loss: str, result: dict) -> None:
        selected = result.get("selected")
        if selected is None:
            self.rows[loss] = [f"done, {result['seconds']:.1f} s", "-", "-", "every head diverged"]
        else:
            epochs = ",".join(str(epoch) for epoch in result["best_epoch"])
            config = f"lr {selected['lr']:g}, batch {selected['batch_size']}, epoch {epochs}"
            val, test = _mean_std(result, "val_map"), _mean_std(result, "test_map")
            self.rows[loss] = [f"done, {result['seconds']:.1f} s", val, test, config]
        self._show(f"{loss}: done in {result['seconds']:.1f} s, val mAP {self.rows[loss][1]}, "
                   f"test mAP {self.rows[loss][2]} ({self.rows[loss][3]})", force=True)

    def _show(self, line: str, force: bool = False) -> None:
        if self.live:
            if not self.live.is_started:
                self.live.start()
            self.live.update(self._table())
            return
        now = time.perf_counter()
        if force or now - self.last_line >= self.every_s:
            self.last_line = now
            self.console.print(line, highlight=False, soft_wrap=True)
