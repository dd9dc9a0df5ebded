"""A stage-two step's gradients: each head's loss and its gradient with respect to the logits (and the head's
weight, for a penalty; and the loss's own parameters), which `HeadMatrix.step` turns into the heads' gradient
with one matrix product.

A loss that states its gradient in closed form (`Loss.loss_and_grad`, losses/terms.py) gives the value and the
gradient in one pass and builds no autograd graph: its step runs about half the ops (docs/benchmarks.md, "Lean
steps"). Any other loss (a plugin without one, a loss with trainable parameters such as ROLE's theta) is
differentiated by `torch.autograd.grad` to the logits only. Heads share no computation either way: a NaN in one
head's loss reaches no other head's gradient.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from spml_cache.linear.head_matrix import HeadMatrix
from spml_cache.linear.out_of_core import Batch
from spml_cache.losses.base import Loss


@dataclass(frozen=True)
class StepGradients:
    """One step's per-head values `[K]` (loss plus penalty, detached), the gradient of their sum with respect to
    the logits `[K, B, C]`, to the heads' weight `[K, D, C]` (None: no penalty) and to the loss's own parameters
    (in the order given; empty for a closed form)."""

    values: torch.Tensor
    logits: torch.Tensor
    weight: torch.Tensor | None
    params: tuple


def closed_form_gradients(loss: Loss, heads: HeadMatrix, batch: Batch, rows: torch.Tensor) -> StepGradients:
    """The gradients of a loss with `loss_and_grad` (its per-row parameters' on the batch's rows, in the order of
    `row_params`); its penalty's in closed form when it states one (`penalty_and_grad`), else by autograd of the
    penalty alone."""
    values, grad_logits, *row_grads = loss.loss_and_grad(heads.batch_logits(batch.features), batch.observed,
                                                         labels=batch.labels, index=rows)
    params = tuple(row_grads[0][name] for name in type(loss).row_params) if row_grads else ()
    weight_grad = None
    if type(loss).penalises_weight:
        if type(loss).closed_form_penalty():
            penalty, weight_grad = loss.penalty_and_grad(heads.weight)
        else:
            weight = heads.weight.requires_grad_()
            penalty = loss.penalty(weight)
            (weight_grad,) = torch.autograd.grad(penalty.sum(), [weight])
            penalty = penalty.detach()
        values = values + penalty
    return StepGradients(values, grad_logits, weight_grad, params)


def autograd_gradients(loss: Loss, heads: HeadMatrix, batch: Batch, index, params: list) -> StepGradients:
    """The gradients by autograd, to the logits (a leaf: the heads' own gradient is `HeadMatrix.step`'s product),
    the loss's `params` and, for a penalty, the heads' weight."""
    logits = heads(batch.features).requires_grad_()
    per_head = loss(logits, batch.observed, labels=batch.labels, index=index)
    inputs = [logits] + params
    penalised = type(loss).penalises_weight
    if penalised:
        weight = heads.weight.requires_grad_()
        per_head = per_head + loss.penalty(weight)
        inputs.append(weight)
    grads = torch.autograd.grad(per_head.sum(), inputs, allow_unused=True)
    return StepGradients(per_head.detach(), grads[0], grads[-1] if penalised else None,
                         tuple(grads[1 : 1 + len(params)]))


@contextmanager
def rows_for_loss(loss: Loss, rows: torch.Tensor, params: list, row_params: list, rows_only: bool):
    """The `index` to hand the loss and the loss's tensors to differentiate: its `params`, or (with `rows_only`)
    leaves standing in for its `row_params` (`(name, parameter)` pairs) holding just the batch's rows, swapped into
    the loss for this step and swapped back after; `index` is then `slice(None)`, every row of the stand-ins, so
    that reading them is a view rather than a gather (and its gradient no scatter)."""
    if not rows_only:
        yield rows, params
        return
    proxies = [torch.nn.Parameter(param.detach().index_select(1, rows)) for _, param in row_params]
    for (key, _), proxy in zip(row_params, proxies):
        setattr(loss, key, proxy)
    try:
        yield slice(None), proxies
    finally:
        for key, param in row_params:
            setattr(loss, key, param)
