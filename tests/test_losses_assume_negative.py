"""Assume-negative family (an, an_ls, an_ls_neg, wan, l1r, l2r, entmin, pr): docs/losses.md restated with loops."""


import pytest
import torch

from spml_cache import losses
from loss_support import entropy, nl, sigmoid

LOGITS = [[2.0, -1.0, 0.5, -3.0], [-0.3, 1.2, -2.0, 0.7], [0.1, -0.4, 3.5, -1.5]]
OBSERVED = [[1, 0, 0, 0], [0, 1, 0, 1], [0, 0, 1, -1]]  # row 2 has two positives, row 3 an observed negative
C = 4


def mean_of_terms(term, logits=LOGITS):
    entries = [(n, c) for n in range(len(logits)) for c in range(C)]
    return sum(term(n, c) for n, c in entries) / len(entries)


def run(name, logits=LOGITS, observed=OBSERVED, **hparams):
    loss = losses.build(name, num_classes=C, **hparams)
    return loss(torch.as_tensor(logits, dtype=torch.float64), torch.tensor(observed, dtype=torch.int8))


def test_an_value():
    def term(n, c):
        p = sigmoid(LOGITS[n][c])
        return nl(p) if OBSERVED[n][c] == 1 else nl(1 - p)

    assert run("an").item() == pytest.approx(mean_of_terms(term), rel=1e-12)


def test_an_equals_bce_when_every_label_is_observed():
    labels = [[1, 0, 1, 0], [0, 1, 1, 0], [1, 0, 1, 1]]
    bce = losses.build("bce", num_classes=C)
    logits = torch.tensor(LOGITS, dtype=torch.float64)
    expected = bce(logits, torch.tensor(OBSERVED), labels=torch.tensor(labels))
    assert run("an", observed=labels).item() == pytest.approx(expected.item(), rel=1e-12)


@pytest.mark.parametrize("name, ls", [("an_ls", 0.1), ("an_ls", 0.3), ("an_ls_neg", 0.1), ("an_ls_neg", 0.3)])
def test_label_smoothing_values(name, ls):
    positive_target = 1 - ls if name == "an_ls" else 1.0  # an_ls_neg smooths the assumed negatives only

    def term(n, c):
        p = sigmoid(LOGITS[n][c])
        target = positive_target if OBSERVED[n][c] == 1 else ls
        if OBSERVED[n][c] == -1 and name == "an_ls_neg":
            target = 0.0  # a known 0 is not smoothed where only assumed negatives are
        return target * nl(p) + (1 - target) * nl(1 - p)

    hparams = {} if ls == 0.1 else {"ls": ls}
    assert run(name, **hparams).item() == pytest.approx(mean_of_terms(term), rel=1e-12)


@pytest.mark.parametrize("name", ["an_ls", "an_ls_neg"])
def test_label_smoothing_zero_is_an(name):
    assert run(name, ls=0.0).item() == pytest.approx(run("an").item(), rel=1e-12)


def test_wan_default_gamma_is_one_over_c_minus_one():
    gamma = 1 / (C - 1)

    def term(n, c):
        p = sigmoid(LOGITS[n][c])
        return nl(p) if OBSERVED[n][c] == 1 else nl(1 - p) if OBSERVED[n][c] == -1 else gamma * nl(1 - p)

    assert run("wan").item() == pytest.approx(mean_of_terms(term), rel=1e-12)
    assert losses.build("wan", num_classes=C).hparams["gamma"] == pytest.approx(gamma)


def test_wan_gamma_one_is_an():
    assert run("wan", gamma=1.0).item() == pytest.approx(run("an").item(), rel=1e-12)


@pytest.mark.parametrize("name", ["l1r", "l2r"])
def test_weight_regularised_losses_are_an_plus_a_head_penalty(name):
    assert run(name).item() == pytest.approx(run("an").item(), rel=1e-12)
    weight = torch.tensor([[[0.5, -1.0], [2.0, 0.0], [-0.25, 0.75]], [[1.0, 1.0], [-1.0, 3.0], [0.0, 0.5]]])
    lam = 0.01
    expected = []
    for head in weight.tolist():
        values = [w for row in head for w in row]
        if name == "l1r":
            expected.append(lam * sum(abs(w) for w in values))
        else:
            expected.append(lam / 2 * sum(w * w for w in values))
    loss = losses.build(name, num_classes=2, lam=lam)
    assert loss.penalty(weight).tolist() == pytest.approx(expected, rel=1e-6)
    assert loss.penalty(weight[1]).item() == pytest.approx(expected[1], rel=1e-6)
    assert losses.build(name, num_classes=2).lam == 1e-4


def test_other_losses_have_no_penalty():
    assert losses.build("an", num_classes=C).penalty(torch.ones(1, 3, C)) == 0.0


def test_entmin_value():
    alpha = 0.1

    def term(n, c):
        p = sigmoid(LOGITS[n][c])
        if OBSERVED[n][c] == 1:
            return nl(p)
        if OBSERVED[n][c] == 0:
            return alpha * entropy(p)
        return nl(1 - p)

    assert run("entmin").item() == pytest.approx(mean_of_terms(term), rel=1e-12)


def test_entmin_pushes_unobserved_predictions_away_from_one_half():
    logits = torch.tensor([[1.0, -1.0, 3.0]], dtype=torch.float64, requires_grad=True)
    losses.build("entmin", num_classes=3)(logits, torch.tensor([[0, 0, 1]])).backward()
    assert logits.grad[0, 0] < 0 < logits.grad[0, 1]  # gradient descent moves them further from 0


def test_pr_value():
    def term(n, i):
        if OBSERVED[n][i] != 1:
            return 0.0
        p = [sigmoid(x) for x in LOGITS[n]]
        return sum(max(0.0, 1 - p[i] + p[j]) for j in range(C) if OBSERVED[n][j] != 1)

    assert run("pr").item() == pytest.approx(mean_of_terms(term), rel=1e-12)


def test_an_gradient_on_an_unobserved_entry_at_one_half_is_not_zero():
    logits = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    losses.build("an", num_classes=2)(logits, torch.tensor([[1, 0]])).backward()
    assert logits.grad[0, 1].item() == pytest.approx(0.5 / 2)  # d nl(1-p)/dx = p, over B*C = 2


@pytest.mark.parametrize("name", ["an", "an_ls", "an_ls_neg", "wan", "l1r", "l2r", "entmin", "pr"])
def test_stacked_heads_equal_separate_calls(name):
    stacked = torch.tensor([LOGITS, [[0.5 * x - 1 for x in row] for row in LOGITS]], dtype=torch.float64)
    values = run(name, logits=stacked)
    assert values.shape == (2,)
    for head in range(2):
        assert values[head].item() == pytest.approx(run(name, logits=stacked[head]).item(), rel=1e-12)
