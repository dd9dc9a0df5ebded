"""Robust losses on assumed negatives: focal, ASL, Hill, SPLC (docs/losses.md, "Robust-loss family").

Each is a weighted form of `an`: a focusing weight that shrinks the term of an entry the model already gets
right (focal, ASL), a margin on positives (Hill, SPLC), a bounded hill-shaped negative term (Hill), or online
correction of confident assumed negatives (SPLC). The focusing weights are *not* detached, as in the authors'
plain classes, so they take part in the gradient. Observed negatives (`z = -1`, partial-label setting only)
get the same negative term as assumed negatives; SPLC never flips them.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F

from spml_cache.losses.base import Fidelity, Loss, mean_over_entries, neg_log_1mp, neg_log_p, register
from spml_cache.losses.terms import Sloped, Terms, focal_terms, power_slope, reduced, sigmoid_slope
from spml_cache.runtime.registry import Param


def focal_positive(x: torch.Tensor, g: float) -> torch.Tensor:
    """(1 - p)^g nl(p), the weight written as exp(g log(1 - p)) so that it stays finite for any logit."""
    return torch.exp(g * F.logsigmoid(-x)) * neg_log_p(x)


def focal_negative(x: torch.Tensor, g: float) -> torch.Tensor:
    """p^g nl(1 - p)."""
    return torch.exp(g * F.logsigmoid(x)) * neg_log_1mp(x)


def focal(x: Terms, positive: torch.Tensor, g):
    """The focal positive term `(1-p)^g nl(p)` where `positive`, the focal negative `p^g nl(1-p)` elsewhere; with
    `x`'s slopes, from one evaluation: the negative term at x is the positive one at -x (`focal_terms`)."""
    if not x.slopes:
        return torch.where(positive, focal_positive(x.logits, g), focal_negative(x.logits, g))
    sign = positive * 2.0 - 1.0  # +-1 in 3 ops (a where of two numbers makes each a tensor)
    terms, slopes = focal_terms(sign * x.logits, g)
    return Sloped(terms, sign * slopes)


@register
class Focal(Loss):
    """Focal loss (Lin et al. 2017) under the assume-negative reading: `(1-p)^g nl(p)` on observed
    positives, `p^g nl(1-p)` elsewhere; `g = 0` is `an`."""

    name = "focal"
    display_name = "Focal"
    observed_negative = "p^g nl(1-p), as an assumed negative"
    description = "focal loss on AN targets: (1-p)^g nl(p) on positives, p^g nl(1-p) on the rest"
    reference = "Lin et al., ICCV 2017; baseline of Zhou et al., ECCV 2022, Sec. 4.1 and Table 1; Chen et al., Table 2"
    defaults = {"g": 2.0}
    per_head = ("g",)
    params = (Param.between("g", 0.0, math.inf, "[)"),)

    def equation(self, x, observed, *, labels=None, index=None):
        return x.mean(focal(x, observed == 1, self.g))


ASL_LOG_FLOOR = 1e-8  # what the ASL authors' code clamps probabilities to before a log


