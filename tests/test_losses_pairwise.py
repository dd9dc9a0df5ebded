"""zlpr, opml, opml_sp against docs/losses.md ("One pair at a time"), restated here with numpy loops."""

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score

from spml_cache import losses
from spml_cache.runtime.errors import SpmlError

# 3 images x 4 classes: one with an observed negative, one with no observed label at all (NUS-WIDE has such rows)
LOGITS = np.array([[2.0, -1.0, 0.5, 1.0], [-0.3, 1.5, -2.0, 3.0], [0.2, -0.7, 1.1, -1.5]])
OBSERVED = np.array([[1, 0, 0, 0], [0, 1, -1, 0], [0, 0, 0, 0]])


def soft_pair_value(logits, targets, log_alpha=0.0, log_beta=0.0):
    """sum over images of log(alpha + sum_j (1-t_j) e^x_j) + log(beta + sum_i t_i e^-x_i) - log alpha - log beta,
    over B*C."""
    alpha, beta = math.exp(log_alpha), math.exp(log_beta)
    total = 0.0
    for n in range(logits.shape[0]):
        negatives = sum((1 - targets[n, c]) * math.exp(logits[n, c]) for c in range(logits.shape[1]))
        positives = sum(targets[n, c] * math.exp(-logits[n, c]) for c in range(logits.shape[1]))
        total += math.log(alpha + negatives) + math.log(beta + positives) - math.log(alpha) - math.log(beta)
    return total / logits.size


def hard_targets(observed):
    return (observed == 1).astype(float)


def value(name, logits=LOGITS, observed=OBSERVED, **hparams):
    loss = losses.build(name, num_classes=logits.shape[-1], **hparams)
    return loss(torch.tensor(logits), torch.tensor(observed)).detach().numpy()


def test_zlpr_value():
    expected = 0.0
    for n in range(3):
        negatives = sum(math.exp(LOGITS[n, c]) for c in range(4) if OBSERVED[n, c] != 1)
        positives = sum(math.exp(-LOGITS[n, c]) for c in range(4) if OBSERVED[n, c] == 1)
        expected += math.log(1 + negatives) + math.log(1 + positives)
    assert value("zlpr") == pytest.approx(expected / 12, rel=1e-12)


def test_zlpr_equals_opml_at_unit_constants():
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=3, size=(3, 5, 7))
    observed = np.zeros((5, 7), dtype=np.int8)
    observed[np.arange(5), rng.integers(0, 7, 5)] = 1
    np.testing.assert_allclose(
        value("opml", logits, observed, log_alpha=0.0, log_beta=0.0), value("zlpr", logits, observed), rtol=1e-14
    )
    assert value("opml", logits, observed).shape == (3,)  # defaults are 0 and 0


@pytest.mark.parametrize("log_alpha, log_beta", [(2.0, -2.0), (-2.0, 0.0)])
def test_opml_value(log_alpha, log_beta):
    expected = soft_pair_value(LOGITS, hard_targets(OBSERVED), log_alpha, log_beta)
    assert value("opml", log_alpha=log_alpha, log_beta=log_beta) == pytest.approx(expected, rel=1e-12)


def test_opml_is_zero_bounded_and_stable():
    separated = np.array([[500.0, -500.0, -400.0], [-450.0, 300.0, -300.0]])
    observed = np.array([[1, 0, 0], [0, 1, 0]])
    x = torch.tensor(separated, dtype=torch.float32, requires_grad=True)
    out = losses.build("opml", num_classes=3, log_alpha=-2.0, log_beta=2.0)(x, torch.tensor(observed))
    out.backward()
    assert out.item() == pytest.approx(0.0, abs=1e-6) and torch.isfinite(x.grad).all()
    assert value("opml", -separated, observed) > 100  # the wrong way round costs the margin


def test_opml_gradient_concentrates_on_the_hardest_negative():
    logits = np.array([[1.0, 2.0, 0.0, 4.0, -1.0]])
    x = torch.tensor(logits, requires_grad=True)
    losses.build("opml", num_classes=5, log_alpha=-2.0)(x, torch.tensor([[1, 0, 0, 0, 0]])).backward()
    grad = x.grad.numpy()[0]
    assert grad[0] < 0 and np.argmax(grad) == 3 and grad[3] > 0.8 * grad[1:].sum()


