"""The multi-label F1 family (docs/protocol.md, "Decisions at a threshold"): CP, CR, CF1, OP, OR, OF1 and the
per-class F1, restated with scikit-learn's `precision_recall_fscore_support` on random and edge inputs; CF1 is the
harmonic mean of CP and CR (ML-GCN, ASL), not sklearn's macro F1 (the mean of per-class F1s)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import f1_score, precision_recall_fscore_support

from spml_cache import labels as label_matrix
from spml_cache import metrics
from spml_cache.labels import SparseLabels


def family_of(scores, labels, mask=None, top_k=None):
    counts = metrics.decision_counts(metrics.predicted(torch.as_tensor(scores), top_k), labels, mask)
    values, per_class = metrics.f1_family(counts, mask is not None)
    return {name: float(value) for name, value in values.items()}, per_class.numpy()


def sklearn_family(labels, predicted):
    """The literature's definitions written with sklearn: class averages of sklearn's per-class precision and recall
    (zero_division=0), CF1 their harmonic mean; OP, OR, OF1 sklearn's micro averages."""
    precision, recall, f1, _ = precision_recall_fscore_support(labels, predicted, average=None, zero_division=0)
    cp, cr = precision.mean(), recall.mean()
    op, o_r, of1, _ = precision_recall_fscore_support(labels, predicted, average="micro", zero_division=0)
    cf1 = 2 * cp * cr / (cp + cr) if cp + cr > 0 else 0.0
    return {"cp": 100 * cp, "cr": 100 * cr, "cf1": 100 * cf1, "op": 100 * op, "or": 100 * o_r, "of1": 100 * of1}, f1


def top_k_by_hand(scores, k):
    """Per image, of the k classes of highest score (among tied scores the lower class index first) those scoring
    at least 0.5: ML-GCN's `overall_topk`."""
    chosen = np.zeros(scores.shape, dtype=bool)
    for row, values in enumerate(scores):
        ranked = sorted(range(len(values)), key=lambda c: (-values[c], c))
        chosen[row, [c for c in ranked[:k] if values[c] >= 0.5]] = True
    return chosen


def random_case(seed, rows=60, classes=7):
    rng = np.random.default_rng(seed)
    labels = (rng.random((rows, classes)) < 0.3).astype(np.uint8)
    scores = np.clip(0.35 * labels + 0.65 * rng.random((rows, classes)), 0, 1).astype(np.float32)
    return scores, labels


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_family_at_the_threshold_is_sklearns_restated(seed):
    scores, labels = random_case(seed)
    values, per_class = family_of(scores, labels)
    expected, f1 = sklearn_family(labels, scores >= 0.5)
    assert values == pytest.approx(expected, abs=1e-9)
    np.testing.assert_allclose(per_class, f1, atol=1e-12)  # per-class F1: sklearn's, with zero_division=0


def test_cf1_is_the_harmonic_mean_of_cp_and_cr_not_sklearns_macro_f1():
    scores, labels = random_case(3)
    values, per_class = family_of(scores, labels)
    predicted = scores >= 0.5
    macro = 100 * f1_score(labels, predicted, average="macro", zero_division=0)  # the mean of per-class F1s
    assert 100 * per_class.mean() == pytest.approx(macro, abs=1e-9)
    assert values["cf1"] == pytest.approx(2 * values["cp"] * values["cr"] / (values["cp"] + values["cr"]), abs=1e-9)
    assert abs(values["cf1"] - macro) > 0.5  # the two relations differ on this input: CF1 is not macro F1


def test_edge_inputs_a_class_never_positive_never_predicted_all_negative_rows():
    scores = np.array([[0.9, 0.1, 0.2, 0.6],
                       [0.8, 0.2, 0.1, 0.7],
                       [0.55, 0.4, 0.2, 0.1],  # an image without a positive, one false positive
                       [0.2, 0.1, 0.3, 0.9]], dtype=np.float32)
    labels = np.array([[1, 0, 0, 1],
                       [0, 0, 0, 1],
                       [0, 0, 0, 0],
                       [1, 1, 0, 0]], dtype=np.uint8)  # class 2: no positive and never predicted
    values, per_class = family_of(scores, labels)
    expected, f1 = sklearn_family(labels, scores >= 0.5)
    assert values == pytest.approx(expected, abs=1e-9)
    np.testing.assert_allclose(per_class, f1, atol=1e-12)
    # by hand: class 1 has a positive but no prediction (precision 0 by convention, recall 0), class 2 neither
    # (precision, recall and F1 0: sklearn's zero_division=0 and ML-GCN's Np[Np == 0] = 1)
    assert values["cp"] == pytest.approx(100 * (1 / 3 + 0 + 0 + 2 / 3) / 4)
    assert values["cr"] == pytest.approx(100 * (1 / 2 + 0 + 0 + 2 / 2) / 4)
    assert (values["op"], values["or"]) == (pytest.approx(100 * 3 / 6), pytest.approx(100 * 3 / 5))
    nothing, _ = family_of(np.zeros((3, 2), np.float32), np.zeros((3, 2), np.uint8))
    assert nothing == {name: 0.0 for name in metrics.F1_FAMILY}  # no prediction, no positive: 0, never NaN


