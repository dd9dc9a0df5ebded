"""gr against docs/losses.md ("Generalized Robust Loss") and Chen et al., IJCAI 2024 (eqs. 5-14, 18; Table 6)."""

import math

import numpy as np
import pytest
import torch

from spml_cache import losses

LOGITS = np.array([[2.0, -1.0, 0.5, -3.0, 1.2], [-0.3, 1.5, -2.0, 3.0, 0.0]])
OBSERVED = np.array([[1, 0, 0, 0, 0], [0, 1, -1, 0, 0]])

START = {"w": 0.0, "b": -2.0, "mu": 0.5, "sigma": 2.0}
TABLE_6 = {  # (wT, bT, muT, sigmaT, q2, q3)
    "voc": (2, -2, 0.8, 0.5, 0.01, 1.0),
    "coco": (10, -8, 0.8, 0.5, 0.01, 1.0),
    "nus": (10, -8, 0.8, 0.5, 0.01, 1.0),
    "cub": (10, -8, 0.8, 0.5, 0.01, 1.5),
}


def schedule(dataset, epoch, num_epochs):
    """w, b lag one epoch: max(e-1, 0)/T; mu, sigma: e/T."""
    w_end, b_end, mu_end, sigma_end, _, _ = TABLE_6[dataset]
    lag, now = max(epoch - 1, 0) / num_epochs, epoch / num_epochs
    return {
        "w": START["w"] + (w_end - START["w"]) * lag,
        "b": START["b"] + (b_end - START["b"]) * lag,
        "mu": START["mu"] + (mu_end - START["mu"]) * now,
        "sigma": START["sigma"] + (sigma_end - START["sigma"]) * now,
    }


def gr_value(logits, observed, w, b, mu, sigma, q2, q3):
    total = 0.0
    for n in range(logits.shape[0]):
        for c in range(logits.shape[1]):
            p = 1 / (1 + math.exp(-logits[n, c]))
            if observed[n, c] == 1:
                total += -math.log(p)
            elif observed[n, c] == -1:
                total += -math.log(1 - p)
            else:
                k = 1 / (1 + math.exp(-(w * p + b)))
                v = math.exp(-((p - mu) ** 2) / (2 * sigma**2))
                loss_2 = (1 - p**q2) / q2
                loss_3 = (1 - (1 - p) ** q3) / q3
                total += v * (k * loss_2 + (1 - k) * loss_3)
    return total / logits.size


def test_per_dataset_defaults_are_table_6():
    for dataset, (w_end, b_end, mu_end, sigma_end, q2, q3) in TABLE_6.items():
        hp = losses.build("gr", num_classes=5, dataset=dataset).hparams
        assert (hp["wT"], hp["bT"], hp["muT"], hp["sigmaT"], hp["q2"], hp["q3"]) == (w_end, b_end, mu_end, sigma_end, q2, q3)
        assert (hp["w0"], hp["b0"], hp["mu0"], hp["sigma0"]) == (0, -2, 0.5, 2)
    assert losses.build("gr", num_classes=5, dataset="voc", bT=-5.0).hparams["bT"] == -5.0  # overrides win


@pytest.mark.parametrize("dataset, num_epochs", [("voc", 8), ("coco", 8), ("cub", 10)])
def test_schedules_at_epochs_one_two_and_last(dataset, num_epochs):
    loss = losses.build("gr", num_classes=5, dataset=dataset)
    assert (loss.w, loss.b, loss.mu, loss.sigma) == (0.0, -2.0, 0.5, 2.0)  # before the first epoch
    for epoch in (1, 2, num_epochs):
        loss.start_epoch(epoch, num_epochs)
        expected = schedule(dataset, epoch, num_epochs)
        for key in ("w", "b", "mu", "sigma"):
            assert getattr(loss, key) == pytest.approx(expected[key], abs=1e-12)
    # spelled out: epoch 1 keeps w, b at their start; the last epoch reaches mu_T, sigma_T but w, b only (T-1)/T
    loss.start_epoch(1, num_epochs)
    assert (loss.w, loss.b) == (0.0, -2.0)
    loss.start_epoch(num_epochs, num_epochs)
    w_end = TABLE_6[dataset][0]
    assert loss.w == pytest.approx(w_end * (num_epochs - 1) / num_epochs)
    assert (loss.mu, loss.sigma) == (pytest.approx(0.8), pytest.approx(0.5))