def test_opml_family_is_marked_as_the_specs_reconstruction():
    for name in ("opml", "opml_sp"):
        cls = losses.get(name)
        assert cls.reconstructed and "reconstruction" in cls.description and "reconstruction" in cls.__doc__
    assert not losses.get("zlpr").reconstructed
    assert losses.get("opml_sp").needs_train_logits


# --- opml_sp ---------------------------------------------------------------------------------------------

def training_set(rng, rows=40, classes=3, heads=2):
    """Single positives (class 2 never observed) plus a few observed negatives; logits that favour positives."""
    observed = np.where(rng.random((rows, classes)) < 0.1, -1, 0).astype(np.int8)
    observed[np.arange(rows), rng.integers(0, classes - 1, rows)] = 1
    train_logits = rng.normal(size=(heads, rows, classes)) + 1.5 * (observed == 1)
    return observed, train_logits


def sklearn_ap(train_logits, observed):
    """[K, C] AP of each head and class against the given observed positives; 0 for a class without one."""
    positive = observed == 1
    return np.array([
        [average_precision_score(positive[:, c], head[:, c]) if positive[:, c].any() else 0.0
         for c in range(observed.shape[1])]
        for head in train_logits
    ])


def build_opml_sp(observed, heads=2, **hparams):
    return losses.build(
        "opml_sp", num_classes=observed.shape[1], num_heads=heads, train_observed=torch.tensor(observed), **hparams
    )


def test_opml_sp_soft_targets_follow_training_ap():
    rng = np.random.default_rng(1)
    observed, train_logits = training_set(rng)
    loss = build_opml_sp(observed, eps=0.2, r=2.0)
    np.testing.assert_allclose(loss.class_eps.numpy(), 0.2)  # before any AP: eps
    loss.start_epoch(1, 10, train_logits=torch.tensor(train_logits))
    ap = sklearn_ap(train_logits, observed)
    assert (ap[:, 2] == 0).all() and (ap[:, :2] > 0.3).all()
    np.testing.assert_allclose(loss.class_eps.numpy(), 0.2 * (1 - ap) ** 2, rtol=1e-5)


def test_opml_sp_value_is_the_soft_pair_loss_plus_the_log_det_regulariser():
    rng = np.random.default_rng(2)
    observed, train_logits = training_set(rng, heads=1)
    batch = np.array([3, 17, 5, 30, 22])
    logits = rng.normal(size=(5, 3))
    ap = sklearn_ap(train_logits, observed)[0]
    class_eps = 0.1 * (1 - ap)
    targets = np.where(observed[batch] == 1, 1.0, np.where(observed[batch] == 0, class_eps, 0.0))
    p = 1 / (1 + np.exp(-logits))
    high_rank = -np.linalg.slogdet(p @ p.T / 3 + 0.01 * np.eye(5))[1]
    for lam in (0.0, 0.05):
        loss = build_opml_sp(observed, heads=1, log_alpha=1.0, log_beta=-1.0, delta=0.01, **{"lambda": lam})
        loss.start_epoch(1, 10, train_logits=torch.tensor(train_logits[0]))
        out = loss(torch.tensor(logits), torch.tensor(observed[batch]), index=torch.tensor(batch))
        expected = soft_pair_value(logits, targets, 1.0, -1.0) + lam * high_rank
        assert out.item() == pytest.approx(expected, rel=1e-5)


def test_opml_sp_regulariser_prefers_a_high_rank_batch():
    observed = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1]], dtype=np.int8)
    loss = build_opml_sp(observed, heads=1, eps=0.0, **{"lambda": 1.0})
    index = torch.arange(3)
    distinct = loss(torch.tensor([[4.0, -4, -4], [-4, 4, -4], [-4, -4, 4]]), torch.tensor(observed), index=index)
    collapsed = loss(torch.tensor([[4.0, -4, -4], [4, -4, -4], [4, -4, -4]]), torch.tensor(observed), index=index)
    assert distinct < collapsed


