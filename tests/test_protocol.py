"""The SPML protocol (docs/protocol.md) against independent re-statements of the reference, and the metric
against scikit-learn."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score

from spml_cache import protocol
from spml_cache.runtime.errors import SpmlError


# --- re-statements of the reference (Cole et al.), written out as the spec gives them ---


def reference_split(num_rows, val_frac=0.2, seed=1200):
    rng = np.random.RandomState(seed)
    n_val = int(np.round(val_frac * num_rows))
    n_train = num_rows - n_val
    perm = rng.permutation(num_rows)
    return np.sort(perm[:n_train]), np.sort(perm[-n_val:])


def reference_observe(labels, num_pos, num_neg, seed=1200):
    """The reference's generate_observed_labels: -1/+1 labels, one RandomState, a plain loop over rows."""
    label_matrix = labels.astype(np.float64)
    label_matrix[label_matrix == 0] = -1
    rng = np.random.RandomState(seed)
    observed = np.zeros_like(label_matrix)
    for i in range(label_matrix.shape[0]):
        idx_pos = np.where(label_matrix[i, :] == 1.0)[0]
        rng.shuffle(idx_pos)
        observed[i, idx_pos[:num_pos]] = 1.0
        idx_neg = np.where(label_matrix[i, :] == -1.0)[0]
        rng.shuffle(idx_neg)
        observed[i, idx_neg[:num_neg]] = -1.0
    return observed


