"""The engine of stage two: every (lr, batch size) head of one loss and one seed, trained as stacks.

One `HeadMatrix` + loss (+ `StackedAdam` for the loss's own parameters) per batch size (a "stack", one head
per lr), every stack cutting the same per-(seed, epoch) permutation into consecutive batches of its size, the
last one partial. A batch-16 head thus sees exactly two consecutive batch-8 batches: the schedule of a
batch-16 head trained alone, for any loss, batch-coupled or stateful. Each epoch ends with one batched scoring of every head on val and test
(`metrics.average_precision` on [K, N, C]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from spml_cache import losses as loss_registry
from spml_cache.linear.adam import StackedAdam
from spml_cache.linear.compiled import CompileTime, CompiledStep, full_steps, pays
from spml_cache.linear.data import LinearData
from spml_cache.linear.gradients import autograd_gradients, closed_form_gradients, rows_for_loss
from spml_cache.linear.head_matrix import HeadMatrix
from spml_cache.runtime.devices import head_conditions, to_host
from spml_cache.runtime.errors import check_stop
from spml_cache.linear.out_of_core import (
    Batch, ChunkReader, blocked_average_precision, chunked_permutations, dense_targets, epoch_permutations,
)
from spml_cache.linear.settings import LinearSettings, StartHead
from spml_cache.losses.overrides import Combination
from spml_cache.losses.base import Fidelity
from spml_cache.metrics import average_precision
from spml_cache.observation import DEFAULT_RULE
from spml_cache.selection import HeadRecord, stops_early


@dataclass(frozen=True)
class HeadSettings:
    """Each head of one stack: its hyperparameter combination, lr and weight decay (None: the grid has no such
    axis)."""

    combinations: list[Combination]
    lrs: list[float]
    wds: list[float] | None = None


@dataclass(frozen=True)
class SeedGrid:
    """The grid one seed's stacks train: every lr (beside every weight decay, None: no such axis) at every batch
    size, for `epochs`."""

    lrs: list[float]
    batch_sizes: list[int]
    epochs: int
    wds: list[float] | None = None


class HeadStack:
    """The heads of one (loss, seed, batch size): one for each (lr, weight decay) (and each combination of swept hyperparameters
    the loss takes per head), trained as one stacked tensor.

    A step: the batch's logits for every head (one matmul), the loss and its gradient with respect to the
    logits (in closed form where the loss states it, else by autograd, with the loss's own parameters':
    gradients.py), then the heads' gradient and Adam update in `HeadMatrix.step`. A head whose loss turns NaN/inf
    in an epoch stops at the end of that epoch.
    """

    def __init__(self, name: str, heads: HeadSettings, seed: int, batch_size: int, data: LinearData,
                 start: StartHead | None = None, fidelity: Fidelity | None = None) -> None:
        """`heads`: one hyperparameter dict, lr and weight decay per head: a key whose heads' values differ is
        handed to the loss as a list (one of its `per_head` keys)."""
        device = data.device
        per_head, lrs, wds = [combo.values for combo in heads.combinations], heads.lrs, heads.wds
        varying = loss_registry.varying_keys(per_head)
        hparams = {key: [h[key] for h in per_head] if key in varying else per_head[0][key] for key in per_head[0]}
        self.batch_size, self.num_heads = batch_size, len(lrs)
        self.heads = HeadMatrix(data.train_features.shape[1], data.num_classes, [seed] * len(lrs), lrs, device=device,
                                start=(start.weight, start.bias) if start else None, wds=wds)
        self.loss = loss_registry.build(
            name, num_classes=data.num_classes, num_train=data.num_train, dataset=data.dataset,
            num_heads=len(lrs), train_observed=data.observed_for_loss(loss_registry.reads_whole_observed(name)),
            seed=seed, fidelity=fidelity, train_similarity=data.train_similarity,
            train_crop_similarity=data.train_crop_similarity, **hparams,
        ).to(device)
        self.drop_last, self.early_stop = self.loss.drops_last, self.loss.early_stop  # the fidelity's rules
        if start:
            self.loss.load_head_state(start.loss_state)
        loss_type = type(self.loss)
        self.adam = StackedAdam(lrs)  # the loss's own parameters (ROLE's theta), at their lr multiplier
        # Per-training-row parameters (ROLE's theta, as the loss declares them) only get gradient on the batch's
        # rows: Adam keeps them lazily. A loss with no per-row buffers uses `index` only to read them, so it can
        # be handed just the batch's rows (and index `slice(None)`): autograd then never builds an [N_train]-row
        # gradient, which on COCO-sized data costs more than everything else in a step.
        self.params = list(self.loss.parameters())
        self.row_params = [(key, getattr(self.loss, key)) for key in loss_type.row_params]
        lazy = {id(param) for _, param in self.row_params}
        for param in self.params:
            self.adam.add_param(param, getattr(param, "lr_mult", 1.0), lazy_rows=id(param) in lazy)
        self.lazy = bool(self.row_params)
        self.rows_only = self.lazy and not loss_type.row_buffers and len(self.row_params) == len(self.params)
        # The loss's value and gradient in one pass, no autograd graph (gradients.py), where it states them: with
        # trainable parameters only per-row ones, whose rows' gradients it gives (ROLE's theta)
        self.closed_form = loss_type.closed_form() and (not self.params or self.rows_only)
        self.active = torch.ones(len(lrs), dtype=torch.bool, device=device)  # false once a head has diverged
        self.active_at_start = self.active
        self.stopped = None  # `active` once a head has stopped: the optimisers then leave that head alone
        self.frozen = None  # the stopped heads' columns of `heads` (HeadMatrix.frozen_columns)
        self.stopped_heads: tuple[int, ...] = ()  # which heads have stopped, on the host
        self.gathered: dict[int, Batch] = {}  # per batch size: the tensors a step gathers its batch into
        self.compiled: CompiledStep | None = None  # `linear --compile`: `gradients` compiled (compiled.py)
        self.epoch_loss = torch.zeros(len(lrs), device=device)  # this epoch's per-step losses [K], summed in place
        self.num_steps = 0  # steps taken this epoch
        self.loss_sum = torch.zeros(len(lrs), device=device)
        self.records = [HeadRecord(loss=name, lr=lr, batch_size=batch_size, seed=seed, hparams=combo.swept_values,
                                   wd=wd) for lr, combo, wd in zip(lrs, heads.combinations, wds or [None] * len(lrs))]

    def start_epoch(self, epoch: int, num_epochs: int, order: torch.Tensor, data: LinearData) -> None:
        train_logits = None
        if self.loss.needs_train_logits:
            # A stopped head's logits may be NaN: hand the loss zeros instead, it is never trained again.
            train_logits = torch.where(self.active.view(-1, 1, 1), self.heads.logits(data.train_features), 0.0)
        self.loss.start_epoch(epoch, num_epochs, train_logits)
        self.epoch_loss.zero_()
        self.num_steps = 0
        self.active_at_start = self.active
        if self.lazy:
            # Every row is read once this epoch, by batch i // batch_size for the row at position i of `order`:
            # bring each row to the step before its batch now, instead of a replay at every step.
            batch_index = torch.arange(len(order), device=order.device) // self.batch_size
            self.adam.advance_rows(order, self.adam.steps + batch_index, self.stopped)

    def train_step(self, rows: torch.Tensor, data: LinearData, reader: ChunkReader | None = None) -> None:
        """One step on the training rows `rows` (`reader`: where their features are read, when they stream from
        the cache). With dense arrays in memory nothing in it waits on the GPU or copies from the host, and what
        changes between steps lives in tensors updated in place: a CUDA graph of it replays correctly
        (graphs.py); the Python step counters it advances are `step_counts`."""
        # gathered into this batch size's buffers (made by its first step: the eager warm-up)
        warm = len(rows) in self.gathered
        batch = data.batch(rows, self.loss.oracle, reader, into=self.gathered.get(len(rows)))
        self.gathered.setdefault(len(rows), batch)
        # compiled from the second full step (the first makes the buffers a step reuses); the partial batch eager
        compiled = self.compiled is not None and warm and len(rows) == self.batch_size
        params = self.compiled(batch, rows) if compiled else self.gradients(batch, rows)
        self.heads.update(self.frozen)
        if params:
            if self.rows_only:
                self.adam.step(self.stopped, rows, {id(p): g for (_, p), g in zip(self.row_params, params)})
            else:
                for param, grad in zip(self.params, params):
                    param.grad = grad
                self.adam.step(self.stopped, rows)
        self.num_steps += 1

    def gradients(self, batch: Batch, rows: torch.Tensor) -> tuple:
        """A step's arithmetic before Adam: the loss's value and gradients (gradients.py), the heads' gradient
        into their buffer (`HeadMatrix.take_gradient`), the epoch's loss sum; returns the gradients of the loss's
        own parameters. Tensor ops alone for a closed form: what `linear --compile` compiles (compiled.py)."""
        if self.closed_form:
            grads = closed_form_gradients(self.loss, self.heads, batch, rows)
        else:
            with rows_for_loss(self.loss, rows, self.params, self.row_params, self.rows_only) as (index, params):
                grads = autograd_gradients(self.loss, self.heads, batch, index, params)
        self.heads.take_gradient(batch.features, grads.logits, grads.weight, batch.features_t)
        self.epoch_loss += grads.values
        return grads.params

    def step_counts(self) -> tuple[int, int, int]:
        """The Python counters a step advances (the heads' and Adam's steps, the epoch's): a captured step
        advances them once while it is captured and never when it is replayed, so its replayer keeps them."""
        return self.heads.steps, self.adam.steps, self.num_steps

    def set_step_counts(self, counts: tuple[int, int, int]) -> None:
        self.heads.steps, self.adam.steps, self.num_steps = counts

    def count_steps(self, count: int) -> None:
        """Advance the Python step counters as `count` steps do (after replaying them)."""
        heads, adam, epoch = self.step_counts()
        self.set_step_counts((heads + count, adam + count if self.params else adam, epoch + count))

    def end_epoch(self) -> None:
        """Stop the heads whose loss was NaN/inf in this epoch (one host sync per epoch, none per step)."""
        if not self.num_steps:  # fewer training rows than one batch, and the partial batch dropped
            return
        self.loss_sum = self.epoch_loss.clone()
        self.active = self.active & torch.isfinite(self.loss_sum)
        self._stop(self.active)

    def _stop(self, active: torch.Tensor) -> None:
        """From now on the optimisers leave the heads inactive in `active` alone. One host read; `stopped` and
        `frozen`, which a step reads, are made anew only when another head has stopped since they were made: a
        captured step baked them in, and graphs.py recaptures exactly when they are replaced."""
        stopped_heads = tuple(k for k, alive in enumerate(active.tolist()) if not alive)
        if stopped_heads == self.stopped_heads:
            return
        self.stopped_heads = stopped_heads
        self.stopped = active
        self.frozen = self.heads.frozen_columns(active)

    def eval_logits(self, data: LinearData) -> torch.Tensor:
        self.adam.flush(self.active)
        return self.heads.logits(data.eval_features)

    def epoch_outcome(self) -> tuple[torch.Tensor, torch.Tensor]:
        """On the device: which heads diverged in this epoch's steps `[K]`, and each head's mean loss `[K]`."""
        return self.active_at_start & ~self.active, self.loss_sum / max(self.num_steps, 1)

    def finish_epoch(self, epoch: int, val_ap: np.ndarray, test_ap: np.ndarray, diverged: list[bool],
                     train_loss: list[float], scored: tuple = (None, None)) -> list[dict]:
        """Record the epoch's scores (per-class AP, 0..1, [K, C]) and `epoch_outcome` (on the host), keep the best
        heads; the metrics lines. `scored`: the val and test classes each mAP averages over (partial labels)."""
        lines = []
        for k, record in enumerate(self.records):
            if record.diverged_epoch is not None or record.stopped_epoch is not None:
                continue
            val_map, test_map = (class_mean(ap[k], classes) for ap, classes in zip((val_ap, test_ap), scored))
            if diverged[k] or not (math.isfinite(val_map) and math.isfinite(test_map)):  # never a NaN result
                record.diverged_epoch = epoch
                self.active = self.active.clone()
                self.active[k] = False  # the optimisers leave it alone from now on, as a head whose loss diverged
                self._stop(self.active)
            else:
                if record.add_epoch(epoch, train_loss[k], val_map, test_map, test_ap[k]):
                    record.best_state = self.head_state(k)
                if self.early_stop and stops_early(record, *self.early_stop):
                    record.stopped_epoch = epoch
                    self.active = self.active.clone()
                    self.active[k] = False
                    self._stop(self.active)
            lines += record.metric_lines(epoch)
        return lines

    def head_state(self, k: int) -> dict:
        """Head k alone (copies, on the training device: `SeedRun.host_records` moves them to the host once it is
        done): `nn.Linear` layout and the `num_heads=1` loss state."""
        return {"head": self.heads.linear_state(k), "loss_state": self.loss.head_state_dict(k)}


@dataclass(frozen=True, kw_only=True)
class Job:
    """What one process trains at a time: every lr of one (loss, seed), for one or all of its batch sizes."""

    loss: str
    seed_index: int  # the seed's place among the run's seeds
    seed: int
    batch_sizes: tuple[int, ...]
    rule: str = DEFAULT_RULE  # the observation rule of the labels it trains on (the text of an observation.Rule)
    lrs: tuple[float, ...] = ()  # a group of the grid's lrs, when its heads do not fit the memory budget at once; () all


class SeedRun:
    """Every (lr, batch size) head of one loss and one seed; `run_epoch` trains and scores one epoch."""

    @classmethod
    def for_job(cls, job: Job, settings: LinearSettings, hparams: list[Combination], data: LinearData,
                start: StartHead | None) -> "SeedRun":
        """A job of a run with `settings`: its loss's hyperparameter combinations, its rule's data and starting
        head given."""
        options = settings.options
        grid = SeedGrid(list(job.lrs) or options.lrs, list(job.batch_sizes), options.epochs, settings.wd_axis)
        run = cls(job.loss, hparams, job.seed, grid, data, start, options.fidelity)
        for record in run.records:
            record.rule = job.rule
        return run

    def __init__(self, name: str, hparams: dict | list[dict] | list[Combination], seed: int, grid: SeedGrid,
                 data: LinearData, start: StartHead | None = None, fidelity: Fidelity | None = None) -> None:
        """`hparams`: the loss's, or a list of combinations (a sweep: every lr of every combination is a head).
        `grid.wds`: the weight decays (None: no such axis), each beside every lr in the same stack.
        Combinations that differ only in hyperparameters the loss takes per head share a stack, the others get
        stacks of their own. `start`: the one head every head starts from
        (`linear --from`)."""
        lrs, batch_sizes, epochs, wds = grid.lrs, grid.batch_sizes, grid.epochs, grid.wds
        self.data, self.epochs = data, epochs
        combos = hparams if isinstance(hparams, list) else [hparams]
        if not all(isinstance(combo, Combination) for combo in combos):  # resolved dicts (tests, scripts)
            combos = Combination.of(combos)
        per_head = set(loss_registry.get(name).per_head)
        groups: dict[tuple, list[Combination]] = {}
        for combo in combos:
            groups.setdefault(tuple(item for item in combo.swept if item[0] not in per_head), []).append(combo)
        decays = wds or [None]
        self.stacks = [  # head order in a stack: combination, lr, weight decay
            HeadStack(name, HeadSettings([combo for combo in group for _ in lrs for _ in decays],
                                       [lr for _ in group for lr in lrs for _ in decays],
                                       None if wds is None else [wd for _ in group for _ in lrs for wd in wds]),
                      seed, batch_size, data, start, fidelity)
            for group in groups.values() for batch_size in batch_sizes
        ]
        if data.streams_train:
            self.permutations = chunked_permutations(data.num_train, data.plan.chunk_rows, seed, epochs).to(data.device)
        else:
            self.permutations = epoch_permutations(data.num_train, seed, epochs).to(data.device)

    def compile_steps(self) -> CompileTime | None:
        """`linear --compile`: each stack's step compiled where it pays (compiled.py); the compiles' time, which
        grows as the steps run (None: no stack's step is compiled)."""
        spent = CompileTime(self.stacks[0].records[0].loss)
        chosen = [stack for stack in self.stacks
                  if stack.closed_form and pays(full_steps(self.epochs, self.data.num_train, stack.batch_size))]
        for stack in chosen:
            stack.compiled = CompiledStep(stack, spent)
        return spent if chosen else None

    @property
    def records(self) -> list[HeadRecord]:
        """Every head (the caller puts them in grid order)."""
        return [record for stack in self.stacks for record in stack.records]

    def host_records(self) -> list[HeadRecord]:
        """`records` once trained, their best states moved to the host (kept on the device until then: a copy
        there at every new best epoch costs no wait for the device)."""
        for record in self.records:
            if record.best_state is not None:
                record.best_state = {part: {key: value.cpu() for key, value in state.items()}
                                     for part, state in record.best_state.items()}
        return self.records

    def run_epoch(self, epoch: int) -> list[dict]:
        """Train epoch `epoch` (1-indexed) and score every head; returns the metrics lines of the epoch."""
        self._train(epoch)
        return self.score(epoch)

    def _train(self, epoch: int) -> None:
        data, order = self.data, self.permutations[epoch - 1]
        with head_conditions(data.device):  # those of graphs.Lockstep's steps: the same bits (devices.py)
            for stack in self.stacks:
                stack.start_epoch(epoch, self.epochs, order, data)
                if bool(stack.active.any()):
                    end = len(order) - len(order) % stack.batch_size if stack.drop_last else len(order)
                    reader = ChunkReader(data.train_features, data.plan.chunk_rows, data.device) \
                        if data.streams_train else None
                    for rows in order[:end].split(stack.batch_size):  # the epoch's batches, as views, at once
                        check_stop()  # a safe point: a signal's stop is taken here (errors.stops_deferred)
                        stack.train_step(rows, data, reader)
                    stack.end_epoch()

    @torch.no_grad()
    def score(self, epoch: int) -> list[dict]:
        """Every head's val and test AP in one batched scoring (per stack when its evaluation drops the last
        partial batch, whose rows depend on the batch size); the epoch's metrics lines."""
        with head_conditions(self.data.device, training=False):
            return self._score(epoch)

    def _score(self, epoch: int) -> list[dict]:
        data = self.data
        if not any(stack.drop_last for stack in self.stacks):
            val_ap, test_ap = self._aps(self.stacks, data.num_val, len(data.test_labels))
            parts = np.cumsum([0] + [stack.num_heads for stack in self.stacks])
            aps = [(val_ap[a:b], test_ap[a:b]) for a, b in zip(parts[:-1], parts[1:])]
        else:
            aps = [self._scored_as_the_authors(stack) for stack in self.stacks]
        # what selection needs of every stack, to the host in one copy: one wait for the device per epoch
        host = to_host([t for stack, ap in zip(self.stacks, aps) for t in (*ap, *stack.epoch_outcome())])
        scored = (data.val_scored, data.test_scored)
        return [line for i, stack in enumerate(self.stacks) for line in stack.finish_epoch(
            epoch, host[4 * i], host[4 * i + 1], host[4 * i + 2].tolist(), host[4 * i + 3].tolist(), scored)]

    def _scored_as_the_authors(self, stack: HeadStack) -> tuple[torch.Tensor, torch.Tensor]:
        """Val and test AP on all but the last `N mod B` rows of each, as the authors' evaluation loaders give."""
        data, size = self.data, stack.batch_size
        val_rows, test_rows = data.num_val - data.num_val % size, len(data.test_labels) - len(data.test_labels) % size
        return self._aps([stack], val_rows, test_rows)

    def _aps(self, stacks: list[HeadStack], val_rows: int, test_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Val AP on the first `val_rows` val rows and test AP on the first `test_rows` test rows of every head of
        `stacks`, `[sum K, C]` each: one batched scoring when the data is dense and in memory, else a block of
        classes at a time (out_of_core.py; the same figures)."""
        data = self.data
        if data.scores_at_once:
            # each stack's sigmoid on its own: ATen's vector kernels leave a tensor's last elements to the scalar
            # loop, which rounds differently (AVX2, AVX-512), so a head's scores would depend on the stacks scored
            # with it (in-process or in workers, resumed or not)
            scores = torch.cat([torch.sigmoid(stack.eval_logits(data)) for stack in stacks])
            val = average_precision(scores[:, :val_rows], dense_targets(data.val_targets, val_rows, data.device),
                                    dense_targets(data.val_mask, val_rows, data.device))
            test = average_precision(scores[:, data.num_val : data.num_val + test_rows],
                                     dense_targets(data.test_labels, test_rows, data.device),
                                     dense_targets(data.test_mask, test_rows, data.device))
            return val, test
        for stack in stacks:
            stack.adam.flush(stack.active)
        heads = [stack.heads for stack in stacks]
        blocks = (data.class_block, data.num_classes)
        val = blocked_average_precision(heads, data.eval_features, 0, val_rows, data.val_targets, *blocks,
                                        mask=data.val_mask)
        test = blocked_average_precision(heads, data.eval_features, data.num_val, data.num_val + test_rows,
                                         data.test_labels, *blocks, mask=data.test_mask)
        return val, test


def class_mean(ap: np.ndarray, scored: np.ndarray | None) -> float:
    """One head's mAP (0..100) from its per-class AP: over every class, or the `scored` ones (partial labels)."""
    return 100 * float(ap.mean() if scored is None else ap[scored].mean() if scored.any() else 0.0)
