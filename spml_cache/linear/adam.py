"""Adam for stacked heads: `torch.optim.Adam` (betas 0.9/0.999, eps 1e-8, no weight decay) applied to every head
slice of a `[K, ...]` parameter at once, each head at its own learning rate.

`adam_update` is the update itself (torch's fused kernel where the device has it); `StackedAdam` runs it for
the losses' own parameters (ROLE's `theta`, at its lr multiplier of 10).

Parameters indexed by training row on dim 1 (ROLE's `theta [K, N_train, C]`) only get gradient on the batch's
rows, but dense Adam still moves every other row with its decaying momentum. Updating all N rows every step
would dominate the run time, so `StackedAdam` can keep such a parameter lazily: a step updates only the
batch's rows, and the zero-gradient steps a row missed are replayed in closed form before anything reads it
(`advance_rows`, `catch_up`, `flush`). The replay is exact except that it drops `eps` from the denominator of
those momentum-only steps: a relative difference of eps / sqrt(v), which is not negligible where an entry's
gradients are themselves near eps (docs/fidelity.md measures it on ROLE's theta). The trainer, which knows each
epoch's batches in advance, advances every row to the step before its batch once per epoch, so no step pays
for a replay.
"""

from __future__ import annotations

import torch

BETA1, BETA2, EPS = 0.9, 0.999, 1e-8
# Momentum-only steps replayed per row: the j-th replayed step is scaled by (beta1 / sqrt(beta2))^j, below
# 1e-7 of the first one beyond this many steps (and their sum below 1e-6 of the total drift).
REPLAY_STEPS = 160
REPLAY_BLOCK_ROWS = 16384  # rows replayed at once: bounds the [rows, REPLAY_STEPS] temporaries


def scalar_dtype(device: torch.device) -> torch.dtype:
    """float64 for learning rates and replay coefficients, except where the device has none (Apple's MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def fused_adam_available(device: torch.device) -> bool:
    """Whether torch's fused Adam kernel (the one behind `torch.optim.Adam(fused=True)`) runs on `device`."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return hasattr(torch, "_fused_adam_") and device.type in _get_fused_kernels_supported_devices()
    except ImportError:
        return False


def adam_update(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, step: int, lr, *, fused: bool,
                step_tensor: torch.Tensor | None = None, skip: torch.Tensor | None = None,
                betas: tuple[float, float] = (BETA1, BETA2), eps: float = EPS) -> None:
    """`torch.optim.Adam`'s update (no weight decay) of tensors that have all taken `step` steps, in place.

    `fused`: torch's fused kernel (what `Adam(fused=True)` calls; one pass over memory instead of eight
    elementwise ops), which reads the step count from `step_tensor` and leaves everything as it is where `skip`
    is 1. Otherwise the same update as tensor ops, where `lr` may also be a tensor broadcasting over each param.
    """
    beta1, beta2 = betas
    if fused:
        torch._fused_adam_(
            params, grads, exp_avgs, exp_avg_sqs, [], [step_tensor] * len(params), lr=lr, beta1=beta1, beta2=beta2,
            weight_decay=0.0, eps=eps, amsgrad=False, maximize=False, grad_scale=None, found_inf=skip,
        )
        return
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    for param, grad, exp_avg, exp_avg_sq in zip(params, grads, exp_avgs, exp_avg_sqs):
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.sub_(exp_avg / denom * (lr / bias_correction1))


