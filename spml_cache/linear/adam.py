"""Adam for stacked heads: `torch.optim.Adam` (betas 0.9/0.999, eps 1e-8, no weight decay) applied to every head
slice of a `[K, ...]` parameter at once, each head at its own learning rate.

`adam_kernel.adam_update` is the update itself (torch's fused kernel where the device has it); `StackedAdam` runs
it for the losses' own parameters (ROLE's `theta`, at its lr multiplier of 10).

Parameters indexed by training row on dim 1 (ROLE's `theta [K, N_train, C]`) only get gradient on the batch's
rows, but dense Adam still moves every other row with its decaying momentum. Updating all N rows every step
would dominate the run time, so `StackedAdam` can keep such a parameter lazily: a step updates only the
batch's rows, and the zero-gradient steps a row missed are replayed before anything reads it (`advance_rows`,
`catch_up`, `flush`), exactly, eps included (lazy_rows.py, `Replay`: how, and how close to dense Adam). The
trainer, which knows each epoch's batches in advance, advances every row to the step before its batch once per
epoch, so no step pays for a replay.
"""

from __future__ import annotations

import torch

from spml_cache.linear.adam_kernel import BETA1, BETA2, EPS, adam_update, fused_adam_available, scalar_dtype  # noqa: F401
from spml_cache.linear.lazy_rows import Replay, replay_steps  # noqa: F401  (replay_steps: public here too)

NEVER = 2**62  # the step a head that has not stopped stops at


class _Slot:
    """One parameter's Adam state: moments with the parameter's shape; `last[row]` for a lazy parameter."""

    def __init__(self, param: torch.Tensor, lr: list[float], lr_mult: float, lazy_rows: bool, kernel: bool) -> None:
        self.param, self.lr_mult, self.lazy_rows = param, float(lr_mult), lazy_rows
        self.fused = kernel and not lazy_rows  # updated per head by the fused kernel
        self.fused_rows = kernel and lazy_rows  # its batch's rows updated by the fused kernel
        self.step_tensor = torch.zeros((), device=param.device)  # where the kernel reads the step count
        self.lr = torch.tensor(lr, dtype=scalar_dtype(param.device), device=param.device) * self.lr_mult  # [K]
        self.step_lrs: dict[int, torch.Tensor] = {}  # per number of dims: `lr` as a step broadcasts it
        self.exp_avg = torch.zeros_like(param, memory_format=torch.contiguous_format)
        self.exp_avg_sq = torch.zeros_like(param, memory_format=torch.contiguous_format)
        # The step each row is up to date with (lazy parameters only).
        self.last = torch.zeros(param.shape[1], dtype=torch.long, device=param.device) if lazy_rows else None


