"""EPR and ROLE (Cole et al., CVPR 2021): values, k resolution, Theta's init, stop-gradients, stacking and checkpoints."""

import io
import math

import pytest
import torch

from spml_cache import losses
from spml_cache.runtime.errors import SpmlError
from loss_support import nl, sigmoid

LOGITS = [[2.0, -1.0, 0.5, -3.0], [-0.3, 1.2, -2.0, 0.7], [0.1, -0.4, 3.5, -1.5]]
OBSERVED = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, -1]]  # the last entry: an observed negative
C = 4
TRAIN_OBSERVED = torch.tensor(
    [[1, 0, 0, 0], [0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 1, -1], [0, 0, 0, 1]], dtype=torch.int8
)
INDEX = torch.tensor([0, 2, 4])  # TRAIN_OBSERVED[INDEX] == OBSERVED


def logit(q):
    return math.log(q / (1 - q))


def r_k(probabilities, k):
    """((1/B) * sum_n sum_c p_nc - k)^2 / C^2"""
    k_hat = sum(sum(row) for row in probabilities) / len(probabilities)
    return ((k_hat - k) / len(probabilities[0])) ** 2


def observed_term(x, z):
    if z == 1:
        return nl(sigmoid(x))
    if z == -1:
        return nl(1 - sigmoid(x))
    return 0.0


def test_epr_value_with_the_datasets_k():
    probabilities = [[sigmoid(x) for x in row] for row in LOGITS]
    entries = sum(observed_term(LOGITS[n][c], OBSERVED[n][c]) for n in range(3) for c in range(C)) / (3 * C)
    for dataset, k in [("voc", 1.5), ("coco", 2.9), ("nus", 1.9), ("cub", 31.4)]:
        loss = losses.build("epr", num_classes=C if dataset != "cub" else 40, dataset=dataset)
        assert loss.k == k
    loss = losses.build("epr", num_classes=C, dataset="voc")
    value = loss(torch.tensor(LOGITS, dtype=torch.float64), torch.tensor(OBSERVED))
    assert value.item() == pytest.approx(entries + r_k(probabilities, 1.5), rel=1e-12)


def test_k_override_and_unknown_dataset():
    assert losses.build("epr", num_classes=C, dataset="voc", k=2.0).k == 2.0
    assert losses.build("role", num_classes=C, dataset="csv", k=1.2, train_observed=TRAIN_OBSERVED).k == 1.2
    for name in ["epr", "role"]:
        with pytest.raises(SpmlError, match=r"--hp k="):
            losses.build(name, num_classes=C, dataset="csv", train_observed=TRAIN_OBSERVED)


def build_role(**kwargs):
    return losses.build("role", num_classes=C, dataset="voc", train_observed=TRAIN_OBSERVED, **kwargs)


def test_role_theta_init():
    theta = build_role(seed=7).theta.detach()
    assert theta.shape == (1, 6, C)
    observed = TRAIN_OBSERVED
    assert torch.allclose(theta[0][observed == 1], torch.tensor(logit(0.995)))
    assert torch.allclose(theta[0][observed == -1], torch.tensor(logit(0.005)))
    unobserved = theta[0][observed == 0]
    assert unobserved.min() >= logit(0.4) and unobserved.max() <= logit(0.6)
    # the uniform part is one [N, C] draw of a generator seeded with the seed, mapped onto [logit(.4), logit(.6)]
    draw = torch.rand(6, C, generator=torch.Generator().manual_seed(7))
    expected = logit(0.4) + (logit(0.6) - logit(0.4)) * draw
    assert torch.allclose(theta[0][observed == 0], expected[observed == 0])
    assert not torch.equal(build_role(seed=8).theta, build_role(seed=7).theta)


def test_role_stacked_heads_start_like_the_head_alone():
    alone = build_role(seed=3).theta.detach()
    assert torch.equal(build_role(seed=3, num_heads=3).theta.detach(), alone.expand(3, -1, -1))
    per_head = build_role(seed=[3, 5], num_heads=2).theta.detach()
    assert torch.equal(per_head[0], alone[0])
    assert torch.equal(per_head[1], build_role(seed=5).theta.detach()[0])
    with pytest.raises(SpmlError, match="seeds"):
        build_role(seed=[1, 2, 3], num_heads=2)


def test_role_lr_mult():
    assert build_role().theta.lr_mult == 10
    assert build_role(lr_mult=5.0).theta.lr_mult == 5.0
    assert [name for name, _ in build_role().named_parameters()] == ["theta"]


def set_theta(loss, values):
    with torch.no_grad():
        loss.theta.copy_(torch.as_tensor(values, dtype=torch.float64))


THETA = [
    [1.5, 0.2, -0.1, 0.3],
    [0.0, -0.5, 0.4, 0.1],
    [-0.2, 2.0, 0.3, -0.6],
    [0.1, 0.1, 0.1, 0.1],
    [-0.7, 0.25, 1.0, -2.5],
    [0.3, -0.3, 0.6, 0.9],
]


