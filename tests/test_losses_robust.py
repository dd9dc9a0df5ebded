"""focal, asl, hill, splc against docs/losses.md ("Robust-loss family"), restated here with numpy loops."""


import numpy as np
import pytest
import torch

from spml_cache import losses
from loss_support import nl, sigmoid

# one head, 2 images x 4 classes: an observed positive per row, one observed negative (partial-label setting)
LOGITS = np.array([[2.0, -1.0, 0.5, -4.0], [-0.3, 1.5, -2.0, 3.0]])
OBSERVED = np.array([[1, 0, 0, 0], [0, 1, -1, 0]])


def mean_of_terms(term, logits=LOGITS, observed=OBSERVED):
    """sum over entries of term(x, z) / (B*C), written as plain loops."""
    total = 0.0
    for n in range(logits.shape[0]):
        for c in range(logits.shape[1]):
            total += term(logits[n, c], observed[n, c])
    return total / logits.size


def an_term(x, z):
    p = sigmoid(x)
    return nl(p) if z == 1 else nl(1 - p)


def focal_term(x, z, g=2.0):
    p = sigmoid(x)
    return (1 - p) ** g * nl(p) if z == 1 else p**g * nl(1 - p)


def asl_term(x, z, gp=0.0, gn=4.0, clip=0.05):
    p = sigmoid(x)
    if z == 1:
        return (1 - p) ** gp * nl(p)
    pm = max(p - clip, 0.0)
    return pm**gn * nl(1 - pm)


def hill_term(x, z, lam=1.5, m=1.0, g=2.0):
    if z == 1:
        pm = sigmoid(x - m)
        return (1 - pm) ** g * nl(pm)
    p = sigmoid(x)
    return (lam - p) * p**2


def splc_term(x, z, corrected, tau=0.6, m=1.0, g=2.0):
    p = sigmoid(x)
    if z == 1:
        pm = sigmoid(x - m)
        return (1 - pm) ** g * nl(pm)
    if corrected and z == 0 and p > tau:
        return (1 - p) ** g * nl(p)
    return p**g * nl(1 - p)


def value(name, logits=LOGITS, observed=OBSERVED, epoch=None, **hparams):
    loss = losses.build(name, num_classes=logits.shape[-1], **hparams)
    if epoch is not None:
        loss.start_epoch(epoch, 10)
    return loss(torch.tensor(logits), torch.tensor(observed)).item()


def autograd_gradient(name, logits=LOGITS, observed=OBSERVED, **hparams):
    x = torch.tensor(logits, requires_grad=True)
    losses.build(name, num_classes=logits.shape[-1], **hparams)(x, torch.tensor(observed)).backward()
    return x.grad.numpy()


def numeric_gradient(term, logits=LOGITS, observed=OBSERVED, h=1e-6):
    """Central differences of the restated loss: the full derivative, focusing weights included."""
    grad = np.zeros_like(logits)
    for n in range(logits.shape[0]):
        for c in range(logits.shape[1]):
            up, down = logits.copy(), logits.copy()
            up[n, c] += h
            down[n, c] -= h
            grad[n, c] = (mean_of_terms(term, up, observed) - mean_of_terms(term, down, observed)) / (2 * h)
    return grad


def test_focal_value():
    assert value("focal") == pytest.approx(mean_of_terms(focal_term), rel=1e-12)


def test_focal_with_g_zero_is_an():
    assert value("focal", g=0.0) == pytest.approx(mean_of_terms(an_term), rel=1e-12)


def test_focal_weights_are_not_detached():
    expected = numeric_gradient(focal_term)
    np.testing.assert_allclose(autograd_gradient("focal"), expected, rtol=1e-6, atol=1e-9)
    # a detached weight would give (1-p)^g * dnl(p)/dx = -(1-p)^(g+1) on the positive (0, 0): a different number
    p = sigmoid(LOGITS[0, 0])
    assert expected[0, 0] * LOGITS.size != pytest.approx(-((1 - p) ** 3), rel=1e-3)