@pytest.mark.parametrize("dataset, epoch", [("voc", 3), ("coco", 8), ("cub", 1)])
def test_value_matches_the_formula(dataset, epoch):
    loss = losses.build("gr", num_classes=5, dataset=dataset)
    loss.start_epoch(epoch, 8)
    q2, q3 = TABLE_6[dataset][4:]
    expected = gr_value(LOGITS, OBSERVED, **schedule(dataset, epoch, 8), q2=q2, q3=q3)
    assert loss(torch.tensor(LOGITS), torch.tensor(OBSERVED)).item() == pytest.approx(expected, rel=1e-10)


def test_k_and_v_are_detached():
    # Chen et al., eq. 18 weighted by v: on a missing label dL/dx = v [(1-k)(1-p)^q3 p - k p^q2 (1-p)], k and v constant
    loss = losses.build("gr", num_classes=5, dataset="coco")
    loss.start_epoch(6, 8)
    s = schedule("coco", 6, 8)
    x = torch.tensor(LOGITS, requires_grad=True)
    loss(x, torch.tensor(OBSERVED)).backward()
    p = 1 / (1 + np.exp(-LOGITS))
    k = 1 / (1 + np.exp(-(s["w"] * p + s["b"])))
    v = np.exp(-((p - s["mu"]) ** 2) / (2 * s["sigma"] ** 2))
    expected = v * ((1 - k) * (1 - p) * p - k * p**0.01 * (1 - p))
    expected = np.where(OBSERVED == 1, -(1 - p), np.where(OBSERVED == -1, p, expected)) / LOGITS.size
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-9)


def test_zero_slope_and_vanishing_k_reduce_to_weighted_l3():
    loss = losses.build("gr", num_classes=5, w0=0.0, wT=0.0, b0=-1e4, bT=-1e4, q3=1.5)
    loss.start_epoch(4, 8)
    mu, sigma = 0.5 + 0.3 * 4 / 8, 2.0 - 1.5 * 4 / 8
    p = 1 / (1 + np.exp(-LOGITS))
    v_l3 = np.exp(-((p - mu) ** 2) / (2 * sigma**2)) * (1 - (1 - p) ** 1.5) / 1.5
    out = loss(torch.tensor(LOGITS), torch.zeros(LOGITS.shape))  # every label missing
    assert out.item() == pytest.approx(v_l3.mean(), rel=1e-12)


def test_early_gradient_lifts_small_p_and_late_gradient_lifts_large_p():
    # Chen et al., C.5: with k constant (w = 0) the gradient is negative for small p; late (COCO's beta_T, threshold
    # -b/w = 0.8), negative near p = 1 as well, so a likely false negative is pushed up
    grid = torch.tensor([[-4.0, 4.0]], dtype=torch.float64)
    for epoch, entry in ((1, 0), (8, 1)):
        loss = losses.build("gr", num_classes=2, dataset="coco")
        loss.start_epoch(epoch, 8)
        x = grid.clone().requires_grad_(True)
        loss(x, torch.zeros(1, 2)).backward()
        assert x.grad[0, entry] < 0


def test_extreme_logits_stay_finite():
    loss = losses.build("gr", num_classes=3, dataset="cub")
    loss.start_epoch(5, 10)
    x = torch.tensor([[-200.0, 200.0, 0.0], [200.0, -200.0, 30.0]], requires_grad=True)
    out = loss(x, torch.tensor([[1, 0, 0], [1, 0, -1]]))
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(x.grad).all()
