"""Acknowledging the unknown (Zhou et al., ECCV 2022): entropy maximisation and asymmetric pseudo-labelling.

On unobserved labels EM *maximises* the entropy, whose gradient `alpha * x * p * (1 - p)` vanishes at p = 0.5
and for confident predictions, so the observed positives dominate early training. Observed negatives (partial
labels only) keep the plain `nl(1 - p)`.
"""

from __future__ import annotations

import math
import torch

from spml_cache.runtime.errors import SpmlError
from spml_cache.losses.base import Loss, register, rows_for_heads
from spml_cache.runtime.registry import Param

EM_ALPHA = {"voc": 0.2, "coco": 0.1, "nus": 0.1, "cub": 0.01}


@register
class EntropyMaximization(Loss):
    """EM: `nl(p)` on observed positives, `-alpha * H(p)` on unobserved labels (the total can be negative)."""

    name = "em"
    display_name = "EM"
    observed_negative = "nl(1-p), never the entropy term"
    authors_log_eps = 1e-5  # Zhou et al.'s code: -log(p + 1e-5)
    authors_early_stop = ("no_gain", 0.0)  # Zhou et al.: stop at the first epoch without improvement
    description = "Entropy maximisation on unobserved labels: acknowledge them as unknown instead of negative."
    reference = "Zhou et al., ECCV 2022, Eq. 3-4; Table 1 row EM loss"
    defaults = {"alpha": 0.1}
    dataset_defaults = {dataset: {"alpha": alpha} for dataset, alpha in EM_ALPHA.items()}
    per_head = ("alpha",)
    params = (Param.between("alpha", 0.0, math.inf, "[)"),)

    def equation(self, x, observed, *, labels=None, index=None):
        return x.mean(x.known_or(observed, -self.alpha * x.entropy))


@register
class EntropyMaximizationAsymmetricPseudoLabels(Loss):
    """EM + APL: EM, plus negative pseudo-labels with soft targets added after every epoch from `warmup` on.

    Timing: the paper labels "after the training phase of epoch t" for t = warmup, ..., T-1 (T - warmup rounds).
    The trainer calls `start_epoch(epoch)` before epoch `epoch` with the logits after epoch `epoch - 1`, so round
    t happens in `start_epoch(t + 1)`. In each round, for class c, the `floor(theta * U_c / (T - warmup))`
    lowest-scoring entries among those still unobserved and not yet pseudo-labelled become pseudo-negatives with
    soft target `s = p` at that moment (`U_c`: the class's unobserved count in `train_observed`); permanent.
    A pseudo-labelled entry's term is `beta * [s nl(p) + (1 - s) nl(1 - p)]`, the others keep EM's.
    Class defaults (a dataset without its own) are COCO's.
    """

    name = "em_apl"
    display_name = "EM+APL"
    observed_negative = "nl(1-p); never pseudo-labelled"
    authors_log_eps = 1e-5  # Zhou et al.'s code: -log(p + 1e-5)
    authors_early_stop = ("no_gain", 0.0)
    description = "EM plus asymmetric pseudo-labelling: the lowest-scoring unknowns turn into soft negatives."
    reference = "Zhou et al., ECCV 2022, Sec. 3.3, Algorithm 1, Eq. 6-8; Table 1 row EM loss+APL"
    defaults = {"alpha": 0.1, "beta": 0.9, "warmup": 5, "theta": 0.9}
    per_head = ("alpha", "beta")
    params = (Param.between("alpha", 0.0, math.inf, "[)"), Param.between("beta", 0.0, math.inf, "[)"))
    dataset_defaults = {
        "voc": {"alpha": 0.2, "beta": 0.02, "warmup": 5},
        "coco": {"alpha": 0.1, "beta": 0.9, "warmup": 5},
        "nus": {"alpha": 0.1, "beta": 0.2, "warmup": 4},
        "cub": {"alpha": 0.01, "beta": 0.4, "warmup": 3},
    }
    state = "pseudo_negative [K, N_train, C] flags and their soft_target [K, N_train, C]"
    row_buffers = ("pseudo_negative", "soft_target")
    needs_train_logits = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.warmup != int(self.warmup) or self.warmup < 0:
            raise SpmlError(f"loss 'em_apl': warmup={self.warmup} must be a whole number of epochs: fix --hp warmup=")
        if not 0 <= self.theta <= 1:
            raise SpmlError(f"loss 'em_apl': theta={self.theta} is a proportion in [0, 1]: fix --hp theta=")
        self.set_hparam("warmup", int(self.warmup))
        shape = (self.num_heads, *self.train_observed.shape)
        self.register_buffer("pseudo_negative", torch.zeros(shape, dtype=torch.bool))
        self.register_buffer("soft_target", torch.zeros(shape))

    def start_epoch(self, epoch, num_epochs, train_logits=None):
        finished = epoch - 1  # the epoch whose training phase just ended
        rounds = num_epochs - self.warmup
        if finished < self.warmup or finished >= num_epochs:
            return
        if train_logits is None:
            raise ValueError("em_apl.start_epoch needs train_logits (needs_train_logits is True)")
        if train_logits.dim() == 2:
            train_logits = train_logits.unsqueeze(0)
        if train_logits.shape != self.pseudo_negative.shape:
            expected = tuple(self.pseudo_negative.shape)
            raise ValueError(f"em_apl: train_logits {tuple(train_logits.shape)}, expected {expected}")
        # the given labels' unobserved entries: rebuilt here, once an epoch, rather than kept as a per-row buffer
        # that no step reads
        unobserved = self.train_observed.to(self.pseudo_negative.device) == 0
        # the epsilon keeps floor() from losing a whole entry to rounding, e.g. theta*U_c/rounds = 2.9999999999999996
        per_round = torch.floor(self.theta * unobserved.sum(dim=0).double() / rounds + 1e-9).long()
        rank = torch.arange(unobserved.shape[0], device=unobserved.device).unsqueeze(1)
        for head in range(self.num_heads):
            logits = train_logits[head].detach().to(self.soft_target)
            candidate = unobserved & ~self.pseudo_negative[head]
            order = logits.masked_fill(~candidate, float("inf")).argsort(dim=0, stable=True)
            chosen = torch.zeros_like(candidate).scatter_(0, order, rank < per_round)
            chosen &= candidate
            self.pseudo_negative[head] |= chosen
            self.soft_target[head] = torch.where(chosen, torch.sigmoid(logits), self.soft_target[head])

    def equation(self, x, observed, *, labels=None, index=None):
        pseudo_negative = rows_for_heads(self.pseudo_negative, index, x.logits)
        soft_target = rows_for_heads(self.soft_target, index, x.logits).to(x.dtype)
        unobserved = x.where(pseudo_negative, self.beta * x.bce(soft_target), -self.alpha * x.entropy)
        return x.mean(x.known_or(observed, unobserved))
