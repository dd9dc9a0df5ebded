"""What `spml-cache linear` shows: the live table while heads train, and the summary table of a finished run."""

from __future__ import annotations

import time

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from spml_cache.runtime.progress import live
from spml_cache.selection import diverged_after_selection, diverged_note


def _mean_std(result: dict, key: str) -> str:
    if result.get(key) is None:
        return "-"
    std = result.get(f"{key}_std")
    seeds = len(result.get("per_seed") or [])
    return f"{result[key]:.2f}" + (f" ± {std:.2f}" if seeds > 1 and std is not None else "")


def hparams_text(values: dict, end: str = "") -> str:
    """Swept hyperparameters as `delta=0.003 k=1.5` (followed by `end`), or nothing."""
    return " ".join(f"{key}={value:g}" for key, value in values.items()) + end if values else ""


def lr_text(config: dict) -> str:
    """A config's lr, and its weight decay where the grid has that axis: `0.001` or `0.001, wd 0.0001`."""
    return f"{config['lr']:g}" + (f", wd {config['wd']:g}" if "wd" in config else "")


def summary_table(results: dict, title: str = "linear heads: best config per loss") -> Table:
    """One row per loss: val and test mAP of the selected config, the config, its best epoch, time."""
    table = Table(title=title)
    swept = any((result.get("selected") or {}).get("swept") for result in results["losses"].values())
    columns = ("loss", "val mAP", "test mAP", "lr", "batch") + (("swept values",) if swept else ()) + ("best epoch", "time")
    for column in columns:
        # a loss's name (loss@rule) and the short values whole on their line: mAP ± std and lists wrap first
        table.add_column(column, justify="left" if column in ("loss", "swept values") else "right", overflow="fold",
                         no_wrap=column in ("loss", "lr", "batch", "time"))
    for name, result in results["losses"].items():
        selected = result.get("selected")
        if selected is None:
            table.add_row(escape(name), "-", "-", "-", "-", *(["-"] if swept else []), "diverged", f"{result['seconds']:.1f} s")
            continue
        table.add_row(
            escape(name), _mean_std(result, "val_map"), _mean_std(result, "test_map"), lr_text(selected),
            str(selected["batch_size"]), *([hparams_text(selected.get("swept", {}))] if swept else []),
            _best_epochs(result), f"{result['seconds']:.1f} s",
        )
    return table


def _best_epochs(result: dict) -> str:
    """`3` or `1,2` (per seed), and `(diverged at 2)` where the selected heads diverged after them."""
    diverged = diverged_after_selection(result)
    return ",".join(str(e) for e in result["best_epoch"]) + (f" (diverged at {diverged})" if diverged else "")


def summary_notes(results: dict) -> list[str]:
    """The lines under the summary table: each loss whose selected heads diverged, named (`selection.diverged_note`)."""
    notes = [(name, diverged_note(result)) for name, result in results["losses"].items()]
    return [f"{name}: {note}" for name, note in notes if note is not None]


class LiveTable:
    """The best val/test mAP per loss while training: a live rich table on a terminal, plain lines elsewhere."""

    def __init__(self, losses: list[str], num_seeds: int, epochs: int, console: Console, every_s: float = 10.0) -> None:
        self.console, self.num_seeds, self.epochs, self.every_s = console, num_seeds, epochs, every_s
        self.rows = {name: ["waiting", "", "", ""] for name in losses}
        self.live = Live(self._table(), console=console, refresh_per_second=4) if live(console) else None
        self.last_line = time.perf_counter()

    def __enter__(self) -> "LiveTable":
        return self  # the live display starts with the first update: worker processes are forked before it

    def __exit__(self, *exc) -> None:
        if self.live and self.live.is_started:
            self.live.stop()

    def _table(self) -> Table:
        table = Table(title="training linear heads")
        for column in ("loss", "progress", "best val mAP", "its test mAP", "config"):
            table.add_column(column, justify="left" if column in ("loss", "progress", "config") else "right",
                             no_wrap=column == "loss")
        for name, row in self.rows.items():
            table.add_row(escape(name), *(escape(cell) for cell in row))
        return table

    def epoch(self, loss: str, seed_index: int, epoch: int, best: dict | None) -> None:
        """After each epoch of one (loss, seed): `best_so_far` of that seed's heads."""
        progress = f"seed {seed_index + 1}/{self.num_seeds}, epoch {epoch}/{self.epochs}"
        if best is None:
            self.rows[loss] = [progress, "-", "-", ""]
        else:
            config = f"lr {lr_text(best)}, batch {best['batch_size']}, {hparams_text(best['hparams'], ', ')}epoch {best['epoch']}"
            self.rows[loss] = [progress, f"{best['val_map']:.2f}", f"{best['test_map']:.2f}", config]
        self._show(f"{loss}: {progress}, best val mAP {self.rows[loss][1]} (test {self.rows[loss][2]})")

    def loss_done(self, loss: str, result: dict, reused: bool = False) -> None:
        """A loss selected: `reused`, its every part was trained by the run this one resumes (kept, not done now)."""
        selected = result.get("selected")
        state = f"kept, trained before in {result['seconds']:.1f} s" if reused else f"done, {result['seconds']:.1f} s"
        if selected is None:
            self.rows[loss] = [state, "-", "-", "every head diverged"]
        else:
            swept = hparams_text(selected.get("swept", {}), ", ")
            epochs, diverged = ",".join(str(epoch) for epoch in result["best_epoch"]), diverged_after_selection(result)
            config = f"lr {lr_text(selected)}, batch {selected['batch_size']}, {swept}epoch {epochs}" + (
                f", diverged at epoch {diverged}" if diverged else "")
            val, test = _mean_std(result, "val_map"), _mean_std(result, "test_map")
            self.rows[loss] = [state, val, test, config]
        self._show(f"{loss}: {state}, val mAP {self.rows[loss][1]}, test mAP {self.rows[loss][2]}"
                   f" ({self.rows[loss][3]})", force=True)

    def note(self, line: str) -> None:
        """A line of news (a compile's time), printed above the live table or among the plain lines."""
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _show(self, line: str, force: bool = False) -> None:
        if self.live:
            if not self.live.is_started:
                self.live.start()
            self.live.update(self._table())
            return
        now = time.perf_counter()
        if force or now - self.last_line >= self.every_s:
            self.last_line = now
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)