def sklearn_ap(scores, labels):
    """Per-class AP, classes without positives 0 (the reference's rule), for one [N, C] score matrix."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels)
    out = np.zeros(labels.shape[1])
    for c in range(labels.shape[1]):
        if labels[:, c].any():
            out[c] = average_precision_score(labels[:, c], scores[:, c])
    return out


def random_labels(num_rows, num_classes, seed, p=0.3):
    """0/1 labels with some all-zero rows (no positive) and some all-one rows (no negative)."""
    rng = np.random.default_rng(seed)
    labels = (rng.random((num_rows, num_classes)) < p).astype(np.uint8)
    labels[::7] = 0
    labels[3::11] = 1
    return labels


# --- the split ---


@pytest.mark.parametrize(
    "num_rows, sizes", [(5717, (4574, 1143)), (82081, (65665, 16416)), (5994, (4795, 1199))]
)
def test_split_sizes_disjoint_sorted_covering(num_rows, sizes):
    train, val = protocol.split_train_val(num_rows)
    assert (len(train), len(val)) == sizes
    assert train.dtype == np.int64 and val.dtype == np.int64
    assert np.all(np.diff(train) > 0) and np.all(np.diff(val) > 0)  # sorted, no repeats
    assert np.intersect1d(train, val).size == 0
    assert np.array_equal(np.sort(np.concatenate([train, val])), np.arange(num_rows))


@pytest.mark.parametrize("num_rows, val_frac, seed", [(5717, 0.2, 1200), (82081, 0.2, 1200), (997, 0.35, 7)])
def test_split_is_the_reference_split(num_rows, val_frac, seed):
    train, val = protocol.split_train_val(num_rows, val_frac=val_frac, seed=seed)
    ref_train, ref_val = reference_split(num_rows, val_frac, seed)
    assert np.array_equal(train, ref_train)
    assert np.array_equal(val, ref_val)


def test_split_without_val_rows_keeps_every_row_in_train():
    # round(0.2 * 2) = 0: the reference's perm[-0:] would put every row in val as well
    train, val = protocol.split_train_val(2)
    assert np.array_equal(train, [0, 1]) and val.size == 0
    train, val = protocol.split_train_val(10, val_frac=0.0)
    assert np.array_equal(train, np.arange(10)) and val.size == 0


def test_split_rejects_bad_fraction():
    with pytest.raises(SpmlError, match="val_frac"):
        protocol.split_train_val(10, val_frac=1.0)


# --- the single positive ---


@pytest.mark.parametrize("num_pos, num_neg, seed", [(1, 0, 1200), (2, 3, 1200), (1, 0, 5)])
def test_observed_labels_are_the_reference_draws(num_pos, num_neg, seed):
    labels = random_labels(400, 17, seed=0)
    observed = protocol.observe_labels(labels, num_pos=num_pos, num_neg=num_neg, seed=seed)
    assert observed.dtype == np.int8 and observed.shape == labels.shape
    assert np.array_equal(observed, reference_observe(labels, num_pos, num_neg, seed))


def test_negatives_are_shuffled_even_when_none_is_kept():
    # If the negatives were not shuffled, the second row's draw would come from a different point of the stream.
    labels = np.array([[1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]] * 20, dtype=np.uint8)
    skip_negatives = np.random.RandomState(1200)
    draws = []
    for row in labels:
        idx = np.where(row == 1)[0]
        skip_negatives.shuffle(idx)
        draws.append(idx[0])
    observed = protocol.observe_labels(labels)
    assert not np.array_equal(observed.argmax(axis=1), draws)
    assert np.array_equal(observed, reference_observe(labels, 1, 0))


@pytest.mark.parametrize("num_pos, num_neg", [(1, 0), (2, 3), (0, 5)])
def test_observed_labels_are_true_labels(num_pos, num_neg):
    labels = random_labels(300, 9, seed=1)
    observed = protocol.observe_labels(labels, num_pos=num_pos, num_neg=num_neg)
    assert set(np.unique(observed)) <= {-1, 0, 1}
    assert np.all(labels[observed == 1] == 1)
    assert np.all(labels[observed == -1] == 0)
    positives, negatives = labels.sum(1), (1 - labels).sum(1)
    assert np.array_equal((observed == 1).sum(1), np.minimum(positives, num_pos))
    assert np.array_equal((observed == -1).sum(1), np.minimum(negatives, num_neg))
    assert not (observed[positives == 0] == 1).any()


def test_observe_rejects_non_binary_labels_and_negative_counts():
    with pytest.raises(SpmlError, match="0 and 1"):
        protocol.observe_labels(np.array([[0, 2]]))
    with pytest.raises(SpmlError, match="num_pos"):
        protocol.observe_labels(np.array([[0, 1]]), num_pos=-2)  # -1 is "all" (tests/test_observation_uniform.py)


def test_expected_positives():
    labels = np.array([[1, 0, 1], [0, 0, 0], [1, 1, 1]], dtype=np.uint8)
    assert protocol.expected_positives(labels) == pytest.approx(5 / 3)
    assert protocol.expected_positives(np.zeros((0, 4))) == 0.0
    assert (protocol.SPLIT_SEED, protocol.OBSERVE_SEED, protocol.VAL_FRAC) == (1200, 1200, 0.2)


def test_apply_protocol_splits_rows_and_keeps_their_observed_labels():
    try:
        from spml_cache.datasets import ImageSplit, LabeledImages
    except ImportError as error:
        pytest.skip(f"spml_cache.datasets is not importable yet: {error}")
    train_labels = random_labels(53, 6, seed=2)
    test_labels = random_labels(11, 6, seed=3)
    train_ids = [f"train/{i:03d}.jpg" for i in range(53)]
    test_ids = [f"test/{i:03d}.jpg" for i in range(11)]
    images = LabeledImages(
        dataset="csv",
        root=Path("/nowhere"),
        classes=[f"c{i}" for i in range(6)],
        train=ImageSplit(train_ids, train_labels),
        test=ImageSplit(test_ids, test_labels),
        skipped=[],
        notes=[],
    )
    result = protocol.apply_protocol(images, num_pos=2, num_neg=1, split_seed=3, observe_seed=4)

    observed = reference_observe(train_labels, 2, 1, seed=4)  # drawn over all official training rows
    train_rows, val_rows = reference_split(53, 0.2, 3)
    for split, rows in ((result.train, train_rows), (result.val, val_rows)):
        assert split.ids == [train_ids[i] for i in rows]
        assert split.labels.dtype == np.uint8 and np.array_equal(split.labels, train_labels[rows])
        assert split.observed.dtype == np.int8 and np.array_equal(split.observed, observed[rows])
    assert result.test.ids == test_ids and np.array_equal(result.test.labels, test_labels)
    assert result.test.observed is None
    assert result.attrs == {
        "split_seed": 3,
        "val_frac": 0.2,
        "observe_seed": 4,
        "num_pos": 2,
        "num_neg": 1,
        "expected_positives": pytest.approx(train_labels.sum() / 53),
    }


# --- the metric ---


def test_ap_of_a_hand_worked_ranking_with_a_tie():
    # thresholds 0.9 (P 1, R 1/2) and 0.8 (the tie enters at once: P 2/3, R 1): AP = 1/2 + 1/2 * 2/3
    scores = torch.tensor([[0.9], [0.8], [0.8], [0.1]], requires_grad=True)  # logits straight from a model
    labels = torch.tensor([[1], [0], [1], [0]])
    assert protocol.average_precision(scores, labels).item() == pytest.approx(5 / 6, abs=1e-12)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("decimals", [None, 1])  # 1 decimal: heavy ties
def test_ap_matches_sklearn_for_every_head(dtype, decimals):
    rng = np.random.default_rng(4)
    labels = (rng.random((300, 7)) < 0.2).astype(np.uint8)
    labels[:, 3] = 0  # a class without positives
    scores = rng.normal(size=(3, 300, 7))  # logits: negative scores too
    if decimals is not None:
        scores = np.round(scores, decimals)
        scores[scores == 0] = -0.0  # sklearn ties -0.0 with 0.0
    scores = scores.astype(dtype)
    ap = protocol.average_precision(torch.from_numpy(scores), torch.from_numpy(labels))
    assert ap.shape == (3, 7)
    for head in range(3):
        np.testing.assert_allclose(ap[head].numpy(), sklearn_ap(scores[head], labels), rtol=0, atol=1e-12)
    assert torch.all(ap[:, 3] == 0)


def test_map_matches_sklearn_for_numpy_and_torch_inputs():
    rng = np.random.default_rng(5)
    labels = (rng.random((250, 6)) < 0.3).astype(np.uint8)
    labels[:, 0] = 0
    scores = np.round(rng.random((250, 6)), 1).astype(np.float32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="No positive class found")
        per_class = [average_precision_score(labels[:, c], scores[:, c]) for c in range(6)]
    assert per_class[0] == 0.0
    expected = 100 * np.mean(per_class)
    assert protocol.mean_average_precision(scores, labels) == pytest.approx(expected, abs=1e-10)
    as_torch = protocol.mean_average_precision(torch.from_numpy(scores), torch.from_numpy(labels))
    assert as_torch == pytest.approx(expected, abs=1e-10)
    assert 0 < expected < 100


def test_map_of_a_perfect_ranking_is_100():
    labels = np.eye(5, dtype=np.uint8)
    assert protocol.mean_average_precision(labels.astype(np.float32), labels) == pytest.approx(100.0)


def test_ap_is_nan_only_in_a_column_with_nan_scores():
    rng = np.random.default_rng(6)
    labels = torch.from_numpy((rng.random((40, 3)) < 0.5).astype(np.uint8))
    scores = torch.rand(2, 40, 3, generator=torch.Generator().manual_seed(0))
    scores[1, 5, 2] = float("nan")
    ap = protocol.average_precision(scores, labels)
    assert torch.isnan(ap[1, 2]) and not torch.isnan(ap[0]).any() and not torch.isnan(ap[1, :2]).any()


def test_ap_rejects_mismatched_shapes():
    with pytest.raises(SpmlError, match="do not match"):
        protocol.average_precision(torch.zeros(2, 10, 3), torch.zeros(10, 4))
    with pytest.raises(SpmlError, match=r"\[N, C\]"):
        protocol.mean_average_precision(torch.zeros(2, 10, 3), torch.zeros(10, 3))


def test_a_heads_ap_does_not_depend_on_the_heads_scored_with_it():
    """Bit for bit: a linear run's results must not depend on its process layout (in-process, worker processes,
    resumed), which scores different sets of heads together."""
    generator = torch.Generator().manual_seed(3)
    scores = torch.rand(7, 300, 11, generator=generator)
    labels = (torch.rand(300, 11, generator=generator) < 0.3).to(torch.uint8)
    together = protocol.average_precision(scores, labels)
    for k in range(7):
        assert torch.equal(protocol.average_precision(scores[k : k + 1], labels)[0], together[k])
    assert torch.equal(torch.cat([protocol.average_precision(scores[:3], labels),
                                  protocol.average_precision(scores[3:], labels)]), together)
