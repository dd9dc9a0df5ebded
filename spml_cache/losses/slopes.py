"""Closed-form gradients: base.py's terms with their derivatives with respect to the logit `x` ("slopes"), for the
losses that state their gradient (`Loss.loss_and_grad`), so that a training step computes the value and the
gradient in one pass and builds no autograd graph (docs/internals.md, "Closed-form gradients").

Each slope is written as autograd differentiates its term, so that a closed form gives autograd's gradient to
rounding, saturated logits included: `nl(p) = -logsigmoid(x)` has the slope `-sigmoid(-x)` (torch's logsigmoid
backward, exact for any logit, where `p - 1` rounds to 0 past x ~ 17 in float32), `nl(1 - p) = softplus(x)` the
slope `p`, torch's fused BCE the slope `p - target`, and `sigmoid` the factor `(1 - p) p`. With `eps` (the
authors' `-log(q + eps)`, docs/fidelity.md) the slope is the chain through the probability, as their code's
autograd takes it, and the terms are computed from one `p` as base.py's `neg_log_p(x, eps)` computes them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from spml_cache.losses.base import bce, mean_over_entries


class Logs(NamedTuple):
    """`p = sigmoid(x)`, `nl(p)` and `nl(1 - p)`, and their slopes `d_nl_p`, `d_nl_1mp`."""

    p: torch.Tensor
    nl_p: torch.Tensor
    nl_1mp: torch.Tensor
    d_nl_p: torch.Tensor
    d_nl_1mp: torch.Tensor
    minus_x: torch.Tensor | None = None  # `-x`, where the logs were made from it (without eps): reused, not redone


def sigmoid_slope(p: torch.Tensor) -> torch.Tensor:
    """dp/dx = (1 - p) p, as torch's sigmoid backward computes it."""
    return (1 - p) * p


def logs_of(x: torch.Tensor, eps: float | None = None) -> Logs:
    """Both logs of `x` and their slopes: `-sigmoid(-x)` and `p`; with `eps`, -(1 - p) p / (p + eps) and
    (1 - p) p / (1 - p + eps)."""
    p = torch.sigmoid(x)
    if eps is None:  # nl(p) = softplus(-x) = -logsigmoid(x): softplus keeps the logits' memory layout, which the
        minus_x = -x  # heads' gradient then reads without a copy (logsigmoid's output is always contiguous)
        return Logs(p, F.softplus(minus_x), F.softplus(x), -torch.sigmoid(minus_x), p, minus_x)
    shifted_p, shifted_1mp, slope = p + eps, 1 - p + eps, sigmoid_slope(p)
    return Logs(p, -torch.log(shifted_p), -torch.log(shifted_1mp), -slope / shifted_p, slope / shifted_1mp)


def bce_terms(x: torch.Tensor, target, eps: float | None = None, logs: Logs | torch.Tensor | None = None):
    """bce(x, target) (base.py) and its slope, for a target that does not depend on `x`: `p - target` (torch's fused
    BCE backward); with `eps`, the slopes of its two logs weighted by the target. `logs`: `logs_of(x, eps)` if the
    caller has them (without `eps`, `p` alone will do)."""
    if eps is None:
        p = torch.sigmoid(x) if logs is None else logs if isinstance(logs, torch.Tensor) else logs.p
        return bce(x, target), p - target
    logs = logs_of(x, eps) if logs is None else logs
    return target * logs.nl_p + (1 - target) * logs.nl_1mp, target * logs.d_nl_p + (1 - target) * logs.d_nl_1mp


def entropy_terms(x: torch.Tensor, logs: Logs, eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """H(p) = bce(x, p) (base.entropy) and its slope: `-x (1 - p) p`, its target's own (the fused BCE's `p - target`
    is 0 there); with `eps`, (1 - p) p [nl(p) - nl(1 - p)] plus each log's slope weighted by its probability."""
    p = logs.p
    if eps is None:
        return bce(x, p), (-x if logs.minus_x is None else logs.minus_x) * sigmoid_slope(p)
    value = p * logs.nl_p + (1 - p) * logs.nl_1mp
    return value, sigmoid_slope(p) * (logs.nl_p - logs.nl_1mp) + p * logs.d_nl_p + (1 - p) * logs.d_nl_1mp


def focal_terms(u: torch.Tensor, g) -> tuple[torch.Tensor, torch.Tensor]:
    """The focal positive term `(1 - p)^g nl(p)` at logit `u` (robust.focal_positive) and its slope with respect
    to `u`, `-(1 - p)^g [g p nl(p) + (1 - p)]` (autograd's chain through the weight, which is not detached). The
    focal negative term at `x` is the positive one at `-x`, so one evaluation serves both sides of a loss."""
    minus_u = -u
    nl_p = F.softplus(minus_u)  # -logsigmoid(u), in the logits' memory layout (as `logs_of`)
    weight = torch.exp(-g * F.softplus(u))  # (1 - p)^g = e^(g log(1 - p))
    return weight * nl_p, -weight * (g * torch.sigmoid(u) * nl_p + torch.sigmoid(minus_u))


def power_slope(base: torch.Tensor, exponent) -> torch.Tensor:
    """d base^exponent / d base as autograd takes it: 0 where the exponent is 0 (never 0 * inf at a 0 base)."""
    if isinstance(exponent, torch.Tensor):
        return torch.where(exponent == 0, 0.0, exponent * base.pow(exponent - 1))
    return exponent * base.pow(exponent - 1) if exponent != 0 else torch.zeros_like(base)


def reduced(terms: torch.Tensor, slopes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A `[..., B, C]` term matrix and its slopes as the loss's value (`mean_over_entries`) and gradient: the slopes
    times 1/(B*C), the factor autograd's mean hands down (a division would round otherwise), so that a loss whose
    slope is one term's (`an`, `bce`, the smoothed ones, `epr`) gets autograd's gradient bit for bit."""
    return mean_over_entries(terms), slopes * (1 / (terms.shape[-2] * terms.shape[-1]))
