"""crisp against docs/losses.md ("CRISP", Liu et al.): the class-prior estimate with its confidence bound and the
prior-weighted risk, restated here with plain loops; the AN warm-up before the first estimate."""

import math

import numpy as np
import pytest
import torch
from loss_support import nl, sigmoid

from spml_cache import losses
from spml_cache.losses.crisp import estimate_priors

N, C = 30, 3


def make_data():
    rng = np.random.default_rng(0)
    labels = (rng.random((N, C)) < 0.4).astype(int)
    labels[np.arange(N), np.arange(N) % C] = 1
    observed = np.zeros((N, C), dtype=int)
    observed[np.arange(N), np.arange(N) % C] = 1  # one observed positive per image
    scores = labels * 1.5 + rng.standard_normal((N, C))  # positives score higher
    return labels, observed, scores


LABELS, OBSERVED, SCORES = make_data()


def prior_by_loops(scores, positive, delta, tau):
    """min over thresholds z (each score) of [q_U(z) + (1 + tau)(sqrt(log(4/delta)/2n_P) + sqrt(log(4/delta)/2N))]
    / q_P(z); the prior is q_U/q_P at the minimiser."""
    n_pos, n_all = sum(positive), len(scores)
    if n_pos == 0:
        return 0.0
    slack = (1 + tau) * (math.sqrt(math.log(4 / delta) / (2 * n_pos)) + math.sqrt(math.log(4 / delta) / (2 * n_all)))
    best, prior = math.inf, None
    for z in sorted(scores, reverse=True):
        q_all = sum(s >= z for s in scores) / n_all
        q_pos = sum(s >= z for s, pos in zip(scores, positive) if pos) / n_pos
        if q_pos > 0 and (q_all + slack) / q_pos < best:
            best, prior = (q_all + slack) / q_pos, q_all / q_pos
    return min(max(prior, 0.0), 1.0)


@pytest.mark.parametrize("delta, tau", [(0.01, 0.01), (0.1, 0.5)])
def test_the_prior_estimate_is_the_confidence_bound_minimiser(delta, tau):
    got = estimate_priors(torch.tensor(SCORES), torch.tensor(OBSERVED == 1), delta, tau)
    for c in range(C):
        expected = prior_by_loops(list(SCORES[:, c]), list(OBSERVED[:, c] == 1), delta, tau)
        assert got[c].item() == pytest.approx(expected, rel=1e-9), c


def test_a_class_without_observed_positives_gets_prior_zero():
    observed = OBSERVED.copy()
    observed[:, 1] = 0
    got = estimate_priors(torch.tensor(SCORES), torch.tensor(observed == 1), 0.01, 0.01)
    assert got[1].item() == 0.0 and got[0].item() > 0


def risk_by_loops(logits, observed, prior, train_observed=OBSERVED):
    """mean over classes of pi mean_P nl(p) + max(0, mean_all nl(1-p) - pi mean_P nl(1-p)), plus the known
    negatives' nl(1-p) over B*C; a batch estimates mean_P as its positives' sum / (B * n_P / N), with n_P / N the
    class's share of observed positives in the training set."""
    rows, classes = logits.shape
    total = 0.0
    for c in range(classes):
        p = [sigmoid(x) for x in logits[:, c]]
        pos = [i for i in range(rows) if observed[i, c] == 1]
        share = max(sum(train_observed[:, c] == 1), 1) / len(train_observed)
        mean_pos_p = sum(nl(p[i]) for i in pos) / (rows * share)
        mean_pos_n = sum(nl(1 - p[i]) for i in pos) / (rows * share)
        mean_all_n = sum(nl(1 - q) for q in p) / rows
        total += prior[c] * mean_pos_p + max(0.0, mean_all_n - prior[c] * mean_pos_n)
    known = sum(nl(1 - sigmoid(logits[i, c])) for i in range(rows) for c in range(classes) if observed[i, c] == -1)
    return total / classes + known / (rows * classes)


def an_by_loops(logits, observed):
    rows, classes = logits.shape
    return sum(nl(sigmoid(logits[i, c])) if observed[i, c] == 1 else nl(1 - sigmoid(logits[i, c]))
               for i in range(rows) for c in range(classes)) / (rows * classes)


def test_warm_up_is_an_then_the_prior_risk():
    loss = losses.build("crisp", num_classes=C, dataset="coco", train_observed=torch.tensor(OBSERVED), warmup=2)
    batch = np.random.default_rng(1).standard_normal((6, C)) * 2
    observed = OBSERVED[:6].copy()
    observed[0, 2] = -1  # a known negative (partial labels)
    for epoch in (1, 2):
        loss.start_epoch(epoch, 5, torch.tensor(SCORES))
        assert loss(torch.tensor(batch), torch.tensor(observed)).item() == pytest.approx(an_by_loops(batch, observed))
    loss.start_epoch(3, 5, torch.tensor(SCORES))  # two epochs finished: the priors come from these scores
    prior = [prior_by_loops(list(SCORES[:, c]), list(OBSERVED[:, c] == 1), 0.01, 0.01) for c in range(C)]
    assert loss.prior[0].tolist() == pytest.approx(prior)
    value = loss(torch.tensor(batch), torch.tensor(observed)).item()
    assert value == pytest.approx(risk_by_loops(batch, observed, prior), rel=1e-6)  # priors kept in float32


def test_the_non_negative_correction_binds():
    loss = losses.build("crisp", num_classes=C, train_observed=torch.tensor(OBSERVED), warmup=0)
    loss.start_epoch(1, 3, torch.tensor(SCORES))
    with torch.no_grad():
        loss.prior.fill_(1.0)  # every image a positive: the negative part would go below zero
    batch = np.full((3, C), -4.0)  # all scores low, the positives' nl(1-p) small but above the mean's share
    observed = np.eye(3, C, dtype=int)
    value = loss(torch.tensor(batch), torch.tensor(observed)).item()
    assert value == pytest.approx(risk_by_loops(batch, observed, [1.0] * C), rel=1e-6)
    x = torch.tensor(batch, requires_grad=True)
    loss(x, torch.tensor(observed)).backward()
    assert torch.isfinite(x.grad).all()
