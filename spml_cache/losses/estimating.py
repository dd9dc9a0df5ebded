"""Losses that use the expected number of positives per image `k` (Cole et al., CVPR 2021): EPR and ROLE.

`k` defaults to the dataset's value (the fully labelled training set's mean positive count, Cole et al., Table A3);
for any other dataset pass it as a hyperparameter (`--hp k=`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from spml_cache import datasets
from spml_cache.losses.base import Loss, bce, head_vector, mean_over_entries, register, rows_for_heads
from spml_cache.losses.terms import Sloped, Terms, bce_terms, logs_of
from spml_cache.runtime.errors import SpmlError

THETA_INIT_POSITIVE = 0.995  # Q at an observed positive
THETA_INIT_NEGATIVE = 0.005  # Q at an observed negative
THETA_INIT_UNOBSERVED = (0.4, 0.6)  # Q at an unobserved label: Theta uniform between their logits


def _gap(p: torch.Tensor, k) -> torch.Tensor:
    """((1/B) sum_n sum_c p_nc - k) / C over the last two dims of `p` ([..., B, C] -> [...]): R_k's root."""
    num_rows, num_classes = p.shape[-2:]
    return (p.sum(dim=(-2, -1)) / num_rows - k) / num_classes


def expected_positive_regularizer(p: torch.Tensor, k: float) -> torch.Tensor:
    """R_k(P) = ((1/B) sum_n sum_c p_nc - k)^2 / C^2 over the last two dims of `p` ([..., B, C] -> [...])."""
    return _gap(p, k) ** 2


