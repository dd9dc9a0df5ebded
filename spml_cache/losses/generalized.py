"""Generalized Robust Loss (Chen et al., IJCAI 2024; docs/losses.md, "Generalized Robust Loss").

On an unobserved entry GR mixes a robust positive loss `L2` and a robust negative loss `L3` by a soft pseudo-label
`k(p) = sigmoid(w p + b)` and weights the mix by `v(p) = exp(-(p - mu)^2 / (2 sigma^2))`; `w, b, mu, sigma` follow
linear schedules over the epochs, so `k` moves from a constant (early: the model knows nothing) to a steep
threshold near `p = -b/w` (late). `k` and `v` are computed from the detached `p`: they calibrate, they are not
trained. Observed positives get `nl(p)` (the paper's `L1` with `q1 -> 0`, as the authors run it); observed
negatives (`z = -1`, partial-label setting only, absent from the paper) get its mirror image `nl(1-p)`.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F

from spml_cache.losses.base import Loss, assign_, register
from spml_cache.losses.terms import Sloped, Terms
from spml_cache.runtime.registry import Param

SCHEDULED = ("w", "b", "mu", "sigma")  # the values the schedules move, from `{key}0` to `{key}T`


@register
class GeneralizedRobust(Loss):
    """GR Loss. Schedules over 1-indexed epochs `e` of `T`, set by `start_epoch`:
    `w(e) = w0 + (wT - w0) max(e-1, 0)/T` (and `b`: the authors' code lags them one epoch),
    `mu(e) = mu0 + (muT - mu0) e/T` (and `sigma`). Before the first `start_epoch` the start values hold."""

    name = "gr"
    display_name = "GR"
    observed_negative = "nl(1-p), never the unknowns' term"
    authors_log_eps = 1e-7  # Chen et al.'s code: -log(p + 1e-7)
    authors_early_stop = ("drop", 2.0)  # Chen et al.: stop once val mAP falls 2 below its best
    authors_defaults = {"wT": 2.0, "bT": -2.0}  # their code's defaults (VOC's); ours without a dataset are COCO's
    description = "generalized robust loss: soft pseudo-label k(p) and weight v(p) on scheduled GCE terms"
    reference = "Chen et al., IJCAI 2024, Sec. 3, eqs. 5-14; appendix E.2, Table 6"
    # Class defaults are the COCO and NUS columns of Table 6 (also a custom dataset's); VOC and CUB differ.
    defaults = {
        "w0": 0.0, "b0": -2.0, "mu0": 0.5, "sigma0": 2.0,
        "wT": 10.0, "bT": -8.0, "muT": 0.8, "sigmaT": 0.5,
        "q2": 0.01, "q3": 1.0,
    }
    per_head = ("w0", "b0", "mu0", "sigma0", "wT", "bT", "muT", "sigmaT", "q2", "q3")
    params = (Param.between("sigma0", 0.0, math.inf, "()"), Param.between("sigmaT", 0.0, math.inf, "()"),
              Param.between("q2", 0.0, math.inf, "()"), Param.between("q3", 0.0, math.inf, "()"))
    dataset_defaults = {
        "voc": {"wT": 2.0, "bT": -2.0},
        "coco": {"wT": 10.0, "bT": -8.0},
        "nus": {"wT": 10.0, "bT": -8.0},
        "cub": {"wT": 10.0, "bT": -8.0, "q3": 1.5},
    }

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        # The scheduled values are buffers that start_epoch refills in place, so that a step captured in one epoch
        # reads the next epoch's values. Where both ends are numbers, a float64 scalar holds the Python float
        # exactly (a 0-dim tensor does not change the logits' dtype); where either end is per head, [K, 1, 1] in
        # the per-head hyperparameters' float32, as the schedule computes it.
        for key in SCHEDULED:
            start, end = getattr(self, f"{key}0"), getattr(self, f"{key}T")
            if isinstance(start, torch.Tensor) or isinstance(end, torch.Tensor):
                value = torch.zeros(self.num_heads, 1, 1)
            else:
                value = torch.zeros((), dtype=torch.float64)
            self.register_buffer(key, assign_(value, start), persistent=False)  # the start values until epoch 1

    def start_epoch(self, epoch, num_epochs, train_logits=None):
        lagged = max(epoch - 1, 0) / num_epochs
        current = epoch / num_epochs
        assign_(self.w, self.w0 + (self.wT - self.w0) * lagged)
        assign_(self.b, self.b0 + (self.bT - self.b0) * lagged)
        assign_(self.mu, self.mu0 + (self.muT - self.mu0) * current)
        assign_(self.sigma, self.sigma0 + (self.sigmaT - self.sigma0) * current)

    def missing(self, x: Terms):
        """`v(p)` and GR's term on a missing label, `v (k L2 + (1 - k) L3)`, for every entry (AEVLP's `gpr` reuses
        both), `L2 = (1 - p^q2)/q2` towards positive and `L3 = (1 - (1-p)^q3)/q3` towards negative (eq. 14, GCE
        losses of a probability given by its log); with `x`'s slopes, the term's slope `v (k dL2 + (1 - k) dL3)`
        (`k`, `v` held fixed, as detached), `dL2 = -p^q2 (1 - p)`, `dL3 = (1 - p)^q3 p`."""
        p = x.logs.p if x.slopes else torch.sigmoid(x.logits.detach())
        k = torch.sigmoid(self.w * p + self.b)  # soft pseudo-label: probability the missing label is positive
        v = torch.exp(-(p - self.mu).square() / (2 * self.sigma**2))
        if x.slopes and x.eps is None:  # the logs' own: -softplus(-x) = logsigmoid(x), -softplus(x), sigmoid(-x)
            log_p, log_1mp, q = -x.logs.nl_p, -x.logs.nl_1mp, -x.logs.d_nl_p
        else:  # exact whatever the fidelity: the authors' eps is in their nl terms alone
            log_p, log_1mp = F.logsigmoid(x.logits), F.logsigmoid(-x.logits)
            q = torch.sigmoid(-x.logits) if x.slopes else None
        power_2, power_3 = torch.expm1(self.q2 * log_p), torch.expm1(self.q3 * log_1mp)  # p^q2 - 1, (1-p)^q3 - 1
        missing = v * (k * (-power_2 / self.q2) + (1 - k) * (-power_3 / self.q3))
        if not x.slopes:
            return v, missing
        return v, Sloped(missing, v * (k * (-(power_2 + 1) * q) + (1 - k) * ((power_3 + 1) * p)))

    def equation(self, x, observed, *, labels=None, index=None):
        _, missing = self.missing(x)
        return x.mean(x.where(observed == 1, x.nl_p, x.where(observed == 0, missing, x.nl_1mp)))
