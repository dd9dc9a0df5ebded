"""One pair at a time: ZLPR, OPML, OPML-SP (docs/losses.md, "One pair at a time").

ZLPR is exact (Su et al. 2022). OPML and OPML-SP are the **spec's reconstruction**: the OPML paper's formulas
did not survive in the project's copy and no public code exists, so these follow docs/losses.md, not a
verified original. Per image, log-sum-exp is a smooth maximum: the gradient concentrates on the
highest-scoring assumed negative against the weakest positive, one pair at a time. Each image gives one value;
the batch sum is divided by B*C like every other loss. Observed negatives (`z = -1`) join the negative set.
"""

from __future__ import annotations

import torch

from spml_cache.losses.base import Loss, assign_, register, rows_for_heads
from spml_cache.losses.terms import Sloped, Terms
from spml_cache.metrics import average_precision
from spml_cache.runtime.errors import SpmlError


def soft_pairs(x: Terms, targets: torch.Tensor, log_alpha, log_beta):
    """Per image `[..., B]`: log(alpha + sum_j (1-t_j) e^{x_j}) + log(beta + sum_i t_i e^{-x_i}) - log alpha - log beta;
    with `x`'s slopes, its gradient with respect to the logits `[..., B, C]`: each log-sum-exp's softmax weights on
    the logits' entries, the negatives' minus the positives' (`-x` enters the positives' sum).

    Hard targets (t in {0, 1}) give OPML over P = {t = 1}, N = {t = 0}. The constants and the weights enter the
    log-sum-exp as logs, so nothing is exponentiated outside it; a weight of 0 is a log of -inf, which drops
    the entry from the sum and from the gradient.
    """
    negatives, positives, shift = _pair_sums(x.logits, targets, log_alpha, log_beta)
    sum_negatives, sum_positives = torch.logsumexp(negatives, dim=-1), torch.logsumexp(positives, dim=-1)
    value = sum_negatives + sum_positives - shift
    if not x.slopes:
        return value
    weights = [(sums[..., 1:] - total.unsqueeze(-1)).exp() for sums, total in
               ((negatives, sum_negatives), (positives, sum_positives))]
    return Sloped(value, weights[0] - weights[1])


def _pair_sums(logits: torch.Tensor, targets: torch.Tensor, log_alpha, log_beta):
    """The two log-sum-exps' arguments `[..., B, 1 + C]` (the constant first) and the constants' shift."""
    logits, targets = torch.broadcast_tensors(logits, targets.to(logits.dtype))
    column = logits.new_full((*logits.shape[:-1], 1), 0.0)
    negatives = torch.cat([column + log_alpha, logits + torch.log1p(-targets)], dim=-1)
    positives = torch.cat([column + log_beta, -logits + torch.log(targets)], dim=-1)
    # per-head constants are [K, 1, 1]: [K, 1] against the per-image values [K, B]
    shift = sum(c.squeeze(-1) if isinstance(c, torch.Tensor) else c for c in (log_alpha, log_beta))
    return negatives, positives, shift


@register
class ZLPR(Loss):
    """ZLPR (Su et al. 2022): log(1 + sum_{j in N} e^{x_j}) + log(1 + sum_{i in P} e^{-x_i}) per image."""

    name = "zlpr"
    display_name = "ZLPR"
    observed_negative = "in the negative set, as an assumed negative"
    description = "zero-bounded log-sum-exp & pairwise rank-based loss; OPML at alpha = beta = 1"
    reference = "Su et al. 2022 (ZLPR); the alpha = beta = 1 case of Li, Wang and Chen, Sec. III-B, Table III"

    def equation(self, x, observed, *, labels=None, index=None):
        return x.per_image_mean(soft_pairs(x, observed == 1, 0.0, 0.0))


@register
class OPML(Loss):
    """OPML, the spec's reconstruction: ZLPR with constants alpha = e^log_alpha, beta = e^log_beta inside the
    logs, shifted so that the minimum is 0; alpha = beta = 1 is ZLPR."""

    name = "opml"
    display_name = "OPML"
    observed_negative = "in the negative set, as an assumed negative"
    description = "one pair at a time (spec's reconstruction): log(alpha + sum_N e^x) + log(beta + sum_P e^-x), shifted"
    reference = "Li, Wang and Chen, arXiv 2302.14695, Sec. III-B, eqs. 3 and 6; reconstructed in docs/losses.md"
    defaults = {"log_alpha": 0.0, "log_beta": 0.0}
    per_head = ("log_alpha", "log_beta")
    paper_grid = {"log_alpha": (-2.0, 0.0, 2.0), "log_beta": (-2.0, 0.0, 2.0)}
    paper_grid_source = ("the project's reconstruction (docs/losses.md): the paper tunes both constants, but none of"
                         " its values survive")
    reconstructed = True

    def equation(self, x, observed, *, labels=None, index=None):
        return x.per_image_mean(soft_pairs(x, observed == 1, self.log_alpha, self.log_beta))


