"""The assume-negative family: every label that is not an observed positive is treated as a negative.

Seed 002 (Cole et al.) writes these with `1[z != 1]`, so an observed negative (`z = -1`, partial-label setting
only) gets the negative term of an unobserved label. Where a loss softens that term because an assumed negative
may be a missed positive, a known 0 keeps the plain `nl(1 - p)`: `wan` does not down-weight it, `an_ls_neg` does
not smooth it, `entmin` gives it no entropy term.
"""

from __future__ import annotations

import math
import torch

from spml_cache.runtime.errors import SpmlError
from spml_cache.losses.base import Loss, as_tensor_like, head_vector, mean_over_entries, register
from spml_cache.losses.terms import reduced
from spml_cache.runtime.registry import Param


@register
class AssumeNegative(Loss):
    """AN: `nl(p)` on observed positives, `nl(1-p)` on everything else."""

    name = "an"
    display_name = "AN"
    observed_negative = "nl(1-p), as an assumed negative"
    authors_drop_last = True  # Cole et al.'s loaders, train and evaluation alike
    authors_log_eps = 1e-5  # Cole et al.'s code: -log(p + 1e-5)
    description = "Assume negative: every label that is not the observed positive is a negative."
    reference = "Cole et al., CVPR 2021, Eq. 8; Table 1 row L_AN (Zhou et al., Eq. 1)"

    def equation(self, x, observed, *, labels=None, index=None):
        # nl(p) where z = 1 and nl(1 - p) elsewhere: BCE against the target 1[z = 1], as one fused op
        return x.mean(x.bce((observed == 1).to(x.dtype)))


def _smoothed_target(logits: torch.Tensor, observed: torch.Tensor, positive_target, negative_target) -> torch.Tensor:
    return torch.where(observed == 1, as_tensor_like(positive_target, logits), as_tensor_like(negative_target, logits))


@register
class AssumeNegativeLabelSmoothing(Loss):
    """AN-LS: AN with targets `1 - ls` (positives) and `ls` (assumed negatives)."""

    name = "an_ls"
    display_name = "AN-LS"
    observed_negative = "target ls, as every negative (both sides smoothed)"
    authors_drop_last = True  # Cole et al.'s loaders, train and evaluation alike
    authors_log_eps = 1e-5  # Cole et al.'s code: -log(p + 1e-5)
    description = "Assume negative with label smoothing on both sides (targets 1-ls / ls)."
    reference = "Cole et al., CVPR 2021, Eq. 9; Table 1 row L_AN-LS (Zhou et al., Table 1 row LS)"
    defaults = {"ls": 0.1}
    per_head = ("ls",)
    params = (Param.between("ls", 0.0, 1.0, "[)"),)

    def equation(self, x, observed, *, labels=None, index=None):
        return x.mean(x.bce(_smoothed_target(x.logits, observed, 1.0 - self.ls, self.ls)))


@register
class AssumeNegativeSmoothNegatives(Loss):
    """AN-LS(0, ls): the positive target stays 1, assumed negatives get target `ls`."""

    name = "an_ls_neg"
    display_name = "N-LS"
    observed_negative = "nl(1-p): a known 0 is not smoothed"
    authors_log_eps = 1e-5  # Zhou et al.'s code: -log(p + 1e-5)
    description = "Assume negative with label smoothing on the assumed negatives only (targets 1 / ls)."
    reference = "Cole et al., CVPR 2021, appendix A, AN-LS(eps_p=0, eps_n) and Table A1 (Zhou et al., Table 1 row N-LS)"
    defaults = {"ls": 0.1}
    per_head = ("ls",)
    params = (Param.between("ls", 0.0, 1.0, "[)"),)

    def equation(self, x, observed, *, labels=None, index=None):
        smoothed = x.bce(_smoothed_target(x.logits, observed, 1.0, self.ls))
        return x.mean(x.where(observed == -1, x.nl_1mp, smoothed))


@register
class WeakAssumeNegative(Loss):
    """WAN: assumed negatives weighted by `gamma`, by default `1/(C-1)` (one positive weighs as much as the rest)."""

    name = "wan"
    display_name = "WAN"
    observed_negative = "nl(1-p) with weight 1 (gamma weighs assumed negatives only)"
    authors_drop_last = True  # Cole et al.'s loaders, train and evaluation alike
    authors_log_eps = 1e-5  # Cole et al.'s code: -log(p + 1e-5)
    description = "Weak assume negative: assumed negatives down-weighted by gamma."
    reference = "Cole et al., CVPR 2021, Sec. 5.1 (L_WAN); Table 1 row L_WAN (Zhou et al., Table 1 row DW)"
    defaults = {"gamma": None}
    derived = {"gamma": "1/(C-1)"}
    per_head = ("gamma",)
    params = (Param.between("gamma", 0.0, math.inf, "()"),)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.gamma is None:
            if self.num_classes < 2:
                raise SpmlError("loss 'wan': gamma=1/(C-1) needs at least 2 classes; pass --hp gamma=VALUE")
            self.set_hparam("gamma", 1.0 / (self.num_classes - 1))

    def equation(self, x, observed, *, labels=None, index=None):
        weight = torch.where(observed == -1, 1.0, as_tensor_like(self.gamma, x.logits))  # a known 0 weighs 1
        return x.mean(x.where(observed == 1, x.nl_p, weight * x.nl_1mp))


