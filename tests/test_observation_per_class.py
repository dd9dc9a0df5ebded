"""The per-class budget rule `per-class:N`: per class, N of its positive and N of its negative images observed,
in the training rows and (with the seed + 1) in the validation rows on their own."""

from __future__ import annotations

import numpy as np
import pytest

from spml_cache import observation
from spml_cache.observation import parse_rule, parse_rules
from spml_cache.runtime.errors import SpmlError


def random_labels(rows, classes, seed):
    labels = (np.random.default_rng(seed).random((rows, classes)) < 0.25).astype(np.uint8)
    labels[:, -1] = 0
    labels[:2, -1] = 1  # a class with fewer positives than the budget
    return labels


@pytest.mark.parametrize("n", [1, 2, 5])
def test_each_class_gets_n_positives_and_n_negatives_per_split(n):
    train, val = random_labels(120, 6, seed=0), random_labels(40, 6, seed=1)
    rule = parse_rule(f"per-class:{n}")
    observed = observation.draw_splits(rule, train, val, attrs={})
    for labels, mask in zip((train, val), observed):
        assert (labels[mask == 1] == 1).all() and (labels[mask == -1] == 0).all()
        for column in range(labels.shape[1]):
            positives, negatives = int(labels[:, column].sum()), int((1 - labels[:, column]).sum())
            assert (mask[:, column] == 1).sum() == min(n, positives)
            assert (mask[:, column] == -1).sum() == min(n, negatives)
    assert np.array_equal(observed[0], rule.draw(train)) and np.array_equal(observed[1], rule.draw(val, seed=1201))


def test_the_draw_is_seeded():
    labels = random_labels(100, 4, seed=2)
    assert np.array_equal(parse_rule("per-class:3").draw(labels), parse_rule("per-class:3").draw(labels))
    assert not np.array_equal(parse_rule("per-class:3").draw(labels), parse_rule("per-class:3,seed=9").draw(labels))


@pytest.mark.parametrize("text", ["per-class:-1", "per-class:2.5", "per-class"])
def test_n_below_zero_or_not_whole_is_refused(text):
    with pytest.raises(SpmlError, match=r"^--observe per-class"):
        parse_rules(text)
