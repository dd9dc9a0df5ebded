"""Stage two's selection as the parts of a run arrive (kept ones, trained here, or from other torchrun
processes): each part kept to disk as it is done, and each loss selected, and its scores written, once its every
part is in (docs/protocol.md, "Training and selection"; `selection.py`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from spml_cache import losses as loss_registry, observation, runs
from spml_cache.linear.data import LinearData
from spml_cache.linear.jobs import JobEvent, JobPlan, merged_progress
from spml_cache.linear.live import LiveTable
from spml_cache.linear.out_of_core import dense_targets, train_map
from spml_cache.linear.parts import KeptParts, Part
from spml_cache.losses.overrides import Combination
from spml_cache.metrics import mean_average_precision
from spml_cache.selection import HeadRecord, loss_results, select_config


class Gathering:
    """A run's parts by unit (`{result key: {(key, seed, batch size): Part}}`) until each unit's are all in, then
    its results.json entry (`entries`) and best.pt entry (`checkpoints`); the live table told as it goes."""

    def __init__(self, run_dir: Path, plan: JobPlan, kept: dict[tuple, Part], live: LiveTable) -> None:
        self.run_dir, self.plan, self.live, self.keeping = run_dir, plan, live, KeptParts(run_dir)
        settings = plan.settings
        self.expected = len(settings.seeds) * len(settings.options.batch_sizes)
        # a combination's place in its loss's grid: selection breaks ties in grid order
        self.positions = {name: {combo.swept: index for index, combo in enumerate(combos)}
                          for name, combos in plan.used.items()}
        self.parts = {key: {part: done for part, done in kept.items() if part[0] == key} for key in plan.units}
        self.entries: dict[str, dict] = {}
        self.checkpoints: dict[str, dict] = {}
        self.progress: dict[tuple, dict] = {}  # (key, seed index): {batch sizes: (epoch, best so far)}
        self.groups: dict[tuple, Part] = {}  # the lr groups of a part trained so far (memory budget)
        self.compiled: set[str] = set()  # the losses whose compile time was told (`linear --compile`: once each)
        for key in [key for key in plan.units if len(self.parts[key]) == self.expected]:
            self._finish(key, reused=True)  # every part kept by the run this one resumes: said as such, once

    def take(self, event: JobEvent) -> None:
        """One event of a job: its metrics lines written, its progress shown, its finished parts kept."""
        job, key = event.job, observation.result_key(event.job.loss, event.job.rule)
        runs.append_metrics(self.run_dir, event.lines)
        if event.compiled is not None and event.job.loss not in self.compiled:
            self.compiled.add(event.job.loss)
            self.live.note(event.compiled.line())
        if event.progress is not None and key in self.parts:  # an epoch of a job of an unfinished loss
            progress = self.progress.setdefault((key, job.seed_index), {})
            progress[job.batch_sizes] = event.progress
            self.live.epoch(key, job.seed_index, *merged_progress(progress.values()))
        if event.done is None:
            return
        for size in job.batch_sizes:  # kept as one part per batch size (a resume may split a job)
            self._keep(key, job, size, event.done.of_batch_size(size))
        if len(self.parts[key]) == self.expected:
            self._finish(key)

    def _keep(self, key: str, job, size: int, part: Part) -> None:
        slot = (key, job.seed, size)
        if job.lrs:  # one lr group of the part (its best states to disk now): kept once every lr is trained
            part = self.keeping.spill(key, part)
            part = self.groups[slot] = self.groups[slot].merged(part) if slot in self.groups else part
            grid = self.plan.settings.options
            if len(part.records) < len(grid.lrs) * len(grid.wds) * len(self.plan.used[job.loss]):
                return
            del self.groups[slot]
        self.parts[key][slot] = part
        self.keeping.keep(key, job.seed, size, part)

    def _grid_order(self, record: HeadRecord) -> tuple:
        """Seed, lr, wd, batch size, swept values: selection breaks ties in this order."""
        grid = self.plan.settings.options
        wd = 0 if record.wd is None else grid.wds.index(record.wd)
        return (record.seed, grid.lrs.index(record.lr), wd, grid.batch_sizes.index(record.batch_size),
                self.positions[record.loss][record.swept])

    def _finish(self, key: str, reused: bool = False) -> None:
        """Select unit `key` once its every part is in (`reused`: all of them were kept before this resume)."""
        done, (name, rule) = self.parts.pop(key), self.plan.units[key]
        records = sorted((record for part in done.values() for record in part.records), key=self._grid_order)
        seconds = sum(part.seconds for part in done.values())  # training time, summed over the loss's parts
        entry, best = select_loss(self.run_dir, key, records, self.plan.used[name], self.plan.data[rule], seconds)
        self.entries[key] = entry if rule == observation.DEFAULT_RULE else {"loss": name, "rule": rule, **entry}
        if best is not None:
            self.checkpoints[key] = best
        self.live.loss_done(key, self.entries[key], reused)


@torch.no_grad()
def head_scores(state: dict, features: torch.Tensor) -> torch.Tensor:
    """Sigmoid scores `[N, C]` of one head in `nn.Linear` layout."""
    weight = state["weight"].to(features.device)
    return torch.sigmoid(torch.addmm(state["bias"].to(features.device), features, weight.t()))


def select_loss(run_dir: Path, name: str, records: list[HeadRecord], combos: list[Combination], data: LinearData,
                seconds: float) -> tuple[dict, dict | None]:
    """Select one loss's config (under one rule: `name` is its result key) and write its `scores/<name>.npz`;
    its `results.json` and `best.pt` entries.

    The selected head (the best seed of the selected config) goes to best.pt with its `num_heads=1` loss state;
    train mAP is measured against the full training labels.
    """
    selection = select_config(records)
    if selection is None:
        return loss_results(records, None, loss_registry.merged(combos), [], seconds), None
    hparams = {combo.swept: combo for combo in combos}[selection.representative.swept].values
    best = selection.representative
    if data.scores_at_once and not data.streams_train:
        labels = dense_targets(data.train_labels, data.num_train, data.device)
        train_maps = [mean_average_precision(head_scores(r.best_state["head"], data.train_features), labels)
                      for r in selection.records]
        train = head_scores(best.best_state["head"], data.train_features)
        evaluated = head_scores(best.best_state["head"], data.eval_features)
        tests = torch.stack([head_scores(r.best_state["head"], data.eval_features)[data.num_val :]
                             for r in selection.records])  # every seed's: report's F1 family and intervals
        per_seed = runs.SeedScores([r.seed for r in selection.records], tests, data.test_labels, data.test_mask)
        runs.write_scores(run_dir, name, per_seed, train=train, val=evaluated[: data.num_val],
                          test=evaluated[data.num_val :])
    else:  # no [N, C] scores: train mAP a block of classes at a time (unmeasured when the train rows stream)
        train_maps = [None if data.streams_train else train_map(r.best_state["head"], data)
                      for r in selection.records]
    checkpoint = {
        "head": best.best_state["head"], "loss_state": best.best_state["loss_state"], "lr": best.lr, **best.wd_entry(),
        "batch_size": best.batch_size, "seed": best.seed, "epoch": best.best_epoch, "hparams": hparams,
    }
    return loss_results(records, selection, hparams, train_maps, seconds), checkpoint
