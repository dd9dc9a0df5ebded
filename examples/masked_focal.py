"""A masked focal loss for single-positive labels: not in spml-cache, a worked example of bringing your own
(docs/your-own-loss.md). Focal terms (Lin et al., ICCV 2017) on the observed positive and on the assumed
negatives; an assumed negative (z = 0) weighs w, a known negative (z = -1) weighs 1."""

import torch

from spml_cache.losses import Loss
from spml_cache.losses.base import as_tensor_like, mean_over_entries, neg_log_1mp, neg_log_p


class MaskedFocal(Loss):
    name = "masked_focal"
    description = "Focal loss on the observed positive and the assumed negatives, which weigh w."
    reference = "examples/masked_focal.py (focal loss: Lin et al., ICCV 2017)"
    observed_negative = "p^gamma nl(1-p) with weight 1: a known 0 is not down-weighted"
    defaults = {"gamma": 2.0, "w": 0.5}
    bounds = {"gamma": (0.0, 10.0, "[]"), "w": (0.0, 1.0, "(]")}
    per_head = ("gamma", "w")  # --hp masked_focal.w=0.25,0.5 trains both values side by side

    def forward(self, logits, observed, *, labels=None, index=None):
        p = torch.sigmoid(logits)
        positive = (1 - p) ** self.gamma * neg_log_p(logits)
        negative = p**self.gamma * neg_log_1mp(logits)
        weight = torch.where(observed == -1, 1.0, as_tensor_like(self.w, logits))
        return mean_over_entries(torch.where(observed == 1, positive, weight * negative))