def test_opml_sp_corrects_floor_rho_ap_n_labels_per_class_after_warmup():
    rng = np.random.default_rng(3)
    observed, train_logits = training_set(rng)
    loss = build_opml_sp(observed, rho=0.5, warmup=2.0)
    num_positive = (observed == 1).sum(0)
    for epoch in (1, 2):  # warmup: nothing flips
        loss.start_epoch(epoch, 10, train_logits=torch.tensor(train_logits))
        assert (loss.corrected_observed.numpy() == observed).all()

    current = np.repeat(observed[None], 2, axis=0)
    total_flips = 0
    for epoch in (3, 4):
        train_logits = train_logits + rng.normal(scale=0.3, size=train_logits.shape)
        loss.start_epoch(epoch, 10, train_logits=torch.tensor(train_logits))
        ap = sklearn_ap(train_logits, observed)
        corrected = loss.corrected_observed.numpy()
        for head in range(2):
            for c in range(3):
                count = math.floor(0.5 * ap[head, c] * num_positive[c] + 1e-9)
                candidates = np.nonzero(current[head, :, c] == 0)[0]
                top = candidates[np.argsort(-train_logits[head, candidates, c])[:count]]
                expected = current[head, :, c].copy()
                expected[top] = 1
                np.testing.assert_array_equal(corrected[head, :, c], expected)
                total_flips += count
        current = corrected.copy()
    assert total_flips >= 8  # the input does flip labels, in both rounds
    assert (current[observed[None].repeat(2, 0) == -1] == -1).all()  # observed negatives never flip


def test_opml_sp_corrections_become_positive_targets():
    observed = np.array([[1, 0], [1, 0], [0, 1], [1, 0]], dtype=np.int8)
    loss = build_opml_sp(observed, heads=1, rho=1.0, warmup=0.0, eps=0.0, **{"lambda": 0.0})
    train_logits = torch.tensor([[3.0, 2.0], [2.0, -2.0], [-1.0, 3.0], [1.0, -3.0]])  # AP = 1 for both classes
    loss.start_epoch(1, 10, train_logits=train_logits)
    # class 0: N_0 = 3, one unobserved candidate (row 2); class 1: N_1 = 1, floor(1 * 1 * 1) = 1 flip (row 0)
    assert loss.corrected_observed[0].tolist() == [[1, 1], [1, 0], [1, 1], [1, 0]]
    logits = np.array([[0.5, -0.5], [1.0, 0.2], [0.1, 0.3], [2.0, -1.0]])
    out = loss(torch.tensor(logits), torch.tensor(observed), index=torch.arange(4))
    assert out.item() == pytest.approx(soft_pair_value(logits, np.array([[1, 1], [1, 0], [1, 1], [1, 0]])), rel=1e-6)


def test_opml_sp_stacked_heads_equal_separate_losses():
    rng = np.random.default_rng(4)
    observed, train_logits = training_set(rng, rows=16)
    hparams = {"rho": 0.5, "warmup": 1.0, "lambda": 0.01}
    stacked = build_opml_sp(observed, heads=2, **hparams)
    separate = [build_opml_sp(observed, heads=1, **hparams) for _ in range(2)]
    for epoch in (1, 2, 3):
        train_logits = train_logits + rng.normal(scale=0.5, size=train_logits.shape)
        stacked.start_epoch(epoch, 3, train_logits=torch.tensor(train_logits))
        for head, loss in enumerate(separate):
            loss.start_epoch(epoch, 3, train_logits=torch.tensor(train_logits[head]))
        for batch in (np.arange(0, 8), np.arange(8, 16)):
            logits = torch.tensor(rng.normal(size=(2, 8, 3)), requires_grad=True)
            values = stacked(logits, torch.tensor(observed[batch]), index=torch.tensor(batch))
            values.sum().backward()
            for head, loss in enumerate(separate):
                single = logits[head].detach().clone().requires_grad_(True)
                loss(single, torch.tensor(observed[batch]), index=torch.tensor(batch)).backward()
                assert values[head].item() == pytest.approx(
                    loss(single.detach(), torch.tensor(observed[batch]), index=torch.tensor(batch)).item(), rel=1e-12
                )
                np.testing.assert_allclose(logits.grad[head].numpy(), single.grad.numpy(), rtol=1e-10)
    for head, loss in enumerate(separate):
        assert torch.equal(stacked.corrected_observed[head], loss.corrected_observed[0])
        assert torch.equal(stacked.class_eps[head], loss.class_eps[0])
    assert (stacked.corrected_observed.numpy() != observed).any()


def test_opml_sp_start_epoch_needs_train_logits():
    loss = build_opml_sp(np.array([[1, 0], [0, 1]], dtype=np.int8), heads=1)
    with pytest.raises(SpmlError, match="train_logits"):
        loss.start_epoch(1, 10)