@register
class AssumeNegativeL1(AssumeNegative):
    """AN plus `lam * ||W||_1` on the linear head's weight (the trainer adds `penalty`)."""

    name = "l1r"
    display_name = "L1R"
    observed_negative = "nl(1-p), as an assumed negative"
    authors_drop_last = False  # run with Zhou et al.'s code, whose loaders keep it
    authors_log_eps = 1e-5  # Zhou et al.'s code: -log(p + 1e-5)
    description = "Assume negative plus an L1 penalty lam*||W||_1 on the linear head's weight (not the bias)."
    reference = "Zhou et al., ECCV 2022, Sec. 4.1 'Comparing Methods' and Table 1 row L1R"
    defaults = {"lam": 1e-4}
    penalises_weight = True
    per_head = ("lam",)
    params = (Param.between("lam", 0.0, math.inf, "[)"),)

    def penalty(self, weight: torch.Tensor) -> torch.Tensor:
        return head_vector(self.lam) * weight.abs().sum(dim=(-2, -1))

    def penalty_and_grad(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.penalty(weight), self.lam * weight.sign()


@register
class AssumeNegativeL2(AssumeNegative):
    """AN plus `lam / 2 * ||W||_2^2` on the linear head's weight (the trainer adds `penalty`)."""

    name = "l2r"
    display_name = "L2R"
    observed_negative = "nl(1-p), as an assumed negative"
    authors_drop_last = False  # run with Zhou et al.'s code, whose loaders keep it
    authors_log_eps = 1e-5  # Zhou et al.'s code: -log(p + 1e-5)
    description = "Assume negative plus an L2 penalty lam/2*||W||^2 on the linear head's weight (not the bias)."
    reference = "Zhou et al., ECCV 2022, Sec. 4.1 'Comparing Methods' and Table 1 row L2R"
    defaults = {"lam": 1e-4}
    penalises_weight = True
    per_head = ("lam",)
    params = (Param.between("lam", 0.0, math.inf, "[)"),)

    def penalty(self, weight: torch.Tensor) -> torch.Tensor:
        return 0.5 * head_vector(self.lam) * weight.square().sum(dim=(-2, -1))

    def penalty_and_grad(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.penalty(weight), self.lam * weight


@register
class EntropyMinimization(Loss):
    """EntMin: `nl(p)` on positives, `+alpha * H(p)` on unobserved labels; collapses to "all positive"."""

    name = "entmin"
    display_name = "EntMin"
    observed_negative = "nl(1-p), never the entropy term"
    authors_log_eps = 1e-5  # Zhou et al.'s code: -log(p + 1e-5)
    description = "Entropy minimisation on unobserved labels (the mirror image of em); a baseline that collapses."
    reference = "Zhou et al., ECCV 2022, Sec. 4.1 'Comparing Methods' and Table 1 row EntMin"
    defaults = {"alpha": 0.1}
    per_head = ("alpha",)
    params = (Param.between("alpha", 0.0, math.inf, "[)"),)

    def equation(self, x, observed, *, labels=None, index=None):
        return x.mean(x.known_or(observed, self.alpha * x.entropy))


@register
class PairwiseRanking(Loss):
    """PR: for each observed positive i, entry (n, i) = sum over assumed negatives j of max(0, 1 - p_ni + p_nj)."""

    name = "pr"
    display_name = "PR"
    observed_negative = "a negative of every pair, as an assumed negative"
    authors_drop_last = True  # Cole et al.'s loaders, train and evaluation alike
    needs_positive = True  # an image without an observed positive has no pair: it gives no term
    description = "Pairwise ranking hinge on probabilities: each observed positive above every assumed negative."
    reference = "Cole et al., CVPR 2021, appendix A, L_PR and Table A1"

    def forward(self, logits, observed, *, labels=None, index=None):
        return mean_over_entries(self.pairs(torch.sigmoid(logits), observed)[0])

    @staticmethod
    def pairs(p: torch.Tensor, observed: torch.Tensor, q: torch.Tensor | None = None):
        """The terms `[..., B, C]`, and which pairs (i, j) count with a hinge above 0 `[..., B, C, C]`; `q`:
        `1 - p`, if the caller has it."""
        positive = observed == 1
        # hinge[..., n, i, j] = max(0, 1 - p_ni + p_nj); only pairs (observed positive i, assumed negative j) count
        q = 1.0 - p if q is None else q
        hinge = torch.relu(q.unsqueeze(-1) + p.unsqueeze(-2))
        pairs = positive.unsqueeze(-1) & ~positive.unsqueeze(-2)
        counted = hinge * pairs  # hinge >= 0 (or NaN): above 0 exactly where a pair counts with a hinge above 0
        return counted.sum(dim=-1), counted > 0

    def loss_and_grad(self, logits, observed, *, labels=None, index=None):
        p = torch.sigmoid(logits)
        q = 1.0 - p  # the hinge's and sigmoid_slope's (1 - p), made once
        terms, active = self.pairs(p, observed, q)
        # d/dp: +1 for each active pair an entry is the negative j of, -1 for each it is the positive i of;
        # dp/dx = (1 - p) p (sigmoid_slope)
        return reduced(terms, (active.sum(dim=-2) - active.sum(dim=-1)) * (q * p))
