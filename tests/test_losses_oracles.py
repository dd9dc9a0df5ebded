"""Oracle losses (bce, bce_ls, iun): values from docs/losses.md restated with plain loops."""


import pytest
import torch

from spml_cache import losses
from spml_cache.runtime.errors import SpmlError
from loss_support import nl, sigmoid

LOGITS = [[2.0, -1.0, 0.5, -3.0], [-0.3, 1.2, -2.0, 0.7], [0.1, -0.4, 3.5, -1.5]]
OBSERVED = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]]
LABELS = [[1, 0, 1, 0], [0, 1, 1, 0], [1, 0, 1, 1]]


def mean_of_terms(term):
    """sum over every (n, c) of term(n, c), divided by B*C."""
    entries = [(n, c) for n in range(len(LOGITS)) for c in range(len(LOGITS[0]))]
    return sum(term(n, c) for n, c in entries) / len(entries)


def run(name, logits=LOGITS, **hparams):
    loss = losses.build(name, num_classes=4, **hparams)
    return loss(
        torch.as_tensor(logits, dtype=torch.float64),
        torch.tensor(OBSERVED, dtype=torch.int8),
        labels=torch.tensor(LABELS, dtype=torch.uint8),
    )


def test_bce_uses_every_true_label():
    def term(n, c):
        p = sigmoid(LOGITS[n][c])
        return nl(p) if LABELS[n][c] == 1 else nl(1 - p)

    assert run("bce").item() == pytest.approx(mean_of_terms(term), rel=1e-12)


@pytest.mark.parametrize("ls", [0.1, 0.25])
def test_bce_ls_smooths_targets_to_one_minus_ls_and_ls(ls):
    def term(n, c):
        p = sigmoid(LOGITS[n][c])
        if LABELS[n][c] == 1:
            return (1 - ls) * nl(p) + ls * nl(1 - p)
        return (1 - ls) * nl(1 - p) + ls * nl(p)

    hparams = {} if ls == 0.1 else {"ls": ls}
    assert run("bce_ls", **hparams).item() == pytest.approx(mean_of_terms(term), rel=1e-12)


def test_iun_sees_the_observed_positive_and_all_true_negatives():
    def term(n, c):
        p = sigmoid(LOGITS[n][c])
        if OBSERVED[n][c] == 1:
            return nl(p)
        if LABELS[n][c] == 0:
            return nl(1 - p)
        return 0.0  # an unobserved true positive: no term

    assert run("iun").item() == pytest.approx(mean_of_terms(term), rel=1e-12)


def test_iun_gradient_is_zero_exactly_on_unobserved_true_positives():
    logits = torch.tensor(LOGITS, dtype=torch.float64, requires_grad=True)
    loss = losses.build("iun", num_classes=4)
    loss(logits, torch.tensor(OBSERVED), labels=torch.tensor(LABELS)).backward()
    unobserved_positive = (torch.tensor(LABELS) == 1) & (torch.tensor(OBSERVED) == 0)
    assert torch.all(logits.grad[unobserved_positive] == 0)
    assert torch.all(logits.grad[~unobserved_positive] != 0)  # the reference's bug would zero the negatives too


@pytest.mark.parametrize("name", ["bce", "bce_ls", "iun"])
def test_oracles_refuse_to_run_without_labels(name):
    loss = losses.build(name, num_classes=4)
    with pytest.raises(SpmlError, match="labels"):
        loss(torch.tensor(LOGITS), torch.tensor(OBSERVED))


@pytest.mark.parametrize("name", ["bce", "bce_ls", "iun"])
def test_oracle_labels_broadcast_over_stacked_heads(name):
    stacked = torch.tensor([LOGITS, [[-x for x in row] for row in LOGITS]], dtype=torch.float64)
    values = run(name, logits=stacked)
    assert values.shape == (2,)
    assert values[0].item() == pytest.approx(run(name).item(), rel=1e-12)
    assert values[1].item() == pytest.approx(run(name, logits=stacked[1]).item(), rel=1e-12)


def test_oracle_flags():
    assert all(losses.get(name).oracle for name in ["bce", "bce_ls", "iun"])
    assert not losses.get("an").oracle
