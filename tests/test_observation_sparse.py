"""Observation draws on sparse labels (datasets of many classes): every rule's sparse draw is, entry for entry,
the CSR form of its dense draw (the same seed, the same random stream), and never builds a dense [N, C] matrix."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from spml_cache import observation, protocol
from spml_cache.labels import SparseLabels
from spml_cache.observation import draws as observation_draws
from spml_cache.runtime.errors import SpmlError

ROWS, CLASSES = 60, 1200
RULES = ["single", "uniform:pos=2,neg=3", "uniform:pos=all,neg=all", "entry:0.05", "keep-pos:0.3", "per-class:2",
         "per-class:1", "uniform:pos=1,neg=5,seed=7"]


def full_labels(seed=0, rows=ROWS, classes=CLASSES):
    rng = np.random.default_rng(seed)
    labels = (rng.random((rows, classes)) < 0.004).astype(np.uint8)
    labels[:4] = 0  # rows without a positive
    labels[5, :12] = 1
    labels[:, 7] = 1  # a class positive everywhere: no negative row to draw
    return labels


def random_mask(seed=1, rows=ROWS, classes=CLASSES):
    return (np.random.default_rng(seed).random((rows, classes)) < 0.7).astype(np.uint8)


def csr(matrix):
    return SparseLabels.from_dense(matrix)


@pytest.fixture
def no_dense(monkeypatch):
    """Every way a SparseLabels has of making a dense block raises."""
    def refuse(*args, **kwargs):
        raise AssertionError("a dense matrix was built from sparse labels")

    for name in ("to_dense", "rows", "row_range", "columns"):
        monkeypatch.setattr(SparseLabels, name, refuse)


@pytest.mark.parametrize("num_pos,num_neg", [(1, 0), (2, 3), (-1, 0), (0, 4), (1, -1), (-1, -1)])
def test_observe_labels_sparse_is_the_dense_draw_made_sparse(num_pos, num_neg):
    labels = full_labels()
    dense = protocol.observe_labels(labels, num_pos=num_pos, num_neg=num_neg, seed=5)
    drawn = protocol.observe_labels(csr(labels), num_pos=num_pos, num_neg=num_neg, seed=5)
    assert isinstance(drawn, SparseLabels) and drawn == csr(dense)


def test_observe_labels_sparse_checks_values_and_sorts_classes():
    labels = full_labels()
    matrix = csr(labels)
    # the same matrix with each row's classes reversed and one stored zero: the same draw
    rows = matrix.row_of_entries()
    order = np.lexsort((-matrix.indices.astype(np.int64), rows))
    shuffled = SparseLabels(matrix.indptr, matrix.indices[order], matrix.values[order], CLASSES)
    assert protocol.observe_labels(shuffled, num_neg=2) == csr(protocol.observe_labels(labels, num_neg=2))
    bad = SparseLabels(matrix.indptr, matrix.indices, np.where(np.arange(matrix.nnz) == 3, -1, 1).astype(np.int8),
                       CLASSES)
    with pytest.raises(SpmlError, match="only 0 and 1"):
        protocol.observe_labels(bad)


@pytest.mark.parametrize("text", RULES)
@pytest.mark.parametrize("official", [True, False])
def test_each_rule_drawn_on_sparse_splits_equals_the_dense_draw(text, official):
    rule = observation.parse_rule(text)
    train, val = full_labels(0, 48), full_labels(1, 12)
    masks = random_mask(2, 48), random_mask(3, 12)
    attrs = {"split_seed": 1200, "val_frac": 0.2} if official else {}
    dense = observation.draw_splits(rule, train, val, attrs, label_masks=masks)
    drawn = observation.draw_splits(rule, csr(train), csr(val), attrs, label_masks=tuple(map(csr, masks)))
    assert all(isinstance(part, SparseLabels) for part in drawn)
    assert drawn[0] == csr(dense[0]) and drawn[1] == csr(dense[1])
    unmasked = observation.draw_splits(rule, csr(train), csr(val), attrs)
    assert unmasked[0] == csr(observation.draw_splits(rule, train, val, attrs)[0])


def test_given_on_sparse_labels_and_masks_is_the_dense_draw():
    rule = observation.parse_rule("given")
    train, val, masks = full_labels(0, 48), full_labels(1, 12), (random_mask(2, 48), random_mask(3, 12))
    dense = observation.draw_splits(rule, train, val, {}, label_masks=masks)
    drawn = observation.draw_splits(rule, csr(train), csr(val), {}, label_masks=tuple(map(csr, masks)))
    assert drawn[0] == csr(dense[0]) and drawn[1] == csr(dense[1])


@pytest.mark.parametrize("text", ["largest", "size", "given"])
def test_rules_without_a_sparse_draw_are_refused_in_one_line(text):
    with pytest.raises(SpmlError, match="--observe single") as error:
        observation.draw_splits(observation.parse_rule(text), csr(full_labels(0, 8)), csr(full_labels(1, 6)), {})
    assert "\n" not in str(error.value)


def test_the_rules_a_refusal_points_to_come_from_the_registry(monkeypatch):
    """A rule registered with a sparse draw and a positive for every image is listed by the refusals that point
    to such rules, with no list to update by hand (issue 52, item 5)."""
    before = "single, uniform:pos=K, keep-pos:F"
    assert observation.keeping_a_positive() == before
    assert observation.RULES.find("largest").refusal_on_sparse().endswith(
        "use --observe single, uniform, entry, keep-pos or per-class (or given with a label mask)")

    class Toy(observation.ObservationRule):
        name, source, summary, keeps_a_positive = "toy", "a test", "one positive, drawn", "toy:K"

        @staticmethod
        def draw_dense(labels, areas, seed):
            return observation_draws.Single.draw_dense(labels, areas, seed)

        @staticmethod
        def draw_sparse(labels, seed):
            return observation_draws.Single.draw_sparse(labels, seed)

    registry = observation.RULES
    monkeypatch.setattr(registry, "_order", [*registry._order])
    monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    observation.register(Toy)
    assert observation.keeping_a_positive() == f"{before}, toy:K"
    assert "keep-pos, per-class or toy (or given" in observation.RULES.find("size").refusal_on_sparse()


def test_row_blocks_draw_the_same_stream(monkeypatch):
    labels = full_labels()
    whole = [observation.parse_rule(text).draw(csr(labels)) for text in ("entry:0.1", "keep-pos:0.2")]
    monkeypatch.setattr(observation_draws, "BLOCK_ENTRIES", 7 * CLASSES + 5)  # blocks of 7 rows
    assert [observation.parse_rule(text).draw(csr(labels)) for text in ("entry:0.1", "keep-pos:0.2")] == whole


def test_hide_unannotated_and_expected_positives_on_sparse():
    labels, mask = full_labels(), random_mask()
    observed = protocol.observe_labels(labels, num_neg=20)
    hidden = protocol.hide_unannotated(observed, mask)
    assert protocol.hide_unannotated(csr(observed), csr(mask)) == csr(hidden)
    assert protocol.hide_unannotated(csr(observed), mask) == csr(hidden)
    assert protocol.expected_positives(csr(labels)) == protocol.expected_positives(labels)
    assert protocol.expected_positives(csr(labels[:0])) == 0.0


def images(labels, mask, test_labels, test_mask):
    split = SimpleNamespace
    return SimpleNamespace(dataset="tiny", train=split(ids=[f"i{i}" for i in range(len(labels))], labels=labels,
                                                       mask=mask),
                           test=split(ids=[f"t{i}" for i in range(len(test_labels))], labels=test_labels,
                                      mask=test_mask))


@pytest.mark.parametrize("num_pos,num_neg", [(1, 0), (2, -1)])
def test_apply_protocol_sparse_gives_the_dense_splits(num_pos, num_neg):
    labels, mask, test, test_mask = full_labels(0), random_mask(1), full_labels(2, 10), random_mask(3, 10)
    dense = protocol.apply_protocol(images(labels, mask, test, test_mask), num_pos=num_pos, num_neg=num_neg)
    drawn = protocol.apply_protocol(images(csr(labels), csr(mask), csr(test), csr(test_mask)), num_pos=num_pos,
                                    num_neg=num_neg)
    assert drawn.attrs == dense.attrs
    for name in ("train", "val"):
        want, got = getattr(dense, name), getattr(drawn, name)
        assert got.ids == want.ids
        assert got.labels == csr(want.labels) and got.observed == csr(want.observed) and got.mask == csr(want.mask)
    assert drawn.test.ids == dense.test.ids and drawn.test.labels == csr(dense.test.labels)
    assert drawn.test.observed is None and drawn.test.mask == csr(dense.test.mask)


def test_the_sparse_path_never_builds_a_dense_matrix(no_dense):
    labels, mask = csr(full_labels()), csr(random_mask())
    protocol.observe_labels(labels, num_pos=2, num_neg=-1)
    protocol.apply_protocol(images(labels, mask, csr(full_labels(2, 10)), None), num_neg=3)
    for text in RULES:
        observation.draw_splits(observation.parse_rule(text), labels.take(np.arange(48)),
                                labels.take(np.arange(48, ROWS)), {}, label_masks=(mask.take(np.arange(48)),
                                                                                   mask.take(np.arange(48, ROWS))))
