"""ll_r, ll_ct, ll_cp against docs/losses.md ("Large-loss modification"), restated here with numpy."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from spml_cache import losses


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def single_positive(rng, rows, classes):
    observed = np.zeros((rows, classes), dtype=np.int8)
    observed[np.arange(rows), rng.integers(0, classes, rows)] = 1
    return observed


def rejection_count(entries, epoch, delta):
    """m = ceil(B*C*(t-1)*delta) in exact arithmetic: 0 at epoch 1."""
    return math.ceil(Fraction(entries) * (epoch - 1) * Fraction(str(delta)))


def expected_ll(logits, observed, m, replace):
    """an terms; the unobserved entries whose loss is >= the m-th largest unobserved loss get `replace`."""
    p = sigmoid(logits)
    terms = np.where(observed == 1, -np.log(p), -np.log(1 - p))
    unobserved_losses = sorted((terms[n, c] for n, c in zip(*np.nonzero(observed == 0))), reverse=True)
    if m > 0:
        threshold = unobserved_losses[min(m, len(unobserved_losses)) - 1]
        for n, c in zip(*np.nonzero((observed == 0) & (terms >= threshold))):
            terms[n, c] = 0.0 if replace == "zero" else -np.log(p[n, c])
    return terms.sum() / terms.size


def run(loss, logits, observed, index=None):
    x = torch.tensor(logits, requires_grad=True)
    out = loss(x, torch.tensor(observed), index=None if index is None else torch.tensor(index))
    out.sum().backward()
    return out.detach().numpy(), x.grad.numpy()


def test_ll_r_rejects_nothing_at_epoch_one_and_keeps_the_denominator():
    rng = np.random.default_rng(0)
    logits, observed = rng.normal(size=(5, 20)), single_positive(rng, 5, 20)
    loss = losses.build("ll_r", num_classes=20, delta=0.01)
    loss.start_epoch(1, 10)
    value, grad = run(loss, logits, observed)
    assert value == pytest.approx(expected_ll(logits, observed, 0, "zero"), rel=1e-12)
    assert (grad != 0).all()
    for epoch in (2, 3, 5):
        loss.start_epoch(epoch, 10)
        value, grad = run(loss, logits, observed)
        m = rejection_count(100, epoch, 0.01)
        assert m == epoch - 1
        assert value == pytest.approx(expected_ll(logits, observed, m, "zero"), rel=1e-12)  # sum / (B*C)
        assert (grad == 0).sum() == m  # distinct values: exactly m rejected, all unobserved
        assert (observed[grad == 0] == 0).all()


@pytest.mark.parametrize("shape, epoch, delta", [((8, 20), 2, 0.002), ((8, 20), 5, 0.002), ((16, 80), 3, 0.005)])
def test_rejection_counts_follow_the_epoch(shape, epoch, delta):
    rng = np.random.default_rng(1)
    logits, observed = rng.normal(size=shape), single_positive(rng, *shape)
    loss = losses.build("ll_r", num_classes=shape[1], delta=delta)
    loss.start_epoch(epoch, 10)
    _, grad = run(loss, logits, observed)
    assert (grad == 0).sum() == rejection_count(shape[0] * shape[1], epoch, delta)


def test_rejection_count_is_exact_when_the_product_is_an_integer():
    # 100 * 1 * 0.07 is 7.000000000000001 in floating point; the spec's m is 7
    rng = np.random.default_rng(2)
    logits, observed = rng.normal(size=(5, 20)), single_positive(rng, 5, 20)
    loss = losses.build("ll_r", num_classes=20, delta=0.07)
    loss.start_epoch(2, 10)
    assert (run(loss, logits, observed)[1] == 0).sum() == 7


def test_ties_at_the_threshold_are_all_rejected():
    logits = np.array([[3.0, 1.0, 1.0, -2.0], [0.5, 1.0, 2.0, -1.0]])
    observed = np.array([[1, 0, 0, 0], [0, 0, 1, -1]])
    loss = losses.build("ll_r", num_classes=4, delta=0.125)  # m = ceil(8 * 0.125) = 1, three unobserved ties at x=1
    loss.start_epoch(2, 10)
    value, grad = run(loss, logits, observed)
    assert (grad == 0).sum() == 3
    assert value == pytest.approx(expected_ll(logits, observed, 1, "zero"), rel=1e-12)
    # the observed negative (1, 3) is never a candidate, even when its loss is the largest
    logits[1, 3] = 5.0
    value, grad = run(loss, logits, observed)
    assert grad[1, 3] > 0 and (grad == 0).sum() == 3


def test_ll_ct_replaces_the_large_losses_by_the_positive_term():
    rng = np.random.default_rng(3)
    logits, observed = rng.normal(size=(6, 10)), single_positive(rng, 6, 10)
    loss = losses.build("ll_ct", num_classes=10, delta=0.02)
    loss.start_epoch(3, 10)
    value, grad = run(loss, logits, observed)
    m = rejection_count(60, 3, 0.02)
    assert value == pytest.approx(expected_ll(logits, observed, m, "positive"), rel=1e-12)
    # corrected entries are pushed up: negative gradient on m unobserved entries, the rest of them positive
    assert ((grad < 0) & (observed == 0)).sum() == m
    # temporary: the same batch in the next call at epoch 1 is plain an again
    loss.start_epoch(1, 10)
    assert run(loss, logits, observed)[0] == pytest.approx(expected_ll(logits, observed, 0, "zero"), rel=1e-12)


def build_ll_cp(train_observed, num_heads=1, delta=0.05):
    return losses.build(
        "ll_cp", num_classes=train_observed.shape[1], num_heads=num_heads,
        train_observed=torch.tensor(train_observed), delta=delta,
    )


def test_ll_cp_count_is_fixed_and_corrections_persist_across_batches():
    rng = np.random.default_rng(4)
    train_observed = single_positive(rng, 8, 10)
    logits = rng.normal(size=(8, 10))
    loss = build_ll_cp(train_observed)  # m = ceil(40 * 0.05) = 2 at every epoch >= 2
    loss.start_epoch(1, 10)
    first, second = np.arange(4), np.arange(4, 8)
    value, _ = run(loss, logits[first], train_observed[first], first)
    assert value == pytest.approx(expected_ll(logits[first], train_observed[first], 0, "zero"), rel=1e-12)
    assert (loss.corrected_observed.numpy()[0] == train_observed).all()

    for epoch in (2, 6):  # the count does not grow with the epoch
        loss.start_epoch(epoch, 10)
        current = loss.corrected_observed.numpy()[0].copy()
        value, _ = run(loss, logits[second], train_observed[second], second)
        assert value == pytest.approx(expected_ll(logits[second], current[second], 2, "positive"), rel=1e-12)

    # distinct values: each call writes the entry strictly above its threshold (1 of the m = 2 selected)
    corrected = loss.corrected_observed.numpy()[0].copy()
    flipped = np.argwhere(corrected != train_observed)
    assert len(flipped) == 2 and set(flipped[:, 0]) <= set(second.tolist())
    terms = -np.log(1 - sigmoid(logits))
    first_flip = np.unravel_index(np.argmax(np.where(train_observed[second] == 0, terms[second], -np.inf)), (4, 10))
    assert corrected[second[first_flip[0]], first_flip[1]] == 1

    # a later batch over the same rows treats the corrections as observed positives
    loss.start_epoch(7, 10)
    value, grad = run(loss, logits[second], train_observed[second], second)
    assert value == pytest.approx(expected_ll(logits[second], corrected[second], 2, "positive"), rel=1e-12)
    for n, c in flipped:
        assert grad[n - 4, c] < 0


def test_ll_cp_keeps_ties_at_the_threshold_temporary():
    train_observed = np.array([[1, 0, 0, 0], [0, 1, 0, 0]], dtype=np.int8)
    logits = np.array([[0.0, 2.0, 2.0, 3.0], [1.0, 0.0, -1.0, 0.5]])
    loss = build_ll_cp(train_observed, delta=0.25)  # m = 2: (0, 3) above, (0, 1) and (0, 2) tied at the threshold
    loss.start_epoch(2, 10)
    value, grad = run(loss, logits, train_observed, np.arange(2))
    assert value == pytest.approx(expected_ll(logits, train_observed, 2, "positive"), rel=1e-12)
    assert (grad[0, 1:] < 0).all()  # all three corrected this step
    corrected = loss.corrected_observed.numpy()[0]
    assert corrected[0, 3] == 1 and corrected[0, 1] == 0 and corrected[0, 2] == 0  # only the strict one is kept


def test_ll_cp_stacked_heads_equal_separate_losses():
    rng = np.random.default_rng(5)
    train_observed = single_positive(rng, 12, 6)
    logits = rng.normal(size=(3, 12, 6))
    stacked = build_ll_cp(train_observed, num_heads=3, delta=0.1)
    separate = [build_ll_cp(train_observed, delta=0.1) for _ in range(3)]
    for epoch in (1, 2, 3):
        for loss in [stacked, *separate]:
            loss.start_epoch(epoch, 3)
        for batch in (np.array([0, 5, 7, 2]), np.array([1, 3, 4, 6]), np.array([8, 9, 10, 11]), np.array([2, 0, 11, 4])):
            values, grads = run(stacked, logits[:, batch], train_observed[batch], batch)
            for head, loss in enumerate(separate):
                value, grad = run(loss, logits[head, batch], train_observed[batch], batch)
                assert values[head] == pytest.approx(value, rel=1e-12)
                np.testing.assert_allclose(grads[head], grad, rtol=1e-12)
    for head, loss in enumerate(separate):
        assert torch.equal(stacked.corrected_observed[head], loss.corrected_observed[0])
    assert (stacked.corrected_observed.numpy() != train_observed).any()  # the run did correct something
