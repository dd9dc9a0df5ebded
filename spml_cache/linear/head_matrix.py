"""K linear heads in one matrix, each trained by Adam at its own learning rate, each as if alone.

`HeadMatrix` holds K linear heads side by side in one `[D, K*C]` matrix and trains them with Adam in one fused
update (see the class). Head k starts as `protocol.initial_head(D, C, seed_k)` (up to the rounding of storing it
divided by its lr), so a head inside a stack is the same model as the head trained on its own.
"""

from __future__ import annotations

from typing import Sequence

import torch

from spml_cache.linear.adam_kernel import adam_update, fused_adam_available
from spml_cache.protocol import initial_head

class HeadMatrix:
    """K linear heads `D -> C` side by side in one matrix, each trained by Adam at its own learning rate.

    Layout: `scaled_weight [D, K*C]` and `scaled_bias [K*C]`, head k in columns `k*C .. (k+1)*C - 1`. Both are
    views of one `[D + 1, K*C]` buffer (the bias its last row), and so are their gradients and Adam's moments: the
    fused Adam update reads one tensor of each. A training batch carries a ones column after its features
    (`out_of_core.Batch`), so one `mm` with that buffer gives every head's logits, bias included, and one `mm`
    every head's weight and bias gradient.

    Adam moves a parameter by lr times a quantity of the gradients alone, so head k's parameters are stored
    divided by its lr (`scaled_*`): Adam updates them at lr 1 for all heads in one fused call, from the
    gradient of the real parameters, and the forward pass multiplies the logits back by lr_k. Head k's real
    weight is `lr_k * scaled_weight[:, k]`: `torch.optim.Adam` on that head alone, up to float rounding.
    Gradients are not taken by autograd through the heads (that would give the scaled parameters' gradient):
    the trainer hands `step` the gradient of the loss with respect to the logits. (An lr below ~1e-37 would
    overflow the scaled parameters in float32: such a head shows up as diverged.)

    Weight decay (`wds`, one per head; None or all 0: none) is `torch.optim.Adam`'s L2 penalty on the real
    weight, not on the bias (a probe's intercept is not penalised, as in logistic regression): `wd_k * w_k` added
    to the weight's gradient before the update, that is `wd_k * lr_k` times the stored column.

    A plain class, not an `nn.Module`: a step reads a dozen of its tensors, and module attribute lookups
    would cost more than some of the ops.
    """

    def __init__(self, in_features: int, num_classes: int, seeds: Sequence[int], lrs: Sequence[float], *,
                 device: torch.device | str = "cpu", fused: bool | None = None,
                 start: tuple[torch.Tensor, torch.Tensor] | None = None,
                 wds: Sequence[float] | None = None) -> None:
        """`start`: one head's `nn.Linear` weight `[C, D]` and bias `[C]` for every head to start from,
        instead of each seed's initialisation. `wds`: each head's weight decay (None: none)."""
        if len(seeds) != len(lrs):
            raise ValueError(f"got {len(seeds)} seeds for {len(lrs)} learning rates: give one of each per head")
        device = torch.device(device)
        self.num_heads, self.num_classes = len(lrs), num_classes
        self.fused = fused_adam_available(device) if fused is None else fused
        if start is None:
            inits = {seed: initial_head(in_features, num_classes, seed) for seed in set(seeds)}
        else:
            inits = {seed: tuple(t.detach().cpu().float() for t in start) for seed in set(seeds)}
        lr_columns = torch.tensor(lrs, dtype=torch.float64).repeat_interleave(num_classes)
        weight = torch.cat([inits[seed][0].t() for seed in seeds], dim=1).double() / lr_columns
        bias = torch.cat([inits[seed][1] for seed in seeds]).double() / lr_columns
        self.lr_columns = lr_columns.float().to(device)
        self.decay_columns = None  # wd_k * lr_k per column; None without decay, so that the papers' step is unchanged
        if wds is not None and any(wds):
            if len(wds) != len(lrs):
                raise ValueError(f"got {len(wds)} weight decays for {len(lrs)} learning rates: give one per head")
            wd_columns = torch.tensor(wds, dtype=torch.float64).repeat_interleave(num_classes)
            self.decay_columns = (wd_columns * lr_columns).float().to(device)
        param = torch.cat([weight, bias.unsqueeze(0)]).float().to(device)  # [D + 1, K*C]
        self.scaled_weight, self.scaled_bias = param[:-1], param[-1]
        self.params, self.grads, self.exp_avgs, self.exp_avg_sqs = [param], *([torch.zeros_like(param)] for _ in range(3))
        self.grad_weight, self.grad_bias = self.grads[0][:-1], self.grads[0][-1]
        self.steps = 0
        self.step_tensor = torch.zeros((), device=device)  # where the fused kernel reads the step count
        self.batch_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # `batch_logits`' per batch size
        self.gradient_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # `_gradient_rows`' per batch size

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        """Logits `[K, B, C]` of every head on the same rows: `[B, D]`, or `[B, D + 1]` with a ones column last
        (a training batch, `out_of_core.Batch`), whose product with the `[D + 1, K*C]` buffer adds the bias in the
        same matrix product (no autograd through the heads)."""
        if features.shape[1] == self.params[0].shape[0]:
            flat = torch.mm(features, self.params[0])
        else:
            flat = torch.addmm(self.scaled_bias, features, self.scaled_weight)
        flat.mul_(self.lr_columns)
        # [B, K*C] read as [K, B, C] (head k's columns as its own matrix): one view
        return flat.as_strided((self.num_heads, len(features), self.num_classes), (self.num_classes, flat.shape[1], 1))

    def batch_logits(self, features: torch.Tensor) -> torch.Tensor:
        """`self(features)` for a training batch `[B, D + 1]` (a ones column last) into a buffer of its batch size,
        made with its view as `[K, B, C]` by the batch size's first step: no allocation and no view a step (one op
        fewer). The next step of that batch size writes over it: for a closed form, whose gradient is a new tensor
        (autograd's logits are a leaf of their own: `self(features)`)."""
        flat, logits = self.batch_buffers.get(len(features), (None, None))
        if flat is None:
            flat = torch.empty((len(features), self.params[0].shape[1]), device=features.device)
            logits = flat.as_strided((self.num_heads, len(features), self.num_classes), (self.num_classes,
                                                                                         flat.shape[1], 1))
            self.batch_buffers[len(features)] = flat, logits
        torch.mm(features, self.params[0], out=flat)
        flat.mul_(self.lr_columns)
        return logits

    def logits(self, features: torch.Tensor, chunk_rows: int = 16384) -> torch.Tensor:
        """Evaluation logits `[K, N, C]` for many rows, in row chunks to bound the memory of one matmul."""
        return torch.cat([self(features[i : i + chunk_rows]) for i in range(0, len(features), chunk_rows)], dim=1)

    @property
    def weight(self) -> torch.Tensor:
        """Every head's real weight, `[K, D, C]` (a copy)."""
        weight = self.scaled_weight * self.lr_columns
        return weight.view(-1, self.num_heads, self.num_classes).permute(1, 0, 2)

    def linear_state(self, k: int) -> dict[str, torch.Tensor]:
        """Head k in `nn.Linear` layout: `{"weight": [C, D], "bias": [C]}` (detached copies)."""
        columns = slice(k * self.num_classes, (k + 1) * self.num_classes)
        lr = self.lr_columns[columns]
        weight = self.scaled_weight.new_empty((self.num_classes, self.scaled_weight.shape[0]))
        torch.mul(self.scaled_weight[:, columns].t(), lr.view(-1, 1), out=weight)  # no [D, C] temporary
        return {"weight": weight, "bias": self.scaled_bias[columns] * lr}

    def frozen_columns(self, active: torch.Tensor | None) -> torch.Tensor | None:
        """The columns of the heads inactive in `active [K]` (None: all active), for `step`. A host sync: the
        trainer asks once whenever a head stops, so that no step needs one (a captured step could not have it)."""
        if active is None or bool(active.all()):
            return None
        stopped = (~active).repeat_interleave(self.num_classes)
        return stopped.nonzero().squeeze(1).to(self.scaled_bias.device)

    def step(self, features: torch.Tensor, grad_logits: torch.Tensor, weight_grad: torch.Tensor | None = None,
             frozen: torch.Tensor | None = None, features_t: torch.Tensor | None = None) -> None:
        """One Adam step of every head from the batch `features` (`[B, D]`, or `[B, D + 1]` with a ones column
        last: then one product gives the weight's and the bias's gradient; `features_t`: its transpose, if the
        caller keeps one) and the loss's gradient with respect to the logits `[K, B, C]`; `weight_grad [K, D, C]`:
        a penalty's gradient on the weights, added. `frozen` (`frozen_columns`; None: none): the columns of
        stopped heads, which keep their parameters and moments. `take_gradient` then `update`."""
        self.take_gradient(features, grad_logits, weight_grad, features_t)
        self.update(frozen)

    @torch.no_grad()
    def take_gradient(self, features: torch.Tensor, grad_logits: torch.Tensor, weight_grad: torch.Tensor | None = None,
                      features_t: torch.Tensor | None = None) -> None:
        """The heads' gradient (`step`'s arguments) into `grads`: tensor ops alone (`linear --compile` compiles
        them with the loss's)."""
        grad = self._gradient_rows(grad_logits)  # [B, K*C], the layout of the logits
        grad_weight = self.grad_weight
        features_t = features.t() if features_t is None else features_t
        if features.shape[1] == self.params[0].shape[0]:  # the ones column's row of the product is the bias's
            torch.mm(features_t, grad, out=self.grads[0])
        else:
            torch.mm(features_t, grad, out=grad_weight)
            torch.sum(grad, dim=0, out=self.grad_bias)
        if weight_grad is not None:
            grad_weight.view(-1, self.num_heads, self.num_classes).add_(weight_grad.permute(1, 0, 2))
        if self.decay_columns is not None:  # d/dw of wd/2 |w|^2 = wd * w = wd * lr * scaled weight
            grad_weight.addcmul_(self.scaled_weight, self.decay_columns)

    def _gradient_rows(self, grad_logits: torch.Tensor) -> torch.Tensor:
        """`rows_of(grad_logits)`: a view when the gradient keeps the logits' layout; else one copy into a buffer
        of its batch size made by its first step, with its `[K, B, C]` view (a copy, a transpose and a view
        otherwise: two ops fewer; a copy is exact, so the same bits)."""
        if keeps_logits_layout(grad_logits):
            return rows_of(grad_logits)
        num_heads, rows, classes = grad_logits.shape
        flat, view = self.gradient_buffers.get(rows, (None, None))
        if flat is None:
            flat = grad_logits.new_empty((rows, num_heads * classes))
            view = flat.as_strided(grad_logits.shape, (classes, num_heads * classes, 1))
            self.gradient_buffers[rows] = flat, view
        view.copy_(grad_logits)
        return flat

    @torch.no_grad()
    def update(self, frozen: torch.Tensor | None = None) -> None:
        """Adam's step of every head from `grads` (`step`'s `frozen`): torch's fused kernel, eager on every path."""
        if frozen is not None:
            state = self.params + self.exp_avgs + self.exp_avg_sqs
            kept = [t.index_select(t.dim() - 1, frozen) for t in state]
        self.steps += 1
        self.step_tensor += 1
        adam_update(self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.steps, 1.0, fused=self.fused,
                    step_tensor=self.step_tensor)
        if frozen is not None:
            for t, saved in zip(state, kept):
                t.index_copy_(t.dim() - 1, frozen, saved)


def rows_of(grad_logits: torch.Tensor) -> torch.Tensor:
    """The logits' gradient `[K, B, C]` as `[B, K*C]`, the heads' columns side by side: a view of it (one op)
    when it keeps the logits' memory layout (`HeadMatrix.__call__`'s, as elementwise ops on the logits keep
    it), else a copy."""
    num_heads, rows, classes = grad_logits.shape
    if keeps_logits_layout(grad_logits):
        return grad_logits.as_strided((rows, num_heads * classes), (num_heads * classes, 1))
    return grad_logits.transpose(0, 1).reshape(rows, -1)


def keeps_logits_layout(grad_logits: torch.Tensor) -> bool:
    """Whether `[K, B, C]` lies in memory as the logits do: `[B, K*C]` read as `[K, B, C]` (`HeadMatrix.__call__`)."""
    num_heads, _, classes = grad_logits.shape
    return grad_logits.stride() == (classes, num_heads * classes, 1)