def test_role_value():
    loss = build_role().double()
    set_theta(loss, [THETA])
    value = loss(torch.tensor(LOGITS, dtype=torch.float64), torch.tensor(OBSERVED), index=INDEX)
    theta_rows = [THETA[i] for i in INDEX.tolist()]
    total = 0.0
    for n in range(3):
        for c in range(C):
            x, t, z = LOGITS[n][c], theta_rows[n][c], OBSERVED[n][c]
            p, q = sigmoid(x), sigmoid(t)
            cross_f = q * nl(p) + (1 - q) * nl(1 - p)
            cross_q = p * nl(q) + (1 - p) * nl(1 - q)
            total += 0.5 * (observed_term(x, z) + observed_term(t, z)) + 0.5 * (cross_f + cross_q)
    p_matrix = [[sigmoid(x) for x in row] for row in LOGITS]
    q_matrix = [[sigmoid(t) for t in row] for row in theta_rows]
    expected = total / (3 * C) + 0.5 * (r_k(p_matrix, 1.5) + r_k(q_matrix, 1.5))
    assert value.item() == pytest.approx(expected, rel=1e-12)


def test_role_gradients_follow_the_stop_gradient_structure():
    """Closed forms: each side sees the other only as a constant target.

    dL/dx = [0.5 (p - 1) [z=1] + 0.5 (p - q)] / (B C) + (k_hat(P) - k) / C^2 * p (1 - p) / B
    dL/dtheta = [0.5 (q - 1) [z=1] + 0.5 (q - p)] / (B C) + (k_hat(Q) - k) / C^2 * q (1 - q) / B
    (no observed negative in this batch; rows of theta outside the batch get exactly 0).
    """
    observed = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]]
    index = [0, 2, 5]
    loss = build_role().double()
    set_theta(loss, [THETA])
    logits = torch.tensor(LOGITS, dtype=torch.float64, requires_grad=True)
    loss(logits, torch.tensor(observed), index=torch.tensor(index)).backward()
    batch, k = 3, 1.5
    p = [[sigmoid(x) for x in row] for row in LOGITS]
    q = [[sigmoid(t) for t in THETA[i]] for i in index]
    k_hat_p = sum(map(sum, p)) / batch
    k_hat_q = sum(map(sum, q)) / batch
    for n in range(batch):
        for c in range(C):
            positive = 1.0 if observed[n][c] == 1 else 0.0
            grad_x = (0.5 * (p[n][c] - 1) * positive + 0.5 * (p[n][c] - q[n][c])) / (batch * C)
            grad_x += (k_hat_p - k) / C**2 * p[n][c] * (1 - p[n][c]) / batch
            grad_t = (0.5 * (q[n][c] - 1) * positive + 0.5 * (q[n][c] - p[n][c])) / (batch * C)
            grad_t += (k_hat_q - k) / C**2 * q[n][c] * (1 - q[n][c]) / batch
            assert logits.grad[n, c].item() == pytest.approx(grad_x, rel=1e-9, abs=1e-15)
            assert loss.theta.grad[0, index[n], c].item() == pytest.approx(grad_t, rel=1e-9, abs=1e-15)
    outside = [i for i in range(6) if i not in index]
    assert torch.all(loss.theta.grad[0, outside] == 0)


def test_role_stacked_equals_separate_heads():
    stacked_logits = torch.tensor([LOGITS, [[-x / 2 for x in row] for row in LOGITS]], dtype=torch.float64)
    stacked = build_role(num_heads=2, seed=[0, 1]).double()
    values = stacked(stacked_logits, torch.tensor(OBSERVED), index=INDEX)
    values.sum().backward()
    for head in range(2):
        alone = build_role(seed=head).double()
        value = alone(stacked_logits[head], torch.tensor(OBSERVED), index=INDEX)
        value.backward()
        assert values[head].item() == pytest.approx(value.item(), rel=1e-12)
        assert torch.allclose(stacked.theta.grad[head], alone.theta.grad[0], rtol=1e-12, atol=0)
    with pytest.raises(SpmlError, match="head"):
        stacked(stacked_logits[0], torch.tensor(OBSERVED), index=INDEX)


def test_role_needs_index_and_train_observed():
    with pytest.raises(SpmlError, match="train_observed"):
        losses.build("role", num_classes=C, dataset="voc")
    with pytest.raises(SpmlError, match="index"):
        build_role()(torch.tensor(LOGITS), torch.tensor(OBSERVED))


def test_role_checkpoint_reloads_into_a_single_head_loss():
    trained = build_role(seed=1)
    set_theta(trained, [THETA])
    buffer = io.BytesIO()
    torch.save(trained.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert list(state) == ["theta"] and state["theta"].shape == (1, 6, C)
    fresh = build_role(seed=2)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.theta, trained.theta)
    logits = torch.tensor(LOGITS)
    assert fresh(logits, torch.tensor(OBSERVED), index=INDEX) == trained(logits, torch.tensor(OBSERVED), index=INDEX)
    # head 1 of a stack, sliced, is what a single-head loss holds
    stack = build_role(num_heads=2, seed=[5, 1])
    assert torch.equal(stack.head_state_dict(1)["theta"], build_role(seed=1).theta.detach())
