"""Oracle losses: they read more labels than SPML allows, so they are upper bounds (Cole et al., CVPR 2021, Table 1 top rows).

`labels` are the full ground truth `y` in {0, 1}; `observed` is `z` (1 / 0 / -1). The base class refuses to run
an oracle without `labels`.
"""

from __future__ import annotations

import torch

from spml_cache.losses.base import Loss, as_tensor_like, register
from spml_cache.runtime.registry import Param


@register
class FullBCE(Loss):
    """BCE on every label: `nl(p)` where y=1, `nl(1-p)` where y=0."""

    name = "bce"
    display_name = "BCE"
    observed_negative = "ignored: reads the full label y (0 there)"
    authors_drop_last = True  # Cole et al.'s loaders, train and evaluation alike
    authors_log_eps = 1e-5  # Cole et al.'s code: -log(p + 1e-5)
    description = "Binary cross-entropy on the full labels (all positives and all negatives); an upper bound."
    reference = "Cole et al., CVPR 2021, Eq. 5; Table 1 row L_BCE"
    oracle = True

    def equation(self, x, observed, *, labels=None, index=None):
        return x.mean(x.bce(labels.to(x.dtype)))


@register
class FullBCELabelSmoothing(Loss):
    """BCE on every label with smoothed targets `1 - ls` (y=1) and `ls` (y=0), the reference code's convention."""

    name = "bce_ls"
    display_name = "BCE-LS"
    observed_negative = "ignored: reads the full label y (target ls there)"
    authors_drop_last = True  # Cole et al.'s loaders, train and evaluation alike
    authors_log_eps = 1e-5  # Cole et al.'s code: -log(p + 1e-5)
    description = "BCE on the full labels with label smoothing (targets 1-ls / ls); an upper bound."
    reference = "Cole et al., CVPR 2021, Eq. 5 with the smoothing of Eq. 9; Table 1 row L_BCE-LS"
    defaults = {"ls": 0.1}
    per_head = ("ls",)
    params = (Param.between("ls", 0.0, 1.0, "[)"),)
    oracle = True

    def equation(self, x, observed, *, labels=None, index=None):
        return x.mean(x.bce(self.target(x.logits, labels)))

    def target(self, logits, labels):
        return torch.where(labels == 1, as_tensor_like(1.0 - self.ls, logits), as_tensor_like(self.ls, logits))


@register
class IgnoreUnobservedNegatives(Loss):
    """IUN: the observed positive plus every *true* negative.

    The reference code compares `y == -1` against 0/1 labels, so its IUN never sees a negative; this is the
    loss the paper states (Eq. 7).
    """

    name = "iun"
    display_name = "IUN"
    observed_negative = "nl(1-p) when y = 0, as every true negative"
    authors_drop_last = True  # Cole et al.'s loaders, train and evaluation alike
    authors_log_eps = 1e-5  # Cole et al.'s code: -log(p + 1e-5)
    description = "The observed positive(s) plus all true negatives (1 pos. & all neg.); an upper bound."
    reference = "Cole et al., CVPR 2021, Eq. 7; Table 1 row L_IUN"
    oracle = True

    def equation(self, x, observed, *, labels=None, index=None):
        return x.mean(x.where(observed == 1, x.nl_p, x.where(labels == 0, x.nl_1mp, 0.0)))
