"""EM and EM+APL (Zhou et al., ECCV 2022): values, the gradient regime, per-dataset defaults, pseudo-labelling over epochs."""

import io
import math

import pytest
import torch

from spml_cache import losses
from spml_cache.runtime.errors import SpmlError
from loss_support import entropy, nl, sigmoid

LOGITS = [[2.0, -1.0, 0.5, -3.0], [-0.3, 1.2, -2.0, 0.7], [0.1, -0.4, 3.5, -1.5]]
OBSERVED = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, -1]]
C = 4


def em_term(x, z, alpha):
    p = sigmoid(x)
    if z == 1:
        return nl(p)
    if z == -1:
        return nl(1 - p)
    return -alpha * entropy(p)


@pytest.mark.parametrize("dataset, alpha", [("voc", 0.2), ("coco", 0.1), ("nus", 0.1), ("cub", 0.01), (None, 0.1)])
def test_em_value_with_per_dataset_alpha(dataset, alpha):
    loss = losses.build("em", num_classes=C, dataset=dataset)
    assert loss.alpha == alpha
    value = loss(torch.tensor(LOGITS, dtype=torch.float64), torch.tensor(OBSERVED))
    expected = sum(em_term(LOGITS[n][c], OBSERVED[n][c], alpha) for n in range(3) for c in range(C)) / (3 * C)
    assert value.item() == pytest.approx(expected, rel=1e-12)


def test_em_can_be_negative():
    logits = torch.tensor([[8.0, 0.0, 0.0, 0.0]])
    assert losses.build("em", num_classes=C, alpha=1.0)(logits, torch.tensor([[1, 0, 0, 0]])) < 0


def unobserved_gradient(name, x, **hparams):
    logits = torch.tensor([[3.0, x]], dtype=torch.float64, requires_grad=True)
    losses.build(name, num_classes=2, **hparams)(logits, torch.tensor([[1, 0]])).backward()
    return logits.grad[0, 1].item()


def test_em_gradient_vanishes_at_one_half_and_points_towards_it():
    assert unobserved_gradient("em", 0.0) == 0.0
    assert unobserved_gradient("em", 1.0) > 0  # descent lowers a positive logit towards p = 0.5
    assert unobserved_gradient("em", -1.0) < 0
    # closed form of Zhou et al. Eq. 5 for -alpha*H: alpha * x * p * (1 - p), over B*C = 2
    p = sigmoid(1.5)
    assert unobserved_gradient("em", 1.5, alpha=0.3) == pytest.approx(0.3 * 1.5 * p * (1 - p) / 2, rel=1e-12)
    assert unobserved_gradient("an", 0.0) == pytest.approx(0.5 / 2)  # AN's does not vanish there


def test_em_apl_per_dataset_defaults():
    observed = torch.tensor([[1, 0], [0, 1]])
    expected = {
        "voc": (0.2, 0.02, 5),
        "coco": (0.1, 0.9, 5),
        "nus": (0.1, 0.2, 4),
        "cub": (0.01, 0.4, 3),
    }
    for dataset, (alpha, beta, warmup) in expected.items():
        loss = losses.build("em_apl", num_classes=2, dataset=dataset, train_observed=observed)
        assert (loss.alpha, loss.beta, loss.warmup, loss.theta) == (alpha, beta, warmup, 0.9)
    loss = losses.build("em_apl", num_classes=2, dataset="voc", train_observed=observed, beta=0.5, warmup=2.0)
    assert (loss.beta, loss.warmup, type(loss.warmup)) == (0.5, 2, int)
    with pytest.raises(SpmlError, match="warmup"):
        losses.build("em_apl", num_classes=2, train_observed=observed, warmup=2.5)


# 12 training rows, 2 classes; U = (9, 10) unobserved entries
APL_OBSERVED = torch.tensor(
    [[1, 0], [0, 1], [1, 0], [0, 0], [0, 0], [1, 1], [0, 0], [0, 0], [0, 0], [0, 0], [0, 0], [0, 0]], dtype=torch.int8
)


def simulate_apl(theta, warmup, num_epochs, epoch_logits):
    """Independent restatement: after epoch t (warmup <= t < T), per class, pseudo-label the
    floor(theta * U_c / (T - warmup)) lowest-scoring entries still unobserved and unlabelled, s = p then."""
    rows, classes = APL_OBSERVED.shape
    flags = [[False] * classes for _ in range(rows)]
    soft = [[0.0] * classes for _ in range(rows)]
    history = {}
    for t in range(1, num_epochs + 1):
        if warmup <= t < num_epochs:
            scores = epoch_logits[t]  # the logits after epoch t
            for c in range(classes):
                unobserved = sum(1 for n in range(rows) if APL_OBSERVED[n, c] == 0)
                count = math.floor(theta * unobserved / (num_epochs - warmup) + 1e-9)
                candidates = [n for n in range(rows) if APL_OBSERVED[n, c] == 0 and not flags[n][c]]
                for n in sorted(candidates, key=lambda n: scores[n][c])[:count]:
                    flags[n][c] = True
                    soft[n][c] = sigmoid(scores[n][c])
        history[t] = ([row[:] for row in flags], [row[:] for row in soft])
    return history