@register
class AsymmetricLoss(Loss):
    """ASL (Ridnik et al. 2021): `(1-p)^gp nl(p)` on observed positives; on the rest the shifted probability
    `pm = max(p - clip, 0)` gives `pm^gn nl(1 - pm)`, so easy negatives (`p <= clip`) cost nothing."""

    name = "asl"
    display_name = "ASL"
    observed_negative = "the shifted negative term, as an assumed negative"
    description = "asymmetric loss: focusing gp on positives, gn and probability shift clip on negatives"
    reference = "Ridnik et al., ICCV 2021; baseline of Zhou et al., ECCV 2022, Sec. 4.1 and Table 1"
    defaults = {"gp": 0.0, "gn": 4.0, "clip": 0.05}
    per_head = ("gp", "gn")
    params = (Param.between("gp", 0.0, math.inf, "[)"), Param.between("gn", 0.0, math.inf, "[)"),
              Param.between("clip", 0.0, 1.0, "[)"))

    def forward(self, logits, observed, *, labels=None, index=None):
        positive = focal_positive(logits, self.gp)
        if self.fidelity is Fidelity.AUTHORS:  # Ridnik et al.'s code: log(p.clamp(min=1e-8)), flat below p = 1e-8
            p = torch.sigmoid(logits)
            positive = (1 - p).pow(self.gp) * -torch.log(p.clamp(min=ASL_LOG_FLOOR))
        if self.clip > 0:
            # 1 - pm = min(1 - p + clip, 1) >= clip: its log needs no logsigmoid
            shifted = (torch.sigmoid(logits) - self.clip).clamp(min=0)
            nl_1m_shifted = -torch.log((torch.sigmoid(-logits) + self.clip).clamp(max=1))
            # pm^gn with 0^gn taken as the limit (0, or 1 when gn = 0), never differentiating pow at 0
            nonzero = shifted > 0
            weight = torch.where(nonzero, torch.where(nonzero, shifted, 1.0).pow(self.gn), 0.0**self.gn)
            negative = weight * nl_1m_shifted
        else:
            negative = focal_negative(logits, self.gn)
        return mean_over_entries(torch.where(observed == 1, positive, negative))

    def loss_and_grad(self, logits, observed, *, labels=None, index=None):
        p = torch.sigmoid(logits)
        positive = self._clamped_positive(p) if self.fidelity is Fidelity.AUTHORS else focal_terms(logits, self.gp)
        if self.clip > 0:
            negative = self._shifted_negative(p, torch.sigmoid(-logits))
        else:
            negative = focal_terms(-logits, self.gn)
            negative = (negative[0], -negative[1])
        chosen = observed == 1
        return reduced(*(torch.where(chosen, pos, neg) for pos, neg in zip(positive, negative)))

    def _clamped_positive(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(1-p)^gp * -log(max(p, 1e-8))` and its slope (0 below the floor, as the clamp passes none)."""
        base, floor, slope = 1 - p, p.clamp(min=ASL_LOG_FLOOR), sigmoid_slope(p)
        weight, nl = base.pow(self.gp), -torch.log(floor)
        d_nl = torch.where(p >= ASL_LOG_FLOOR, -slope / floor, 0.0)
        return weight * nl, -power_slope(base, self.gp) * slope * nl + weight * d_nl

    def _shifted_negative(self, p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`pm^gn nl(1 - pm)` with `pm = max(p - clip, 0)`, as `forward` computes it, and its slope."""
        shifted, complement = (p - self.clip).clamp(min=0), (q + self.clip).clamp(max=1)
        nonzero = shifted > 0
        base = torch.where(nonzero, shifted, 1.0)
        weight, nl = torch.where(nonzero, base.pow(self.gn), 0.0**self.gn), -torch.log(complement)
        d_weight = torch.where(nonzero, power_slope(base, self.gn) * sigmoid_slope(p), 0.0)
        d_nl = torch.where(q + self.clip <= 1, sigmoid_slope(q) / complement, 0.0)
        return weight * nl, d_weight * nl + weight * d_nl


@register
class Hill(Loss):
    """Hill loss (Zhang et al. 2021): focal margin `(1-pm)^g nl(pm)`, `pm = sigmoid(x - m)`, on observed
    positives; `(lam - p) p^2` on the rest, a bounded term whose gradient vanishes at p = 0 and p = 1, so a
    confident false negative is not pushed down."""

    name = "hill"
    display_name = "Hill"
    observed_negative = "the hill-shaped negative term, as an assumed negative"
    description = "Hill loss: focal margin on positives, (lam - p) p^2 on assumed negatives"
    reference = "Zhang et al. 2021, as restated in Chen et al., IJCAI 2024, appendix B eq. 24, C.3; Table 2"
    defaults = {"lam": 1.5, "m": 1.0, "g": 2.0}
    per_head = ("lam", "m", "g")
    params = (Param.between("g", 0.0, math.inf, "[)"),)

    def forward(self, logits, observed, *, labels=None, index=None):
        p = torch.sigmoid(logits)
        positive = focal_positive(logits - self.m, self.g)
        negative = (self.lam - p) * p.square()
        return mean_over_entries(torch.where(observed == 1, positive, negative))

    def loss_and_grad(self, logits, observed, *, labels=None, index=None):
        p, (positive, d_positive) = torch.sigmoid(logits), focal_terms(logits - self.m, self.g)
        remaining, square = self.lam - p, p.square()
        value, d_positive = reduced(torch.where(observed == 1, positive, remaining * square), d_positive)
        # d/dp of (lam - p) p^2 is 2 p (lam - p) - p^2, two near-equal terms near p = 1: taken at the gradient's
        # scale 1/(B*C) first, as autograd takes it, so that the difference rounds alike
        scale = 1 / (logits.shape[-2] * logits.shape[-1])
        d_negative = ((scale * remaining) * (2 * p) - scale * square) * (1 - p) * p
        return value, torch.where(observed == 1, d_positive, d_negative)


@register
class SPLC(Loss):
    """Focal margin + Self-Paced Loss Correction (Zhang et al. 2021).

    Observed positives: focal margin as `hill`. Unobserved entries: the focal negative `p^g nl(1-p)`; from
    epoch `switch_epoch` on, every batch re-decides which unobserved entries have `p > tau` and gives those
    the focal positive term `(1-p)^g nl(p)` (no margin) instead. Nothing is remembered between batches.
    """

    name = "splc"
    display_name = "SPLC"
    observed_negative = "p^g nl(1-p), never corrected to a positive"
    description = "focal margin + self-paced correction: unobserved entries with p > tau count as positives from epoch 2"
    reference = "Zhang et al. 2021, as restated in Chen et al., IJCAI 2024, appendix B (SPLC, focal margin); Table 2"
    defaults = {"tau": 0.6, "m": 1.0, "g": 2.0}
    per_head = ("tau", "m", "g")
    params = (Param.between("tau", 0.0, 1.0, "()"), Param.between("g", 0.0, math.inf, "[)"))
    switch_epoch = 2

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        # whether the correction is on: a buffer, not a Python branch, so one captured step serves every epoch
        self.register_buffer("correcting", torch.tensor(False), persistent=False)  # off before the first epoch

    def start_epoch(self, epoch, num_epochs, train_logits=None):
        self.correcting.fill_(epoch >= self.switch_epoch)

    def forward(self, logits, observed, *, labels=None, index=None):
        pseudo_positive = (observed == 0) & (torch.sigmoid(logits.detach()) > self.tau) & self.correcting
        negative = torch.where(pseudo_positive, focal_positive(logits, self.g), focal_negative(logits, self.g))
        positive = focal_positive(logits - self.m, self.g)
        return mean_over_entries(torch.where(observed == 1, positive, negative))

    def loss_and_grad(self, logits, observed, *, labels=None, index=None):
        # one focal term at u: the margin's x - m on positives, x on pseudo-positives, -x on the negatives
        positive, pseudo_positive = observed == 1, (observed == 0) & (torch.sigmoid(logits) > self.tau) & self.correcting
        u = torch.where(positive, logits - self.m, torch.where(pseudo_positive, logits, -logits))
        sign = torch.where(positive | pseudo_positive, 1.0, -1.0)
        terms, slopes = focal_terms(u, self.g)
        return reduced(terms, sign * slopes)