class _Slot:
    """One parameter's Adam state: moments with the parameter's shape; `last[row]` for a lazy parameter."""

    def __init__(self, param: torch.Tensor, lr: list[float], lr_mult: float, lazy_rows: bool, kernel: bool) -> None:
        self.param, self.lr_mult, self.lazy_rows = param, float(lr_mult), lazy_rows
        self.fused = kernel and not lazy_rows  # updated per head by the fused kernel
        self.fused_rows = kernel and lazy_rows  # its batch's rows updated by the fused kernel
        self.step_tensor = torch.zeros((), device=param.device)  # where the kernel reads the step count
        self.lr = torch.tensor(lr, dtype=scalar_dtype(param.device), device=param.device) * self.lr_mult  # [K]
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
    scales it onto the rows); elsewhere the same update is written out with tensor ops.
    """

    def __init__(self, lr, *, betas: tuple[float, float] = (BETA1, BETA2), eps: float = EPS, fused: bool | None = None) -> None:
        self.lr = [float(value) for value in lr]
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.fused = fused
        self.steps = 0
        self.slots: list[_Slot] = []
        self._fused_groups: list | None = None
        self._growth: torch.Tensor | None = None  # sqrt(1 - beta2^t) / (1 - beta1^t) by step t, for replays

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
        self.slots.append(_Slot(param, self.lr, lr_mult, lazy_rows, kernel))
        self._fused_groups = None

    def zero_grad(self) -> None:
        for slot in self.slots:
            slot.param.grad = None

    def _lr_tensor(self, slot: _Slot, active: torch.Tensor | None, ndim: int, scale: float = 1.0) -> torch.Tensor:
        """`lr_k * lr_mult * scale` per head (0 for stopped heads), shaped to broadcast over a slice."""
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
            else:
                grad = torch.zeros_like(param) if slot.param.grad is None else slot.param.grad
            if active is not None:
                grad = torch.where(active.view(-1, *([1] * (grad.dim() - 1))), grad, 0.0)
            lr = self._lr_tensor(slot, active, grad.dim())
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
            if slot.lazy_rows:
                slot.param.index_copy_(1, rows, param)
                slot.exp_avg.index_copy_(1, rows, exp_avg)
                slot.exp_avg_sq.index_copy_(1, rows, exp_avg_sq)
                slot.last.index_fill_(0, rows, self.steps)

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

    @torch.no_grad()
    def advance_rows(self, rows: torch.Tensor, upto: int | torch.Tensor, active: torch.Tensor | None = None) -> None:
        """Replay the zero-gradient steps `last[row]+1 .. upto[row]` on `rows` (distinct) of the lazy parameters.

        `upto` (an int or one step per row, never beyond `steps` plus the steps still to come before the row
        is next read) lets a trainer that knows the epoch's batches advance each row, once, to the step
        before its batch. After j such steps m = beta1^j m0 and v = beta2^j v0, so (eps dropped) step
        `last + j` moves the parameter by -lr * (m0 / sqrt(v0)) * r^j * sqrt(1 - beta2^t) / (1 - beta1^t),
        with r = beta1 / sqrt(beta2) and t = last + j.
        """
        upto = torch.as_tensor(upto, device=rows.device).expand(rows.shape)
        horizon = (int(upto.max()) if upto.numel() else 0) + REPLAY_STEPS + 1
        if self._growth is None or self._growth.numel() < horizon:
            dtype = scalar_dtype(rows.device)
            t = torch.arange(2 * horizon, dtype=dtype, device=rows.device).clamp(min=1)
            self._growth = torch.sqrt(1 - self.beta2**t) / (1 - self.beta1**t)
            j = torch.arange(1, REPLAY_STEPS + 1, dtype=dtype, device=rows.device)
            self._ratio_powers = (self.beta1 / self.beta2**0.5) ** j
        for slot in self.slots:
            if slot.lazy_rows:
                for start in range(0, rows.numel(), REPLAY_BLOCK_ROWS):
                    block = slice(start, start + REPLAY_BLOCK_ROWS)
                    self._replay(slot, rows[block], upto[block], active)

    def _replay(self, slot: _Slot, rows: torch.Tensor, upto: torch.Tensor, active: torch.Tensor | None) -> None:
        last = slot.last[rows]
        skipped = upto - last  # [R]
        j = torch.arange(1, REPLAY_STEPS + 1, device=rows.device)
        t = last.unsqueeze(1) + j  # [R, J]: the replayed step numbers
        per_step = torch.where(j <= skipped.unsqueeze(1), self._growth[t] * self._ratio_powers, 0.0)
        shape = (1, -1) + (1,) * (slot.param.dim() - 2)
        drift = per_step.sum(dim=1).to(slot.param.dtype).view(shape)  # [1, R, 1]
        exp_avg, exp_avg_sq = slot.exp_avg.index_select(1, rows), slot.exp_avg_sq.index_select(1, rows)
        direction = torch.where(exp_avg_sq > 0, exp_avg / exp_avg_sq.sqrt(), 0.0)
        slot.param.index_add_(1, rows, direction * drift * self._lr_tensor(slot, active, slot.param.dim(), -1.0))
        skipped = skipped.to(self._growth.dtype)
        exp_avg.mul_((self.beta1**skipped).to(exp_avg.dtype).view(shape))
        exp_avg_sq.mul_((self.beta2**skipped).to(exp_avg.dtype).view(shape))
        slot.exp_avg.index_copy_(1, rows, exp_avg)
        slot.exp_avg_sq.index_copy_(1, rows, exp_avg_sq)
        slot.last[rows] = upto