def test_apl_counts_and_soft_targets_over_simulated_epochs():
    num_epochs, warmup, theta = 6, 2, 0.9  # 4 rounds: floor(0.9*9/4) = 2 and floor(0.9*10/4) = 2 per round
    generator = torch.Generator().manual_seed(0)
    epoch_logits = {t: torch.randn(12, 2, generator=generator, dtype=torch.float64) for t in range(1, num_epochs + 1)}
    expected = simulate_apl(theta, warmup, num_epochs, {t: v.tolist() for t, v in epoch_logits.items()})
    loss = losses.build("em_apl", num_classes=2, train_observed=APL_OBSERVED, warmup=warmup, theta=theta)
    counts = []
    for epoch in range(1, num_epochs + 1):
        # start_epoch(epoch) sees the logits after epoch - 1 (none before the first epoch)
        loss.start_epoch(epoch, num_epochs, epoch_logits.get(epoch - 1))
        flags, soft = expected[epoch - 1] if epoch > 1 else ([[False, False]] * 12, [[0.0, 0.0]] * 12)
        assert loss.pseudo_negative[0].tolist() == flags
        assert torch.allclose(loss.soft_target[0].double(), torch.tensor(soft, dtype=torch.float64), rtol=1e-6)
        counts.append(loss.pseudo_negative[0].sum(dim=0).tolist())
    assert counts == [[0, 0], [0, 0], [2, 2], [4, 4], [6, 6], [8, 8]]  # rounds after epochs 2, 3, 4, 5
    assert not loss.pseudo_negative[0][APL_OBSERVED != 0].any()


def test_apl_labels_are_permanent_and_ignore_later_scores():
    loss = losses.build("em_apl", num_classes=2, train_observed=APL_OBSERVED, warmup=1, theta=0.9)
    low_first = torch.arange(12, dtype=torch.float32).unsqueeze(1).repeat(1, 2) - 6
    loss.start_epoch(2, 3, low_first)  # rounds = 2: floor(0.9*9/2) = 4, floor(0.9*10/2) = 4
    first = loss.pseudo_negative.clone(), loss.soft_target.clone()
    assert first[0][0].sum(dim=0).tolist() == [4, 4]
    loss.start_epoch(3, 3, -low_first)  # new scores rank the other way; earlier labels and targets stay
    assert torch.all(loss.pseudo_negative[first[0]])
    assert torch.equal(loss.soft_target[first[0]], first[1][first[0]])
    assert loss.pseudo_negative[0].sum(dim=0).tolist() == [8, 8]
    loss.start_epoch(4, 3, low_first)  # past the last epoch: nothing more
    assert loss.pseudo_negative[0].sum(dim=0).tolist() == [8, 8]


def test_em_apl_value_after_pseudo_labelling():
    loss = losses.build("em_apl", num_classes=2, train_observed=APL_OBSERVED, warmup=1, theta=0.9).double()
    train_logits = torch.linspace(-3, 3, 24, dtype=torch.float64).reshape(12, 2)
    loss.start_epoch(2, 3, train_logits)
    flags, soft = loss.pseudo_negative[0].tolist(), loss.soft_target[0].tolist()
    index = torch.tensor([0, 3, 4, 10, 11])
    logits = [[0.3, -1.0], [1.2, 0.4], [-0.6, 2.0], [0.9, -0.2], [-1.5, 0.05]]
    value = loss(torch.tensor(logits, dtype=torch.float64), APL_OBSERVED[index], index=index)
    alpha, beta = loss.alpha, loss.beta
    total = 0.0
    for n, row in enumerate(index.tolist()):
        for c in range(2):
            x, p = logits[n][c], sigmoid(logits[n][c])
            if APL_OBSERVED[row, c] == 0 and flags[row][c]:
                total += beta * (soft[row][c] * nl(p) + (1 - soft[row][c]) * nl(1 - p))
            else:
                total += em_term(x, int(APL_OBSERVED[row, c]), alpha)
    assert any(flags[row][c] for row in index.tolist() for c in range(2))
    assert value.item() == pytest.approx(total / 10, rel=1e-12)


def test_em_apl_before_pseudo_labels_equals_em():
    loss = losses.build("em_apl", num_classes=2, train_observed=APL_OBSERVED, dataset="voc")
    em = losses.build("em", num_classes=2, dataset="voc")
    logits, index = torch.randn(4, 2), torch.tensor([1, 2, 3, 6])
    assert loss(logits, APL_OBSERVED[index], index=index) == em(logits, APL_OBSERVED[index])


def test_em_apl_stacked_equals_separate_heads_and_reloads():
    train_logits = torch.randn(3, 12, 2, generator=torch.Generator().manual_seed(1))
    stacked = losses.build("em_apl", num_classes=2, train_observed=APL_OBSERVED, num_heads=3, warmup=1)
    alone = [losses.build("em_apl", num_classes=2, train_observed=APL_OBSERVED, warmup=1) for _ in range(3)]
    for epoch in (1, 2, 3):
        stacked.start_epoch(epoch, 4, train_logits)
        for head, loss in enumerate(alone):
            loss.start_epoch(epoch, 4, train_logits[head])
    logits, index = torch.randn(3, 5, 2), torch.tensor([0, 4, 7, 8, 11])
    values = stacked(logits, APL_OBSERVED[index], index=index)
    for head, loss in enumerate(alone):
        assert torch.equal(stacked.pseudo_negative[head], loss.pseudo_negative[0])
        assert values[head].item() == pytest.approx(loss(logits[head], APL_OBSERVED[index], index=index).item())
    buffer = io.BytesIO()
    torch.save(stacked.head_state_dict(2), buffer)
    buffer.seek(0)
    fresh = losses.build("em_apl", num_classes=2, train_observed=APL_OBSERVED, warmup=1)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(fresh.pseudo_negative, alone[2].pseudo_negative)
    assert torch.equal(fresh.soft_target, alone[2].soft_target)
