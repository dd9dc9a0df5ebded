"""The terms the losses are written in, each with its slope, and `Terms`: a simple loss written once.

A term is a function of the logit `x` entry by entry (`nl(p)`, `nl(1 - p)`, a BCE, the entropy: docs/losses.md's
notation); its slope is its derivative with respect to `x`. Stage two trains with the slopes (a loss's
`loss_and_grad`: its value and its gradient from one pass, no autograd graph; docs/internals.md, "Closed-form
gradients"); everything else differentiates `forward` by autograd. A simple loss states its value once, in the
building blocks of `Terms` (`Loss.equation`), and the base class evaluates that one expression twice: on plain
tensors for `forward`, on `Sloped` pairs (each block's values with their slopes) for `loss_and_grad`.

Each slope is written as autograd differentiates its term, so that a closed form gives autograd's gradient to
rounding, saturated logits included: `nl(p)` has the slope `-sigmoid(-x)` (torch's logsigmoid backward, exact for
any logit, where `p - 1` rounds to 0 past x ~ 17 in float32), `nl(1 - p) = softplus(x)` the slope `p`, torch's
fused BCE the slope `p - target`, and `sigmoid` the factor `(1 - p) p`.

`eps`: None is the exact math (stable from logits, the package's default); a number is the authors' code's
numerics, -log(q + eps) on float32 probabilities, which saturates: past |x| of about 17 (eps 1e-7) or 12 (1e-5)
the term stops changing and its gradient vanishes (docs/fidelity.md, "Saturation"). Its slope is the chain
through the probability, as their code's autograd takes it.

`nl(p)` is spelled two ways, and both must stay: `neg_log_p` (what `forward` differentiates) is `-logsigmoid(x)`,
`logs_of` (the closed forms') is `softplus(-x)`. They are one function rounded differently where x < 0
(logsigmoid computes `log1p(e^x) - x`, softplus `log1p(e^-x)`); softplus keeps the logits' memory layout, which
stage two's heads' gradient then reads without a copy (logsigmoid's output is always contiguous), and each
spelling keeps the bits its stage has always trained to (stage two's closed forms, stage three's autograd).
tests/test_losses_closed_form.py holds the slopes of the one to autograd of the other.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


def neg_log_p(x: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """nl(p) = -log(sigmoid(x)), stable for any logit; with `eps`, the authors' -log(sigmoid(x) + eps)."""
    if eps is not None:
        return -torch.log(torch.sigmoid(x) + eps)
    return -F.logsigmoid(x)


