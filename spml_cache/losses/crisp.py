"""CRISP (Liu et al., "Can Class-Priors Help Single-Positive Multi-Label Learning?"): estimate each class's prior
every epoch, then train with a risk that uses the priors (docs/losses.md, "CRISP").

Prior estimation, per class `c`, from the current model's scores on every training row: with `q_P(z)` the share
of the class's observed positives scoring at least `z` and `q_U(z)` the share of all training images, the
threshold minimises the upper confidence bound `[q_U(z) + (1 + tau) (sqrt(log(4/delta) / 2 n_P) +
sqrt(log(4/delta) / 2 N))] / q_P(z)`, and the prior is `q_U / q_P` there (clipped to [0, 1]; 0 for a class
without observed positives). The risk per class is the non-negative positive-unlabeled risk with the observed
positives as the positive sample and the batch as the unlabeled one:
`pi mean_P nl(p) + max(0, mean_U nl(1 - p) - pi mean_P nl(1 - p))`, averaged over the classes, where a batch
estimates `mean_P` over all the class's observed positives as the sum over its own divided by `B * n_P / N`
(unbiased; the batch's own mean would not be). The first `warmup`
epochs train with AN instead (the priors need a model that already ranks). Observed negatives (`z = -1`,
partial labels only) add `nl(1 - p)` as known negatives. Reconstructed from the paper's description: the exact
form of its risk could not be checked against code in time (`reconstructed`).
"""

from __future__ import annotations

import math

import torch

from spml_cache.losses.base import Loss, assign_, neg_log_1mp, neg_log_p, register
from spml_cache.losses.terms import logs_of
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.registry import Param


def estimate_priors(scores: torch.Tensor, positive: torch.Tensor, delta: float, tau: float) -> torch.Tensor:
    """Per-class priors `[C]` from scores `[N, C]` (any monotone score: logits or probabilities) and the observed
    positives `[N, C]` (bool), by the confidence-bound threshold described in the module docstring."""
    num_rows = scores.shape[0]
    order = scores.argsort(dim=0, descending=True, stable=True)
    positives_above = positive.gather(0, order).double().cumsum(dim=0)  # [N, C]: positives among the top n
    num_positive = positive.sum(dim=0).double()  # [C]
    share_all = torch.arange(1, num_rows + 1, dtype=torch.float64, device=scores.device).unsqueeze(1) / num_rows
    share_positive = positives_above / num_positive.clamp(min=1)
    slack = math.log(4 / delta) / 2
    bound = (1 + tau) * (torch.sqrt(slack / num_positive.clamp(min=1)) + math.sqrt(slack / num_rows))
    objective = torch.where(share_positive > 0, (share_all + bound) / share_positive, torch.inf)
    best = objective.argmin(dim=0, keepdim=True)
    prior = (share_all.expand_as(share_positive).gather(0, best) / share_positive.gather(0, best).clamp(min=1e-12))
    return torch.where(num_positive > 0, prior.squeeze(0).clamp(0, 1), 0.0)


