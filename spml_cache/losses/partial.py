"""Partial-label baselines: losses that learn from the observed entries alone (docs/losses.md, "Partial-label
family"). With `single` they see one positive per image and nothing else, so they collapse towards "all
positive"; they are meant for rules that observe negatives too (`entry:P`, `uniform:pos=K,neg=M`, ...).
"""

from __future__ import annotations

from spml_cache.losses.base import Loss, register


@register
class ObservedBCE(Loss):
    """BCE on observed entries: `nl(p)` where z = 1, `nl(1-p)` where z = -1, nothing where z = 0."""

    name = "bce_observed"
    display_name = "Partial BCE"
    observed_negative = "nl(1-p)"
    description = "BCE on the observed entries only (positives and negatives); an unknown label gives no term."
    reference = ("Durand et al., CVPR 2019, Sec. 3.1: BCE over the known labels (its partial-BCE normalisation g"
                 " not applied: the house reduction sum / (B*C))")

    def equation(self, x, observed, *, labels=None, index=None):
        return x.mean(x.bce((observed == 1).to(x.dtype)) * (observed != 0))