def test_asl_value_shifts_easy_negatives_to_zero():
    assert value("asl") == pytest.approx(mean_of_terms(asl_term), rel=1e-12)
    # x = -4: p = 0.018 < clip, so the entry costs nothing and gets no gradient
    assert autograd_gradient("asl")[0, 3] == 0.0


def test_asl_with_gn_zero_clip_zero_gp_zero_is_an():
    assert value("asl", gp=0.0, gn=0.0, clip=0.0) == pytest.approx(mean_of_terms(an_term), rel=1e-12)


def test_asl_gradient_keeps_the_focusing_weights():
    np.testing.assert_allclose(
        autograd_gradient("asl", gp=1.0), numeric_gradient(lambda x, z: asl_term(x, z, gp=1.0)), rtol=1e-6, atol=1e-9
    )


def test_hill_value():
    assert value("hill") == pytest.approx(mean_of_terms(hill_term), rel=1e-12)


def test_hill_negative_gradient_is_the_papers_hill():
    # Chen et al., IJCAI 2024, eq. 33: d[(lam - p) p^2]/dx = 3 p^2 (1-p)^2 at lam = 1.5; zero at both ends, largest at p = 0.5
    grid = np.linspace(-8, 8, 9).reshape(1, -1)
    grad = autograd_gradient("hill", logits=grid, observed=np.zeros_like(grid, dtype=int))
    p = 1 / (1 + np.exp(-grid))
    np.testing.assert_allclose(grad * grid.size, 3 * p**2 * (1 - p) ** 2, rtol=1e-10)
    assert np.argmax(grad) == 4 and grad[0, 0] < 1e-6 and grad[0, -1] < 1e-6


def test_hill_positive_gradient_matches_the_margin_term():
    np.testing.assert_allclose(autograd_gradient("hill"), numeric_gradient(hill_term), rtol=1e-6, atol=1e-9)


def test_splc_before_its_switch_epoch_corrects_nothing():
    expected = mean_of_terms(lambda x, z: splc_term(x, z, corrected=False))
    assert value("splc") == pytest.approx(expected, rel=1e-12)
    assert value("splc", epoch=1) == pytest.approx(expected, rel=1e-12)


def test_splc_from_epoch_two_treats_confident_unobserved_entries_as_positives():
    corrected = mean_of_terms(lambda x, z: splc_term(x, z, corrected=True))
    uncorrected = mean_of_terms(lambda x, z: splc_term(x, z, corrected=False))
    assert corrected != pytest.approx(uncorrected)  # (1, 3) has p = 0.95 > tau: the input exercises the switch
    assert value("splc", epoch=2) == pytest.approx(corrected, rel=1e-12)
    assert value("splc", epoch=7) == pytest.approx(corrected, rel=1e-12)
    # the corrected entry is pushed up, like a positive
    loss = losses.build("splc", num_classes=4)
    loss.start_epoch(2, 10)
    x = torch.tensor(LOGITS, requires_grad=True)
    loss(x, torch.tensor(OBSERVED)).backward()
    assert x.grad[1, 3] < 0


def test_splc_never_flips_an_observed_negative():
    observed = np.array([[1, -1], [0, 1]])
    logits = np.array([[1.0, 3.0], [3.0, 1.0]])  # both non-positive entries have p = 0.95 > tau
    expected = mean_of_terms(lambda x, z: splc_term(x, z, corrected=True), logits, observed)
    assert value("splc", logits=logits, observed=observed, epoch=2) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", ["focal", "asl", "hill", "splc"])
def test_extreme_logits_stay_finite(name):
    x = torch.tensor([[-200.0, 200.0, 0.0], [200.0, -200.0, 30.0]], requires_grad=True)
    loss = losses.build(name, num_classes=3)
    loss.start_epoch(3, 10)
    out = loss(x, torch.tensor([[1, 0, 0], [1, 0, -1]]))
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(x.grad).all()
