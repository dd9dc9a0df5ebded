"""What every loss does with an observed negative (z = -1; docs/losses.md, "Observed negatives"), against an
independent restatement of its term at such an entry: scalar math here, derivatives by central differences."""

import math

import pytest
import torch

from spml_cache import losses

LOGITS = [[2.0, -1.0, 0.5, -3.0, 4.0], [-0.3, 1.2, -2.0, 0.7, 0.1], [0.1, -0.4, 3.5, -1.5, 2.5]]
OBSERVED = [[1, -1, 0, 0, -1], [0, 1, -1, 0, 0], [0, -1, 1, 0, -1]]  # the -1 entries carry logits of both signs


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def known_zero(x):  # nl(1 - p)
    return -math.log(1 - sigmoid(x))


def focal(x, g=2.0):
    return sigmoid(x) ** g * known_zero(x)


def asl(x, gn=4.0, clip=0.05):
    shifted = max(sigmoid(x) - clip, 0.0)
    return shifted**gn * -math.log(1 - shifted)


# The term each loss gives an entry with z = -1, at its default hyperparameters (the natural reading, "a known 0",
# where the paper has none). Every entry of the batch is separate for these losses: the gradient of the loss at an
# observed negative's logit is this term's derivative over B*C.
TERM_AT_OBSERVED_NEGATIVE = {
    "an": known_zero, "l1r": known_zero, "l2r": known_zero, "entmin": known_zero, "em": known_zero,
    "em_apl": known_zero, "gr": known_zero, "ll_r": known_zero, "ll_ct": known_zero, "ll_cp": known_zero,
    "bce_observed": known_zero,
    "an_ls_neg": known_zero,  # only assumed negatives are smoothed
    "wan": known_zero,  # weight 1, not gamma
    "an_ls": lambda x: -(0.1 * math.log(sigmoid(x)) + 0.9 * math.log(1 - sigmoid(x))),  # every target smoothed
    "focal": focal,
    "splc": focal,
    "asl": asl,
    "hill": lambda x: (1.5 - sigmoid(x)) * sigmoid(x) ** 2,
}
# Losses that treat an observed negative exactly as an unobserved label (both are negatives of their pairs), and the
# oracles, which read the full labels instead of z.
SAME_AS_UNOBSERVED = ("pr", "zlpr", "opml", "bce", "bce_ls", "iun")
# Read with the rest of their terms in their family's file (test_losses_estimating.py restates z = -1 there).
RESTATED_ELSEWHERE = ("epr", "role", "opml_sp", "vlpl", "gpr", "crisp")  # opml_sp: below; the text-side losses and
# crisp: tests/test_losses_vision_language.py, tests/test_losses_crisp.py


def derivative(f, x, h=1e-5):
    return (f(x + h) - f(x - h)) / (2 * h)


def batch(observed=OBSERVED):
    logits = torch.tensor(LOGITS, dtype=torch.float64, requires_grad=True)
    observed = torch.tensor(observed, dtype=torch.int8)
    labels = (observed == 1).to(torch.uint8)
    return logits, observed, labels


def value(name, logits, observed, labels, epoch=1):
    loss = losses.build(name, num_classes=observed.shape[1], dataset=None, train_observed=observed, seed=0).double()
    loss.start_epoch(epoch, 10, logits.detach() if loss.needs_train_logits else None)
    return loss(logits, observed, labels=labels, index=torch.arange(len(observed)))


def test_every_loss_says_what_it_does_with_an_observed_negative():
    assert set(TERM_AT_OBSERVED_NEGATIVE) | set(SAME_AS_UNOBSERVED) | set(RESTATED_ELSEWHERE) == set(losses.names())
    for row in losses.describe():
        assert row["observed_negative"], row["name"]


@pytest.mark.parametrize("name", sorted(TERM_AT_OBSERVED_NEGATIVE))
def test_the_term_at_an_observed_negative(name):
    logits, observed, labels = batch()
    value(name, logits, observed, labels).backward()
    size = observed.numel()
    for n, c in (observed == -1).nonzero().tolist():
        expected = derivative(TERM_AT_OBSERVED_NEGATIVE[name], LOGITS[n][c]) / size
        assert logits.grad[n, c].item() == pytest.approx(expected, rel=1e-6, abs=1e-12), (n, c)


@pytest.mark.parametrize("name", SAME_AS_UNOBSERVED)
def test_an_observed_negative_counts_as_an_unobserved_label(name):
    logits, observed, labels = batch()
    unobserved = observed.clone()
    unobserved[observed == -1] = 0
    assert value(name, logits, observed, labels).item() == pytest.approx(
        value(name, logits, unobserved, labels).item(), rel=1e-12)


def test_corrections_never_touch_an_observed_negative():
    """SPLC from its switch epoch and the large-loss family past epoch 1 rework unobserved entries only: a confident
    observed negative (p > tau, the largest loss of its batch) keeps the plain negative term."""
    for name, epoch, hparams in (("splc", 3, {}), ("ll_r", 5, {}), ("ll_ct", 5, {}), ("ll_cp", 5, {})):
        logits, observed, labels = batch()
        loss = losses.build(name, num_classes=5, dataset=None, train_observed=observed, seed=0, **hparams).double()
        loss.start_epoch(epoch, 10, None)
        loss(logits, observed, labels=labels, index=torch.arange(3)).backward()
        term = TERM_AT_OBSERVED_NEGATIVE[name]
        for n, c in (observed == -1).nonzero().tolist():
            assert logits.grad[n, c].item() == pytest.approx(derivative(term, LOGITS[n][c]) / 15, rel=1e-6), name


def test_opml_sp_gives_an_observed_negative_the_target_0():
    """Its unknowns' soft target is eps_c, an observed negative's 0: with eps = 0 the two are the same entry."""
    logits, observed, labels = batch()
    unobserved = observed.clone()
    unobserved[observed == -1] = 0

    def opml_sp(z, eps):
        loss = losses.build("opml_sp", num_classes=5, dataset=None, train_observed=observed, seed=0, eps=eps).double()
        loss.corrected_observed.copy_(z)
        with torch.no_grad():  # a value before any start_epoch (eps_c = eps): an evaluation, not a training call
            return loss(logits, z, index=torch.arange(3)).item()

    assert opml_sp(observed, 0.0) == pytest.approx(opml_sp(unobserved, 0.0), rel=1e-12)
    assert opml_sp(observed, 0.3) != pytest.approx(opml_sp(unobserved, 0.3), rel=1e-6)


def test_bce_observed_is_bce_over_the_observed_entries():
    logits, observed, labels = batch()
    terms = [[-math.log(sigmoid(x)) if z == 1 else known_zero(x) if z == -1 else 0.0 for x, z in zip(xs, zs)]
             for xs, zs in zip(LOGITS, OBSERVED)]
    assert value("bce_observed", logits, observed, labels).item() == pytest.approx(sum(map(sum, terms)) / 15,
                                                                                   rel=1e-12)
