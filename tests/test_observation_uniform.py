"""Observation rules, Cole et al.'s uniform family (`single`, `uniform:pos=K,neg=M`): the rule texts, the draws
against a restatement of the authors' generate_observed_labels, and the order a cache's rows are drawn in."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_support import run_cli

from spml_cache import observation, protocol
from spml_cache.observation import parse_rule, parse_rules
from spml_cache.runtime.errors import SpmlError


def authors_observe(labels, num_pos, num_neg, seed=1200):
    """generate_observed_labels.py restated: -1/+1 labels, one RandomState, per row get_random_label_indices for
    the positives then the negatives, `num_sel == -1` meaning every index."""
    matrix = np.where(labels == 1, 1.0, -1.0)
    rng = np.random.RandomState(seed)

    def pick(row, value, count):
        indices = np.nonzero(row == value)[0]
        rng.shuffle(indices)
        return indices if count == -1 else indices[:count]

    observed = np.zeros_like(matrix)
    for i in range(len(matrix)):
        observed[i, pick(matrix[i], 1.0, num_pos)] = 1.0
        observed[i, pick(matrix[i], -1.0, num_neg)] = -1.0
    return observed


def random_labels(rows, classes, seed):
    labels = (np.random.default_rng(seed).random((rows, classes)) < 0.3).astype(np.uint8)
    labels[::9] = 0  # rows without a positive
    return labels


def test_single_is_observe_labels_bit_for_bit():
    labels = random_labels(300, 11, seed=0)
    assert np.array_equal(parse_rule("single").draw(labels), protocol.observe_labels(labels))
    assert np.array_equal(parse_rule("single").draw(labels), authors_observe(labels, 1, 0))


@pytest.mark.parametrize("text, pos, neg", [("uniform:pos=2,neg=3", 2, 3), ("uniform:pos=all,neg=1", -1, 1),
                                            ("uniform:pos=1,neg=-1", 1, -1), ("uniform:neg=all", 1, -1)])
def test_uniform_is_the_authors_draw_with_minus_one_for_all(text, pos, neg):
    labels = random_labels(200, 9, seed=1)
    drawn = parse_rule(text).draw(labels)
    assert drawn.dtype == np.int8
    assert np.array_equal(drawn, authors_observe(labels, pos, neg))
    assert np.array_equal(drawn, protocol.observe_labels(labels, num_pos=pos, num_neg=neg))
    positives, negatives = labels.sum(1), (1 - labels).sum(1)
    assert np.array_equal((drawn == 1).sum(1), positives if pos == -1 else np.minimum(positives, pos))
    assert np.array_equal((drawn == -1).sum(1), negatives if neg == -1 else np.minimum(negatives, neg))


def test_seed_is_part_of_the_rule():
    labels = random_labels(100, 7, seed=2)
    rule = parse_rule("uniform:pos=1,neg=2,seed=7")
    assert (rule.text, rule.seed) == ("uniform:pos=1,neg=2,seed=7", 7)
    assert np.array_equal(rule.draw(labels), authors_observe(labels, 1, 2, seed=7))
    assert not np.array_equal(rule.draw(labels), parse_rule("uniform:pos=1,neg=2").draw(labels))


def test_rule_texts_are_canonical_and_the_list_splits_on_rules_not_parameters():
    rules = parse_rules("single, uniform:pos=2,neg=-1,entry:0.10,seed=3,entry:0.5,single,uniform")
    assert [rule.text for rule in rules] == ["single", "uniform:pos=2,neg=all", "entry:0.1,seed=3", "entry:0.5",
                                             "uniform:pos=1,neg=0"]
    assert [rule.text for rule in parse_rules(None)] == ["single"]
    assert [parse_rule(rule.text) for rule in rules] == rules  # the text reads back as the same rule


@pytest.mark.parametrize("text, message", [
    ("singel", "unknown rule 'singel' (did you mean single?); use one of single, uniform:pos=K,neg=M, entry:P"),
    ("entri:0.1", "unknown rule 'entri' (did you mean entry?); use one of single"),
    ("zzz", "unknown rule 'zzz'; use one of single"),  # nothing close: no suggestion
    ("uniform:pos=-2", "pos must be a whole number >= 0, or all (-1), got -2"),
    ("uniform:pos=1.5", "pos must be a whole number >= 0, or all (-1), got 1.5"),
    ("uniform:pos=1,nag=2", "'nag=2' is not a parameter of uniform"),
    ("single:2", "'2' is not a parameter of single"),
    (" , ", "--observe is empty"),
])
def test_bad_rule_texts_are_one_line_naming_the_flag(text, message):
    with pytest.raises(SpmlError, match="^--observe ") as error:
        parse_rules(text)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_cli_unknown_rule_and_count_below_zero(tmp_path):
    for flag, message in (("singel", "unknown rule 'singel'"), ("uniform:pos=1,neg=-3", "neg must be a whole")):
        done = run_cli("linear", "--loss", "an", "--cache", "none.h5", "--observe", flag, cwd=tmp_path)
        assert done.returncode == 1
        assert done.stderr.startswith(f"error: --observe {flag}: ") and message in done.stderr
        assert done.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # nothing written


def whole_cache_attrs(limit=0, skipped=None):
    return {"split_seed": 1200, "val_frac": 0.2, "limit": limit, "skipped_images": json.dumps(skipped or {})}


def test_a_whole_cache_draws_over_the_official_rows_as_before_the_split():
    official = random_labels(250, 8, seed=3)
    train_rows, val_rows = protocol.split_train_val(len(official))
    for text in ("single", "uniform:pos=2,neg=1"):
        rule = parse_rule(text)
        before_split = rule.draw(official)  # what apply_protocol does for single
        train, val = observation.draw_splits(rule, official[train_rows], official[val_rows], whole_cache_attrs())
        assert np.array_equal(train, before_split[train_rows]) and np.array_equal(val, before_split[val_rows])


@pytest.mark.parametrize("attrs", [whole_cache_attrs(limit=50), whole_cache_attrs(skipped={"train": ["a.jpg"]}), {}])
def test_a_cut_cache_draws_over_its_own_rows_train_then_val(attrs):
    official = random_labels(250, 8, seed=4)
    train_rows, val_rows = protocol.split_train_val(len(official))
    rule = parse_rule("uniform:pos=1,neg=2")
    train, val = observation.draw_splits(rule, official[train_rows], official[val_rows], attrs)
    concatenated = rule.draw(np.concatenate([official[train_rows], official[val_rows]]))
    assert np.array_equal(np.concatenate([train, val]), concatenated)