@register
class ClassPriorsRisk(Loss):
    """CRISP: AN for `warmup` epochs, then the class-prior risk with priors re-estimated before every epoch."""

    name = "crisp"
    display_name = "CRISP"
    observed_negative = "nl(1-p), beside the risk"
    reconstructed = True
    needs_train_logits = True
    description = "class priors estimated each epoch from observed positives vs all images, then a prior-weighted risk"
    reference = "Liu et al., Can Class-Priors Help Single-Positive Multi-Label Learning?, 2023, Sec. 3 (Eq. of the" \
        " priors estimator and the unbiased risk)"
    defaults = {"warmup": 1, "delta": 0.01, "tau": 0.01}
    params = (Param.between("delta", 0.0, 1.0, "()"), Param.between("tau", 0.0, math.inf, "[)"),
              Param.between("warmup", 0.0, math.inf, "[)"))
    # no per-example state (`state`): the per-class buffers prior [K, C] and estimating [K] (past the warm-up)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.train_observed is None:
            raise SpmlError("loss 'crisp' estimates class priors from the training set: build it with"
                            " train_observed=[N_train, C]")
        if self.warmup != int(self.warmup):
            raise SpmlError(f"loss 'crisp': warmup={self.warmup} must be a whole number of epochs: fix --hp warmup=")
        self.set_hparam("warmup", int(self.warmup))
        # each class's share of observed positives in the training set: a batch's positives estimate the mean over
        # all of them as sum / (B * share), an unbiased estimate (their mean in the batch would weigh a class's
        # positives less the rarer they are, by the chance that a batch holds one at all)
        share = (self.train_observed == 1).sum(dim=0).double() / self.train_observed.shape[0]
        self.register_buffer("positive_share", share.clamp(min=1 / self.train_observed.shape[0]).float(),
                             persistent=False)
        self.register_buffer("prior", torch.zeros(self.num_heads, self.num_classes))
        self.register_buffer("estimating", torch.zeros(self.num_heads))  # per head: 0 in the AN warm-up, 1 after

    @torch.no_grad()
    def start_epoch(self, epoch, num_epochs, train_logits=None):
        if epoch - 1 < self.warmup:
            return
        if train_logits is None:
            raise ValueError("crisp.start_epoch needs train_logits (needs_train_logits is True)")
        if train_logits.dim() == 2:
            train_logits = train_logits.unsqueeze(0)
        positive = self.train_observed.to(train_logits.device) == 1
        for head in range(self.num_heads):
            self.prior[head] = estimate_priors(train_logits[head].float(), positive, self.delta, self.tau)
        assign_(self.estimating, 1.0)

    def forward(self, logits, observed, *, labels=None, index=None):
        stacked = logits.dim() == 3
        prior = (self.prior if stacked else self.prior[0]).to(logits.dtype).unsqueeze(-2)  # [.., 1, C]
        estimating = (self.estimating if stacked else self.estimating[0]).to(logits.dtype)
        positive = (observed == 1).to(logits.dtype)
        nl_p, nl_1mp = neg_log_p(logits, self.log_eps), neg_log_1mp(logits, self.log_eps)
        per_positive = positive / (positive.shape[-2] * self.positive_share.to(logits.dtype))  # see __init__
        positive_risk = (prior * per_positive * nl_p).sum(dim=-2)
        negative_risk = nl_1mp.mean(dim=-2) - (prior * per_positive * nl_1mp).sum(dim=-2)
        risk = (positive_risk + negative_risk.clamp(min=0)).mean(dim=-1)
        num_entries = observed.shape[-2] * observed.shape[-1]
        known_negative = ((observed == -1) * nl_1mp).sum(dim=(-2, -1)) / num_entries
        assume_negative = torch.where(observed == 1, nl_p, nl_1mp).sum(dim=(-2, -1)) / num_entries
        return torch.lerp(assume_negative, risk + known_negative, estimating)

    def loss_and_grad(self, logits, observed, *, labels=None, index=None):
        """`forward`'s value and gradient: `lerp` passes `1 - estimating` of AN's slopes and `estimating` of the
        risk's and the known negatives'; `max(0, .)` passes the negative risk's where it is at least 0."""
        stacked = logits.dim() == 3
        prior = (self.prior if stacked else self.prior[0]).to(logits.dtype).unsqueeze(-2)  # [.., 1, C]
        estimating = (self.estimating if stacked else self.estimating[0]).to(logits.dtype)
        logs, positive, known = logs_of(logits, self.log_eps), observed == 1, observed == -1
        num_rows, num_classes = observed.shape[-2:]
        weight = prior * (positive.to(logits.dtype) / (num_rows * self.positive_share.to(logits.dtype)))
        negative_risk = logs.nl_1mp.mean(dim=-2) - (weight * logs.nl_1mp).sum(dim=-2)
        risk = ((weight * logs.nl_p).sum(dim=-2) + negative_risk.clamp(min=0)).mean(dim=-1)
        num_entries = num_rows * num_classes
        known_negative = (known * logs.nl_1mp).sum(dim=(-2, -1)) / num_entries
        assume_negative = torch.where(positive, logs.nl_p, logs.nl_1mp).sum(dim=(-2, -1)) / num_entries
        open_risk = (negative_risk >= 0).unsqueeze(-2)
        d_risk = (weight * logs.d_nl_p + open_risk * (logs.d_nl_1mp / num_rows - weight * logs.d_nl_1mp)) / num_classes
        d_estimating = d_risk + known * logs.d_nl_1mp / num_entries
        d_assume_negative = torch.where(positive, logs.d_nl_p, logs.d_nl_1mp) / num_entries
        share = estimating.unsqueeze(-1).unsqueeze(-1)
        value = torch.lerp(assume_negative, risk + known_negative, estimating)
        return value, (1 - share) * d_assume_negative + share * d_estimating
