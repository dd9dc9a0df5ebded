"""Observation rules that observe at random fractions: `entry:P` (every entry, positive or negative, with
probability P) and `keep-pos:F` (positives kept with probability F, at least one per image, no negatives)."""

from __future__ import annotations

import numpy as np
import pytest
from cli_support import run_cli

from spml_cache.observation import parse_rule, parse_rules
from spml_cache.runtime.errors import SpmlError


def random_labels(rows, classes, seed, p=0.3):
    labels = (np.random.default_rng(seed).random((rows, classes)) < p).astype(np.uint8)
    labels[::13] = 0  # rows without a positive
    return labels


def within_binomial(count, trials, p, sigmas=6.0):
    """`count` successes of `trials` draws is a plausible Binomial(trials, p) outcome (6 standard deviations)."""
    return abs(count - trials * p) <= sigmas * np.sqrt(trials * p * (1 - p)) + 1e-9


def shows_only_true_labels(observed, labels):
    return (labels[observed == 1] == 1).all() and (labels[observed == -1] == 0).all()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.93])
def test_entry_observes_each_entry_with_probability_p_on_both_sides(p):
    labels = random_labels(400, 20, seed=0)
    observed = parse_rule(f"entry:{p}").draw(labels)
    assert observed.dtype == np.int8 and shows_only_true_labels(observed, labels)
    positives, negatives = int(labels.sum()), int((1 - labels).sum())
    assert within_binomial(int((observed == 1).sum()), positives, p)
    assert within_binomial(int((observed == -1).sum()), negatives, p)
    assert within_binomial(int((observed != 0).sum()), labels.size, p)


def test_entry_one_observes_everything_and_the_seed_decides_the_draw():
    labels = random_labels(50, 6, seed=1)
    assert np.array_equal(parse_rule("entry:1").draw(labels), np.where(labels == 1, 1, -1))
    half = parse_rule("entry:0.5")
    assert np.array_equal(half.draw(labels), half.draw(labels))
    assert not np.array_equal(half.draw(labels), parse_rule("entry:0.5,seed=2").draw(labels))


@pytest.mark.parametrize("f", [0.2, 0.6])
def test_keep_pos_keeps_a_fraction_of_positives_and_at_least_one(f):
    labels = random_labels(500, 12, seed=2, p=0.35)
    observed = parse_rule(f"keep-pos:{f}").draw(labels)
    assert shows_only_true_labels(observed, labels) and not (observed == -1).any()
    has_positive = labels.any(axis=1)
    assert (observed[has_positive] == 1).any(axis=1).all() and not observed[~has_positive].any()
    # Each positive kept with probability f; a row with k positives that kept none gets one back:
    # E[kept] = sum over rows of k f + (1 - f)^k.
    k = labels.sum(axis=1)[has_positive]
    expected = float((k * f + (1 - f) ** k).sum())
    spread = 6 * np.sqrt(float((k * f * (1 - f)).sum()) + float(((1 - f) ** k).sum()))
    assert abs(int((observed == 1).sum()) - expected) <= spread


def test_keep_pos_one_keeps_every_positive():
    labels = random_labels(80, 5, seed=3)
    assert np.array_equal(parse_rule("keep-pos:1").draw(labels), labels.astype(np.int8))


@pytest.mark.parametrize("text", ["entry:0", "entry:1.01", "entry:-0.5", "entry:nan", "keep-pos:0", "keep-pos:2"])
def test_fractions_outside_zero_one_are_refused(text):
    with pytest.raises(SpmlError, match=r"^--observe .*must be in \(0, 1\]"):
        parse_rules(text)


def test_cli_fraction_outside_zero_one_is_one_line(tmp_path):
    done = run_cli("extract", "voc", "--root", str(tmp_path), "--observe", "single,entry:1.5", cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert "error: --observe entry:1.5: p must be in (0, 1] (the fraction P), got 1.5" in done.stderr
    assert list(tmp_path.iterdir()) == []