class StackedAdam:
    """`torch.optim.Adam` per head slice, all heads in one update, with a learning rate per head.

    `lr` is a `[K]` sequence; every registered parameter has K as its first dim. `step(active=...)` updates only
    heads whose `active` entry is true (a stopped head keeps its parameters and moments; its gradient, maybe
    NaN, is ignored). All heads of one optimiser step together, so they share the step count.

    Dense parameters go through torch's fused Adam kernel where the device has it (one call per head and lr
    multiplier over that head's slices: one pass over memory instead of eight elementwise ops), and so do the
    batch's rows of a lazy parameter (the kernel writes the step into a zero tensor at lr 1, each head's lr
    scales it onto the rows; the rows must be up to date, which the replay makes them exactly); elsewhere the
    same update is written out with tensor ops.

    A lazy parameter's skipped steps are replayed exactly, eps included (lazy_rows.py, `Replay`): the
    float32 result is dense Adam's up to a few roundings per replay. A head passed inactive (to `step` or to a
    replay) stops for good on lazy parameters: its rows get the steps it took before and then keep their
    parameters and moments, as when `torch.optim.Adam` is no longer stepped for that head.
    """

    def __init__(self, lr, *, betas: tuple[float, float] = (BETA1, BETA2), eps: float = EPS, fused: bool | None = None) -> None:
        self.lr = [float(value) for value in lr]
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.fused = fused
        self.steps = 0
        self.step_count: torch.Tensor | None = None  # `steps` on the device, for what a step reads of it
        self.slots: list[_Slot] = []
        self._fused_groups: list | None = None
        self._halt: torch.Tensor | None = None  # [K]: the last step each head took (NEVER: still training)
        self._replay: Replay | None = None  # the lazy rows' replay, once a lazy parameter is registered
        self._stopped = False  # whether a head has stopped (then `_halt` is read at every step)

    @property
    def num_heads(self) -> int:
        return len(self.lr)

    def add_param(self, param: torch.Tensor, lr_mult: float = 1.0, lazy_rows: bool = False) -> None:
        """Register `param` (`[K, ...]`); `lazy_rows`: its gradient is zero outside the rows passed to `step`."""
        if param.shape[0] != self.num_heads:
            raise ValueError(f"parameter {tuple(param.shape)} has no leading head dim of size {self.num_heads}")
        if lazy_rows and param.dim() < 2:
            raise ValueError("a lazy-rows parameter needs a row dim after the head dim")
        if not param.is_contiguous():
            raise ValueError("stacked parameters must be contiguous (each head's slice is updated in place)")
        kernel = fused_adam_available(param.device) if self.fused is None else self.fused
        if self.step_count is None:
            self.step_count = torch.zeros((), dtype=torch.long, device=param.device)
        if lazy_rows and self._halt is None:
            self._replay = Replay((self.beta1, self.beta2), self.eps)
            self._halt = torch.full((self.num_heads,), NEVER, dtype=torch.long, device=param.device)
        self.slots.append(_Slot(param, self.lr, lr_mult, lazy_rows, kernel))
        self._fused_groups = None

    def zero_grad(self) -> None:
        for slot in self.slots:
            slot.param.grad = None

    def _lr_tensor(self, slot: _Slot, active: torch.Tensor | None, ndim: int, scale: float = 1.0) -> torch.Tensor:
        """`lr_k * lr_mult * scale` per head (0 for stopped heads), shaped to broadcast over a slice; a step's
        (every head, scale 1) made once, by the first (eager) step."""
        if active is None and scale == 1.0:
            if ndim not in slot.step_lrs:
                slot.step_lrs[ndim] = slot.lr.to(slot.param.dtype).view(-1, *([1] * (ndim - 1)))
            return slot.step_lrs[ndim]
        lr = slot.lr * scale
        if active is not None:
            lr = lr * active
        return lr.to(slot.param.dtype).view(-1, *([1] * (ndim - 1)))

    @torch.no_grad()
    def step(self, active: torch.Tensor | None = None, rows: torch.Tensor | None = None,
             row_grads: dict | None = None) -> None:
        """One Adam step. `rows`: the batch's training rows, required when a lazy-rows parameter exists; they
        must be up to date (`advance_rows` or `catch_up`) before the forward pass that produced the gradient.
        `row_grads`: `{id(param): gradient of its rows [K, R, ...]}` for lazy parameters whose gradient was
        taken on the rows alone (otherwise it is read from `param.grad[:, rows]`)."""
        self.steps += 1
        self.step_count += 1  # a captured step reads its count from here, never from the Python int
        self._stop_heads(active, self.step_count - 1, check=False)  # the device count: a replay reads it anew
        if self._fused_groups is None:
            self._fused_groups = self._group_fused()
        if self._fused_groups:
            self._fused_step(active)
        for slot in self.slots:
            if slot.fused:
                continue
            param, exp_avg, exp_avg_sq = slot.param, slot.exp_avg, slot.exp_avg_sq
            if slot.lazy_rows:
                if rows is None:
                    raise ValueError("step(rows=...) is required: a parameter is kept lazily by rows")
                param, exp_avg, exp_avg_sq = (t.index_select(1, rows) for t in (param, exp_avg, exp_avg_sq))
                grad = slot.param.grad.index_select(1, rows) if slot.param.grad is not None else None
                if row_grads is not None:
                    grad = row_grads.get(id(slot.param))
                grad = torch.zeros_like(param) if grad is None else grad
                # a head stopped once stays stopped on lazy rows: their replays end at its last step
                live = self._halt >= self.step_count if self._stopped else None
            else:
                grad = torch.zeros_like(param) if slot.param.grad is None else slot.param.grad
                live = active
            if live is not None:
                # A stopped head keeps its parameters and moments (its gradient, maybe NaN, is ignored).
                live = live.view(-1, *([1] * (grad.dim() - 1)))
                grad = torch.where(live, grad, 0.0)
                kept = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
            lr = self._lr_tensor(slot, None, grad.dim())
            if slot.fused_rows:
                # The kernel at lr 1 on a zero tensor leaves the step -m_hat / (sqrt(v_hat) + eps) there (one op
                # where the update as tensor ops takes ten); each head's lr then scales it onto the rows.
                step = torch.zeros_like(param)
                slot.step_tensor += 1
                adam_update([step], [grad], [exp_avg], [exp_avg_sq], self.steps, 1.0, fused=True,
                            step_tensor=slot.step_tensor, betas=(self.beta1, self.beta2), eps=self.eps)
                param.addcmul_(step, lr)
            else:
                adam_update([param], [grad], [exp_avg], [exp_avg_sq], self.steps, lr, fused=False,
                            betas=(self.beta1, self.beta2), eps=self.eps)
            if live is not None:
                for tensor, before in zip((param, exp_avg, exp_avg_sq), kept):
                    tensor.copy_(torch.where(live, tensor, before))
            if slot.lazy_rows:
                slot.param.index_copy_(1, rows, param)
                slot.exp_avg.index_copy_(1, rows, exp_avg)
                slot.exp_avg_sq.index_copy_(1, rows, exp_avg_sq)
                # a copy from the device count, not index_fill_ with it: ATen's index_fill_ reads a tensor value
                # on the host (`.item()`), a sync that a captured step cannot have
                slot.last.index_copy_(0, rows, self.step_count.expand(rows.shape))

    def _group_fused(self) -> list:
        """Per (lr multiplier, head): which fused slots, the head's slices of them, their moments, step count."""
        self._fused_slots = [slot for slot in self.slots if slot.fused]
        if not self._fused_slots:
            return []
        self._step_counts = torch.zeros(self.num_heads, dtype=torch.float32, device=self._fused_slots[0].param.device)
        groups = []
        for lr_mult in dict.fromkeys(slot.lr_mult for slot in self._fused_slots):
            members = [i for i, slot in enumerate(self._fused_slots) if slot.lr_mult == lr_mult]
            slots = [self._fused_slots[i] for i in members]
            for k in range(self.num_heads):
                groups.append((k, self.lr[k] * lr_mult, members, [s.param[k] for s in slots],
                               [s.exp_avg[k] for s in slots], [s.exp_avg_sq[k] for s in slots]))
        return groups

    def _fused_step(self, active: torch.Tensor | None) -> None:
        self._step_counts += 1
        skip = None if active is None else (~active).float().unbind()  # the kernel skips a head where this is 1
        grads = [(torch.zeros_like(s.param) if s.param.grad is None else s.param.grad).unbind() for s in self._fused_slots]
        for k, lr, members, params, exp_avgs, exp_avg_sqs in self._fused_groups:
            adam_update(params, [grads[i][k] for i in members], exp_avgs, exp_avg_sqs, self.steps, lr, fused=True,
                        step_tensor=self._step_counts[k], skip=None if skip is None else skip[k],
                        betas=(self.beta1, self.beta2), eps=self.eps)

    # --- lazy rows -----------------------------------------------------------------------------------------

    def catch_up(self, rows: torch.Tensor, active: torch.Tensor | None = None) -> None:
        """Bring `rows` of the lazy parameters up to date with the steps taken so far (before a forward pass
        reads them)."""
        self.advance_rows(rows, self.steps, active)

    def flush(self, active: torch.Tensor | None = None) -> None:
        """Bring every row up to date (before reading a lazy parameter whole: scoring, checkpoints)."""
        for slot in self.slots:
            if slot.lazy_rows:
                rows = torch.arange(slot.param.shape[1], device=slot.param.device)
                self.advance_rows(rows, self.steps, active)
                return

    def _stop_heads(self, active: torch.Tensor | None, taken: int | torch.Tensor, check: bool = True) -> None:
        """Heads inactive in `active` stop (for good) after step `taken`: their lazy rows keep that state.
        `check`: look whether any head is inactive (a host sync, so not at every step: the trainer passes
        `active` to `step` only once a head has stopped)."""
        if active is None or self._halt is None or (check and bool(active.all())):
            return
        self._stopped = True
        # in place: a captured step reads `_halt` where it was (inside a step the update changes nothing: the
        # epoch's start stopped the heads already, at a step at most `taken`; a step passes `taken` on the device,
        # so that its replays run the op its capture recorded, tests/test_linear_graphs.py)
        self._halt.copy_(torch.where(active.to(self._halt.device), self._halt, self._halt.clamp(max=taken)))

    @torch.no_grad()
    def advance_rows(self, rows: torch.Tensor, upto: int | torch.Tensor, active: torch.Tensor | None = None) -> None:
        """Replay the zero-gradient steps `last[row]+1 .. upto[row]` on `rows` (distinct) of the lazy parameters.

        `upto` (an int or one step per row, never beyond `steps` plus the steps still to come before the row
        is next read) lets a trainer that knows the epoch's batches advance each row, once, to the step
        before its batch. A head inactive in `active` is stopped from now on (from the first step or call
        that passed it inactive): its rows get the steps it took before and then keep their parameters and
        moments, as `torch.optim.Adam` no longer stepped for that head would. A stopped head stays stopped.

        After j such steps from step L, m = beta1^j m0 and v = beta2^j v0, and Adam moves the entry by
        -lr * m0 * a_j / (b_j * sqrt(v0) + eps), a_j = beta1^j / (1 - beta1^(L+j)),
        b_j = beta2^(j/2) / sqrt(1 - beta2^(L+j)): `Replay.replay` sums that exactly (lazy_rows.py).
        """
        upto = torch.as_tensor(upto, device=rows.device).expand(rows.shape)
        self._stop_heads(active, self.steps)
        for slot in self.slots:
            if slot.lazy_rows:
                self._replay.replay(slot, rows, upto, self._halt, self._stopped)