def test_a_score_of_exactly_one_half_is_predicted():
    below = np.nextafter(np.float32(0.5), np.float32(0))
    scores = np.array([[0.5, below], [0.5, 0.5], [below, below]], dtype=np.float32)
    predicted = metrics.predicted(torch.from_numpy(scores)).numpy()
    assert predicted.tolist() == [[True, False], [True, True], [False, False]]  # ML-GCN: logit >= 0


@pytest.mark.parametrize("k", [1, 3, 5, 9])
def test_top_k_takes_at_most_k_labels_per_image_ties_to_the_lower_class(k):
    rng = np.random.default_rng(4)
    scores = rng.integers(0, 5, size=(40, 6)).astype(np.float32) / 4  # many ties, at the k-th place and at 0.5
    labels = (rng.random((40, 6)) < 0.4).astype(np.uint8)
    chosen = metrics.predicted(torch.from_numpy(scores), k).numpy()
    np.testing.assert_array_equal(chosen, top_k_by_hand(scores, k))
    assert (chosen.sum(axis=1) <= k).all() and (chosen <= (scores >= 0.5)).all()
    if k >= 6:  # every class is among the top k: the threshold alone decides
        np.testing.assert_array_equal(chosen, scores >= 0.5)
    values, per_class = family_of(scores, labels, top_k=k)
    expected, f1 = sklearn_family(labels, chosen)
    assert values == pytest.approx(expected, abs=1e-9)
    np.testing.assert_allclose(per_class, f1, atol=1e-12)
    tied = metrics.predicted(torch.tensor([[0.9, 0.5, 0.5, 0.5, 0.1], [0.2, 0.9, 0.4, 0.6, 0.3]]), 3).numpy()
    assert tied.tolist() == [[True, True, True, False, False],  # the third of three tied at 0.5 left out
                             [False, True, False, True, False]]  # 0.4 is among the top 3 but below 0.5


def test_partial_labels_leave_unannotated_entries_out():
    scores, labels = random_case(5, rows=80, classes=6)
    rng = np.random.default_rng(6)
    mask = (rng.random(labels.shape) < 0.6).astype(np.uint8)
    mask[:, 5] = mask[:, 5] * (labels[:, 5] == 0)  # class 5: no annotated positive, left out of CP and CR
    values, per_class = family_of(scores, labels, mask)
    predicted = scores >= 0.5
    precision, recall, f1 = [], [], []
    for c in range(6):  # sklearn on each class's annotated rows alone
        rows = mask[:, c] != 0
        p, r, f, _ = precision_recall_fscore_support(labels[rows, c], predicted[rows, c], average="binary",
                                                     zero_division=0)
        precision.append(p), recall.append(r), f1.append(f)
    scored = [c for c in range(6) if (labels[:, c] * mask[:, c]).any()]
    assert scored == [0, 1, 2, 3, 4]
    cp, cr = np.mean([precision[c] for c in scored]), np.mean([recall[c] for c in scored])
    entries = mask != 0  # OP, OR: every annotated entry
    op, o_r, of1, _ = precision_recall_fscore_support(labels[entries], predicted[entries], average="binary",
                                                      zero_division=0)
    assert values == pytest.approx({"cp": 100 * cp, "cr": 100 * cr, "cf1": 100 * 2 * cp * cr / (cp + cr),
                                    "op": 100 * op, "or": 100 * o_r, "of1": 100 * of1}, abs=1e-9)
    np.testing.assert_allclose(per_class, f1, atol=1e-12)


def test_sparse_labels_count_alike_a_block_of_classes_at_a_time(monkeypatch):
    scores, labels = random_case(7, rows=50, classes=9)
    mask = (np.random.default_rng(8).random(labels.shape) < 0.7).astype(np.uint8)
    chosen = metrics.predicted(torch.from_numpy(np.stack([scores, scores[::-1].copy()])), 2)  # two heads
    dense = label_matrix.decision_counts(chosen, labels, mask)
    np.testing.assert_array_equal(dense.numpy(), metrics.decision_counts(chosen, labels, mask).numpy())
    monkeypatch.setattr(label_matrix, "SCORED_BLOCK_ENTRIES", 50 * 4)  # blocks of 4 classes
    sparse = label_matrix.decision_counts(chosen, SparseLabels.from_dense(labels), SparseLabels.from_dense(mask))
    np.testing.assert_array_equal(sparse.numpy(), dense.numpy())


def test_weighted_counts_are_the_counts_of_the_resampled_images():
    scores, labels = random_case(9, rows=30, classes=4)
    rng = np.random.default_rng(10)
    drawn = rng.integers(0, 30, size=(5, 30))
    weights = torch.from_numpy(np.stack([np.bincount(row, minlength=30) for row in drawn]).astype(np.float32))
    chosen = metrics.predicted(torch.from_numpy(scores))
    weighted = metrics.decision_counts(chosen, labels, weights=weights)
    for b, rows in enumerate(drawn):
        np.testing.assert_array_equal(weighted[b].numpy(), metrics.decision_counts(chosen[rows], labels[rows]).numpy())