@register
class OPMLSoft(Loss):
    """OPML-SP, the spec's reconstruction: soft OPML + high-rank regulariser + AP-based label correction.

    - Soft targets: 1 on observed (or corrected) positives, `eps_c = eps (1 - AP_c)^r` on unobserved entries,
      0 on observed negatives. `AP_c` is the current model's AP of class c on the training rows, against the
      training set's *given* observed labels (corrections do not move the reference), recomputed in every
      `start_epoch` from `train_logits`; before the first one, `eps_c = eps`.
    - Regulariser `lambda * -log det(P_B P_B^T / C + delta I)` on the batch probabilities, added unnormalised.
    - From epoch `warmup + 1` on (i.e. once `warmup` epochs are trained), every `start_epoch` flips, per head and
      class, the `floor(rho AP_c N_c)` highest-scoring still-unobserved training entries to positives;
      `N_c` is the class's given observed-positive count.
    """

    name = "opml_sp"
    display_name = "OPML-SP"
    observed_negative = "soft target 0 (an unknown gets eps_c); never flipped"
    description = ("OPML + AP-adaptive soft targets, -log det high-rank regulariser, AP-based label correction"
                   " (spec's reconstruction)")
    reference = "Li, Wang and Chen, arXiv 2302.14695, Sec. III-D eq. 10, III-E eq. 11 and Algorithm 1; reconstructed in docs/losses.md"
    defaults = {
        "log_alpha": 0.0, "log_beta": 0.0, "eps": 0.1, "r": 1.0,
        "lambda": 1e-3, "delta": 1e-3, "rho": 0.1, "warmup": 5.0,
    }
    state = "corrected_observed [K, N_train, C]: observed labels plus corrections; class_eps [K, C] from training AP"
    row_buffers = ("corrected_observed",)
    needs_train_logits = True
    reconstructed = True
    no_closed_form = "its log-determinant's gradient is no simpler by hand"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.register_buffer("corrected_observed", self.train_observed.unsqueeze(0).repeat(self.num_heads, 1, 1))
        self.register_buffer("class_eps", torch.full((self.num_heads, self.num_classes), float(self.eps)))

    def start_epoch(self, epoch, num_epochs, train_logits=None):
        if train_logits is None:
            raise SpmlError(f"loss '{self.name}' needs train_logits in start_epoch (its needs_train_logits is True)")
        scores = train_logits.detach().to(self.class_eps.device)
        if scores.dim() == 2:
            scores = scores.unsqueeze(0)
        # the given labels, AP's reference and N_c: rebuilt here once an epoch, not a per-row buffer no step reads
        given_positive = (self.train_observed == 1).to(scores.device, torch.uint8)
        ap = average_precision(scores, given_positive).to(self.class_eps.dtype)  # [K, C]
        assign_(self.class_eps, self.eps * (1 - ap) ** self.r)  # in place: a captured step reads this memory
        if epoch > int(self.warmup):
            self.correct_labels(scores, ap, given_positive.sum(dim=0))

    @torch.no_grad()
    def correct_labels(self, scores: torch.Tensor, ap: torch.Tensor, num_positive: torch.Tensor) -> None:
        """Flip the floor(rho AP_c N_c) highest-scoring unobserved entries of each head and class to positives."""
        # rounded before the floor: a perfect ranking can come out as AP 0.99999994
        wanted = self.rho * ap.nan_to_num(0.0).cpu().double() * num_positive.cpu().double()  # a diverged head: none
        counts = torch.floor(torch.round(wanted, decimals=6)).long().to(scores.device)
        unobserved = self.corrected_observed == 0
        order = torch.where(unobserved, scores, float("-inf")).argsort(dim=1, descending=True, stable=True)
        rank = torch.empty_like(order)
        positions = torch.arange(order.shape[1], device=order.device).view(1, -1, 1).expand_as(order)
        rank.scatter_(1, order, positions)
        flip = unobserved & (rank < counts.unsqueeze(1))
        self.corrected_observed[flip] = 1

    def forward(self, logits, observed, *, labels=None, index=None):
        rows = rows_for_heads(self.corrected_observed, index, logits)
        class_eps = self.class_eps[0] if logits.dim() == 2 else self.class_eps.unsqueeze(1)
        targets = torch.where(rows == 1, 1.0, torch.where(rows == 0, class_eps, 0.0))
        x = Terms(logits)
        pairs = x.per_image_mean(soft_pairs(x, targets, self.log_alpha, self.log_beta))
        probs = torch.sigmoid(logits)
        gram = probs @ probs.transpose(-2, -1) / self.num_classes
        gram = gram + self.delta * torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
        high_rank = -torch.linalg.slogdet(gram).logabsdet
        return pairs + self.hparams["lambda"] * high_rank