def neg_log_1mp(x: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """nl(1 - p) = -log(1 - sigmoid(x)) = log(1 + e^x), stable for any logit (one op: steps run ~100 of them);
    with `eps`, the authors' -log(1 - sigmoid(x) + eps)."""
    if eps is not None:
        return -torch.log(1 - torch.sigmoid(x) + eps)
    return F.softplus(x)


def bce(x: torch.Tensor, target: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """Per-entry binary cross-entropy of logits `x` against a (soft) target in [0, 1] (broadcast to `x`):
    `target * nl(p) + (1 - target) * nl(1 - p)`, as torch's one fused op (differentiable in the target too)."""
    if eps is not None:
        return target * neg_log_p(x, eps) + (1 - target) * neg_log_1mp(x, eps)
    x, target = torch.broadcast_tensors(x, target)
    return F.binary_cross_entropy_with_logits(x, target, reduction="none")


def entropy(x: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """H(p) = -p log p - (1 - p) log(1 - p) of p = sigmoid(x), from logits (finite for any logit)."""
    return bce(x, torch.sigmoid(x), eps)


def mean_over_entries(terms: torch.Tensor) -> torch.Tensor:
    """The reference reduction: sum of a `[..., B, C]` term matrix over (B, C), divided by B*C (one op: torch's
    mean is that sum and division on the CPU, bit for bit)."""
    return terms.mean(dim=(-2, -1))


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


def logs_of(x: torch.Tensor, eps: float | None = None, p: torch.Tensor | None = None) -> Logs:
    """Both logs of `x` and their slopes: `-sigmoid(-x)` and `p`; with `eps`, -(1 - p) p / (p + eps) and
    (1 - p) p / (1 - p + eps). Without `eps`, nl(p) is `softplus(-x)` (the module's docstring says why not
    `neg_log_p`'s -logsigmoid(x)); with it, the terms are computed from one `p` as `neg_log_p(x, eps)` computes them.
    `p`: sigmoid(x), where the caller has it."""
    p = torch.sigmoid(x) if p is None else p
    if eps is None:
        minus_x = -x
        return Logs(p, F.softplus(minus_x), F.softplus(x), -torch.sigmoid(minus_x), p, minus_x)
    shifted_p, shifted_1mp, slope = p + eps, 1 - p + eps, sigmoid_slope(p)
    return Logs(p, -torch.log(shifted_p), -torch.log(shifted_1mp), -slope / shifted_p, slope / shifted_1mp)


def bce_terms(x: torch.Tensor, target, eps: float | None = None, logs: Logs | torch.Tensor | None = None):
    """bce(x, target) and its slope, for a target that does not depend on `x`: `p - target` (torch's fused BCE
    backward); with `eps`, the slopes of its two logs weighted by the target. `logs`: `logs_of(x, eps)` if the
    caller has them (without `eps`, `p` alone will do)."""
    if eps is None:
        p = torch.sigmoid(x) if logs is None else logs if isinstance(logs, torch.Tensor) else logs.p
        return bce(x, target), p - target
    logs = logs_of(x, eps) if logs is None else logs
    return target * logs.nl_p + (1 - target) * logs.nl_1mp, target * logs.d_nl_p + (1 - target) * logs.d_nl_1mp


def entropy_terms(x: torch.Tensor, logs: Logs, eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """H(p) = bce(x, p) (`entropy`) and its slope: `-x (1 - p) p`, its target's own (the fused BCE's `p - target`
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


class Sloped:
    """A term's values with their slopes (for a value per image or per head: its gradient with respect to the
    logits), combined as the values are: `+` adds both, a weight that does not depend on the logits (a number, a
    mask, a per-head tensor) multiplies both, `Terms.where` chooses both. Unpacks as `value, slope`."""

    __slots__ = ("value", "slope")

    def __init__(self, value: torch.Tensor, slope: torch.Tensor) -> None:
        self.value, self.slope = value, slope

    def __iter__(self):
        return iter((self.value, self.slope))

    def __add__(self, other: "Sloped") -> "Sloped":
        return Sloped(self.value + other.value, self.slope + other.slope)

    # each side in the order written: a product's bits do not depend on it, its output's memory layout may
    def __mul__(self, weight) -> "Sloped":
        return Sloped(self.value * weight, self.slope * weight)

    def __rmul__(self, weight) -> "Sloped":
        return Sloped(weight * self.value, weight * self.slope)


class Terms:
    """The building blocks a simple loss's `equation` is written in, over one batch's logits `x` (`[..., B, C]`):
    each block is a tensor of its values (`slopes=False`: `forward`, which autograd differentiates) or a `Sloped`
    pair of its values and slopes (`slopes=True`: `loss_and_grad`, stage two's closed form). Combine blocks with
    `+` and weights, choose between them with `where` (or `known_or`), reduce with `mean` (or `per_image_mean`).

    With slopes, what several blocks share (`p`, the logs) is made once. Without, `nl_p` and `nl_1mp` are made
    once and every other block makes its own ops, as the losses' `forward`s always did (autograd then sums the
    same gradients in the same order: stage three's bits)."""

    def __init__(self, logits: torch.Tensor, eps: float | None = None, *, slopes: bool = False) -> None:
        self.logits, self.eps, self.slopes = logits, eps, slopes
        self._logs: Logs | None = None
        self._p: torch.Tensor | None = None
        self._nl: dict[str, torch.Tensor] = {}  # without slopes: neg_log_p's and neg_log_1mp's

    @property
    def dtype(self) -> torch.dtype:
        return self.logits.dtype

    @property
    def exact(self) -> "Terms":
        """These logits without the authors' eps: for the terms a loss computes stably from logits in either
        fidelity."""
        return self if self.eps is None else Terms(self.logits, slopes=self.slopes)

    @property
    def logs(self) -> Logs:
        """`logs_of(x, eps)`, made once (for blocks that read the logs' parts directly)."""
        if self._logs is None:
            self._logs = logs_of(self.logits, self.eps, self._p)
        return self._logs

    @property
    def p(self) -> torch.Tensor:
        """sigmoid(x), a tensor in both modes (a block's weight, or an input of one)."""
        if not self.slopes:
            return torch.sigmoid(self.logits)
        if self._logs is not None:
            return self._logs.p
        if self._p is None:
            self._p = torch.sigmoid(self.logits)
        return self._p

    @property
    def nl_p(self):
        """nl(p) = -log p, with its slope `-sigmoid(-x)`."""
        return Sloped(self.logs.nl_p, self.logs.d_nl_p) if self.slopes else self._made_once(neg_log_p)

    @property
    def nl_1mp(self):
        """nl(1 - p) = -log(1 - p), with its slope `p`."""
        return Sloped(self.logs.nl_1mp, self.logs.d_nl_1mp) if self.slopes else self._made_once(neg_log_1mp)

    def _made_once(self, term) -> torch.Tensor:
        if term.__name__ not in self._nl:
            self._nl[term.__name__] = term(self.logits, self.eps)
        return self._nl[term.__name__]

    def bce(self, target: torch.Tensor):
        """BCE(x, target) = target nl(p) + (1 - target) nl(1 - p), for a (soft) target that does not depend on the
        logits, with its slope `p - target`."""
        if not self.slopes:
            return bce(self.logits, target, self.eps)
        return Sloped(*bce_terms(self.logits, target, self.eps, self.p if self.eps is None else self.logs))

    @property
    def entropy(self):
        """H(p), with its slope `-x (1 - p) p`."""
        if not self.slopes:
            return entropy(self.logits, self.eps)
        return Sloped(*entropy_terms(self.logits, self.logs, self.eps))

    def where(self, condition: torch.Tensor, chosen, other):
        """`chosen` where `condition`, else `other` (blocks, or a number: a constant term, whose slope is 0)."""
        if not self.slopes:
            return torch.where(condition, chosen, other)
        chosen, other = (_sloped(term) for term in (chosen, other))
        return Sloped(torch.where(condition, chosen.value, other.value),
                      torch.where(condition, chosen.slope, other.slope))

    def known_or(self, observed: torch.Tensor, unobserved):
        """`nl(p)` on observed positives, `nl(1 - p)` on observed negatives, `unobserved` on the unobserved entries."""
        return self.where(observed == 0, unobserved, self.where(observed == 1, self.nl_p, self.nl_1mp))

    def mean(self, terms):
        """The loss every built-in takes of its `[..., B, C]` terms: their sum over B*C (`mean_over_entries`), per
        head; with slopes, its gradient (`reduced`)."""
        return Sloped(*reduced(terms.value, terms.slope)) if self.slopes else mean_over_entries(terms)

    def per_image_mean(self, values):
        """Values of one term per image `[..., B]` (with slopes: their gradient `[..., B, C]`) reduced as every loss:
        their sum over B*C."""
        num_entries = self.logits.shape[-2] * self.logits.shape[-1]
        if not self.slopes:
            return values.sum(dim=-1) / num_entries
        return Sloped(values.value.sum(dim=-1) / num_entries, values.slope / num_entries)


def _sloped(term) -> Sloped:
    if isinstance(term, Sloped):
        return term
    if isinstance(term, (int, float)):
        return Sloped(term, 0.0)
    raise TypeError(f"Terms.where takes blocks of Terms (or a number), got {type(term).__name__}: write each term"
                    " of an equation from the blocks of its Terms (x.nl_p, x.bce(target), ...), weighted by numbers"
                    " or tensors that do not depend on the logits")