def expected_positive_terms(p: torch.Tensor, k, weight=1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """R_k(P) (`[...]`) and the gradient of `weight * R_k(P)` with respect to the logits,
    `weight 2 (k_hat - k) / (B C^2) (1 - p) p`, taken in autograd's order (the weight first, each division, then
    the sigmoid's factors one at a time): ROLE's theta slope sums it with near-equal terms (`weight`: a number or
    one per head `[K]`)."""
    num_rows, num_classes = p.shape[-2:]
    gap = _gap(p, k)
    coefficient = (weight * (2 * gap) / num_classes / num_rows).unsqueeze(-1).unsqueeze(-1)
    return gap**2, coefficient * (1 - p) * p


def expected_positives(x: Terms, k, weight=None):
    """R_k(P) of the batch's probabilities per head `[...]`, times `weight` (a number or one per head `[K]`)
    where given, added unnormalised to a loss; with `x`'s slopes, its gradient with respect to the logits."""
    if not x.slopes:
        value = expected_positive_regularizer(x.p, k)
        return value if weight is None else weight * value
    value, slope = expected_positive_terms(x.p, k, 1.0 if weight is None else weight)
    return Sloped(value if weight is None else weight * value, slope)


def observed_label_terms(logits: torch.Tensor, observed: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """`nl(p)` on observed positives, `nl(1-p)` on observed negatives, 0 on unobserved labels: BCE against
    1[z = 1] where z != 0 (one fused op and a mask, where the two branches would take ten)."""
    return bce(logits, (observed == 1).to(logits.dtype), eps) * (observed != 0)


class _ExpectedPositivesLoss(Loss):
    """Shared hyperparameter `k`: the dataset's expected positives per image, or the caller's `k`."""

    defaults = {"k": None}
    derived = {"k": "the dataset's expected positives per image (else pass --hp k=)"}
    dataset_defaults = {dataset: {"k": k} for dataset, k in datasets.values_of("EXPECTED_POSITIVES").items()}
    per_head = ("k",)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        values = self.hparams["k"] if isinstance(self.hparams["k"], list) else [self.hparams["k"]]
        if None in values:
            raise SpmlError(
                f"loss '{self.name}' needs k, the expected positives per image, and dataset '{self.dataset}' has no"
                f" default (known: {', '.join(self.dataset_defaults)}): pass --hp k=VALUE"
            )
        for k in values:
            if not 0 < k <= self.num_classes:
                raise SpmlError(f"loss '{self.name}': k={k} must lie in (0, {self.num_classes}]: fix --hp k=")


@register
class ExpectedPositiveRegularization(_ExpectedPositivesLoss):
    """EPR: BCE on the observed labels only, plus R_k on the batch's predictions (added unnormalised)."""

    name = "epr"
    display_name = "EPR"
    observed_negative = "nl(1-p)"
    authors_drop_last = True  # Cole et al.'s loaders, train and evaluation alike
    authors_log_eps = 1e-5  # Cole et al.'s code: -log(p + 1e-5)
    description = "Observed labels only, plus a penalty pulling the batch's mean predicted positive count to k."
    reference = "Cole et al., CVPR 2021, Sec. 5.3, L_EPR with R_k of Eq. 10; Table 1 row L_EPR"

    def equation(self, x, observed, *, labels=None, index=None):
        # `exact`: without the authors' eps, as epr has always been computed here, though docs/fidelity.md lists
        # -log(p + 1e-5) for it (Cole et al.'s code); left to a change of its own, which moves its authors results
        observed_terms = x.exact.bce((observed == 1).to(x.dtype)) * (observed != 0)  # observed_label_terms
        return x.mean(observed_terms) + expected_positives(x, head_vector(self.k))


@register
class RegularizedOnlineLabelEstimation(_ExpectedPositivesLoss):
    """ROLE: the classifier f and a learnable label matrix Q = sigmoid(theta) teach each other.

    Per entry `0.5 * (pos_f + pos_q) + 0.5 * (cross_f + cross_q)`; `cross_f` trains f towards stopgrad(q) and
    `cross_q` trains theta towards stopgrad(p), so no gradient crosses between the two sides. Observed negatives
    (partial-label setting only) get the mirror `0.5 * (neg_f + neg_q)`. Regulariser `0.5 * (R_k(P) + R_k(Q_B))`.

    `theta` is `[K, N_train, C]`, one label matrix per head, trained by the trainer's Adam at `lr_mult` times the
    head's learning rate; rows outside the batch get a zero gradient.
    """

    name = "role"
    display_name = "ROLE"
    observed_negative = "nl(1-p) on p and on its estimate; estimate starts at 0.005"
    authors_drop_last = True  # Cole et al.'s loaders, train and evaluation alike
    authors_log_eps = 1e-5  # Cole et al.'s code: -log(p + 1e-5)
    description = "Regularised online label estimation: a learnable label matrix trained jointly with the head."
    reference = "Cole et al., CVPR 2021, Sec. 5.4, Eq. 11 and L_ROLE; Sec. 6.1 init of g; Table 1 row L_ROLE"
    defaults = {**_ExpectedPositivesLoss.defaults, "lr_mult": 10.0}
    state = "theta: learnable label logits [K, N_train, C] (Adam at lr_mult x the head's lr)"
    row_params = ("theta",)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.theta = torch.nn.Parameter(self._initial_theta())
        self.theta.lr_mult = self.lr_mult

    def _initial_theta(self) -> torch.Tensor:
        """logit(0.995) at observed positives, logit(0.005) at observed negatives, elsewhere uniform in
        [logit(0.4), logit(0.6)] from a generator seeded with the head's seed: one [N, C] draw per distinct seed,
        so a head inside a stack starts exactly like the same head alone."""
        observed = self.train_observed.cpu()
        low, high = (math.log(q / (1 - q)) for q in THETA_INIT_UNOBSERVED)
        head_seeds = list(self.seed) if isinstance(self.seed, Sequence) else [self.seed] * self.num_heads
        draws = {}
        for seed in head_seeds:
            if seed not in draws:
                generator = torch.Generator().manual_seed(int(seed))
                draws[seed] = low + (high - low) * torch.rand(observed.shape, generator=generator)
        theta = torch.stack([draws[seed] for seed in head_seeds])
        theta[:, observed == 1] = math.log(THETA_INIT_POSITIVE / (1 - THETA_INIT_POSITIVE))
        theta[:, observed == -1] = math.log(THETA_INIT_NEGATIVE / (1 - THETA_INIT_NEGATIVE))
        return theta

    def forward(self, logits, observed, *, labels=None, index=None):
        theta_batch = rows_for_heads(self.theta, index, logits).to(logits.dtype)
        p = torch.sigmoid(logits)
        q = torch.sigmoid(theta_batch)
        observed_f = observed_label_terms(logits, observed, self.log_eps)  # pos_f (+ neg_f)
        observed_q = observed_label_terms(theta_batch, observed, self.log_eps)  # pos_q (+ neg_q)
        cross_f = bce(logits, q.detach(), self.log_eps)
        cross_q = bce(theta_batch, p.detach(), self.log_eps)
        terms = 0.5 * (observed_f + observed_q) + 0.5 * (cross_f + cross_q)
        k = head_vector(self.k)
        regularizer = 0.5 * (expected_positive_regularizer(p, k) + expected_positive_regularizer(q, k))
        return mean_over_entries(terms) + regularizer

    def loss_and_grad(self, logits, observed, *, labels=None, index=None):
        """`forward`'s value, its gradient with respect to the logits and, by name, to theta's rows `index`
        (`[K, B, C]`): each side a masked BCE to the observed labels and a BCE to the other side's probability,
        held fixed, plus half of its R_k."""
        theta_batch = rows_for_heads(self.theta, index, logits).detach().to(logits.dtype)
        eps, known, target = self.log_eps, observed != 0, (observed == 1).to(logits.dtype)
        sides = (logits, theta_batch)
        logs = [torch.sigmoid(side) if eps is None else logs_of(side, eps) for side in sides]  # p alone, or both logs
        probabilities = logs if eps is None else [side_logs.p for side_logs in logs]
        own = [bce_terms(side, target, eps, side_logs) for side, side_logs in zip(sides, logs)]
        cross = [bce_terms(side, other, eps, side_logs) for side, side_logs, other in
                 zip(sides, logs, probabilities[::-1])]
        terms = 0.5 * (own[0][0] * known + own[1][0] * known) + 0.5 * (cross[0][0] + cross[1][0])
        regularizers = [expected_positive_terms(p, head_vector(self.k), 0.5) for p in probabilities]
        value = mean_over_entries(terms) + 0.5 * (regularizers[0][0] + regularizers[1][0])
        # each term's slope at its own scale, then their sum, as autograd accumulates them: theta's slope is a
        # difference of near-equal probabilities where q ~ p, which Adam's normalisation then magnifies
        scale = 0.5 / (logits.shape[-2] * logits.shape[-1])
        known_scale = known * scale
        grad_logits, grad_theta = (own_slope * known_scale + cross_slope * scale + regularizer_slope
                                   for (_, own_slope), (_, cross_slope), (_, regularizer_slope)
                                   in zip(own, cross, regularizers))
        return value, grad_logits, {"theta": grad_theta}
