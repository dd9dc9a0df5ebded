"""Bootstrap intervals over the test images (report/bootstrap.py; docs/protocol.md, "Intervals over the test
images"): a resample's AP and F1 family equal scikit-learn's on the resampled images written out, several seeds
resample as the mean over seeds, identical losses differ by exactly 0, and the 95% interval of an mAP difference
covers the truth of a large population in 92-98% of 400 small test sets drawn from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, precision_recall_fscore_support

from spml_cache import metrics
from spml_cache.labels import SparseLabels
from spml_cache.report import bootstrap
from spml_cache.runs import StoredTest


def resampled_rows(resamples: bootstrap.Resamples, b: int) -> np.ndarray:
    """Resample b written out: each image as many times as it was drawn."""
    return np.repeat(np.arange(len(resamples.counts)), resamples.counts[:, b])


def sklearn_ap(labels, scores):
    return average_precision_score(labels, scores) if labels.any() else 0.0


@pytest.mark.parametrize("decimals", [None, 1])  # 1: many tied scores, across positives and negatives
@pytest.mark.parametrize("masked", [False, True])
def test_a_resample_s_ap_is_sklearns_on_the_resampled_images(decimals, masked, monkeypatch):
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(120, 6))
    scores = scores.round(decimals) if decimals else scores
    positive = rng.random((120, 6)) < 0.25
    positive[:, 3] = False  # a class without positives
    positive[:, 4] = False
    positive[:3, 4] = True  # a rare one: some resamples draw none of its positives
    annotated = rng.random((120, 6)) < 0.7 if masked else None
    resamples = bootstrap.Resamples.draw(120, 40, seed=5)
    monkeypatch.setattr(bootstrap, "GROUP_ENTRIES", 40 * 30)  # blocks of a class or two: the blocks' seams too
    ap, has_positive = bootstrap.resampled_ap(scores, positive, annotated, resamples.dense)
    assert ap.shape == has_positive.shape == (40, 6)
    for b in range(40):
        rows = resampled_rows(resamples, b)
        for c in range(6):
            kept = rows if annotated is None else rows[annotated[rows, c]]
            assert ap[b, c] == pytest.approx(sklearn_ap(positive[kept, c], scores[kept, c]), abs=1e-12), (b, c)
            assert has_positive[b, c] == positive[kept, c].any()
    assert not has_positive[:, 4].all() and has_positive[:, 4].any()


def test_a_test_set_of_2_to_the_16_images_or_more_sums_its_counts_in_int32():
    rows = (1 << 16) + 5  # uint16 would overflow: a sum of counts can reach N
    rng = np.random.default_rng(6)
    scores, positive = rng.random((rows, 2)), rng.random((rows, 2)) < 0.01
    resamples = bootstrap.Resamples.draw(rows, 2)
    assert resamples.dense.dtype == np.int32 and bootstrap.Resamples.draw(rows - 10, 2).dense.dtype == np.uint16
    ap, _ = bootstrap.resampled_ap(scores, positive, None, resamples.dense)
    for b in range(2):
        kept = resampled_rows(resamples, b)
        for c in range(2):
            assert ap[b, c] == pytest.approx(sklearn_ap(positive[kept, c], scores[kept, c]), abs=1e-12)


def test_a_nan_score_keeps_its_class_nan():
    scores = np.random.default_rng(1).random((20, 3))
    scores[4, 1] = np.nan
    ap, _ = bootstrap.resampled_ap(scores, scores > 0.5, None, bootstrap.Resamples.draw(20, 8).dense)
    assert np.isnan(ap[:, 1]).all() and not np.isnan(ap[:, [0, 2]]).any()


def test_resamples_are_seeded_draws_with_replacement(monkeypatch):
    resamples = bootstrap.Resamples.draw(37, 50, seed=3)
    assert resamples.counts.shape == (37, 50) and (resamples.counts.sum(axis=0) == 37).all()
    drawn = np.random.default_rng(3).integers(0, 37, size=(50, 37))  # resample b: rng.integers(0, N, N), in order
    expected = np.stack([np.bincount(row, minlength=37) for row in drawn], axis=1)
    np.testing.assert_array_equal(resamples.counts, expected)
    monkeypatch.setattr(bootstrap, "DRAW_ROWS", 37 * 7)  # drawn in blocks of 7 resamples: the same stream
    np.testing.assert_array_equal(bootstrap.Resamples.draw(37, 50, seed=3).counts, expected)
    assert not np.array_equal(bootstrap.Resamples.draw(37, 50, seed=4).counts, expected)


def stored(scores, labels, mask=None, seeds=None):
    scores = np.asarray(scores, dtype=np.float32)
    scores = scores[None] if scores.ndim == 2 else scores
    return StoredTest(list(seeds or range(len(scores))), scores, labels, mask)


def test_several_seeds_resample_as_the_mean_over_seeds_of_each_seed_s_value():
    rng = np.random.default_rng(2)
    labels = (rng.random((50, 4)) < 0.3).astype(np.uint8)
    seeds = rng.random((3, 50, 4)).astype(np.float32) * 0.6 + 0.4 * labels
    resamples = bootstrap.Resamples.draw(50, 30)
    values = bootstrap.resampled(stored(seeds, labels), "map", resamples)
    for b in (0, 7, 29):
        rows = resampled_rows(resamples, b)
        per_seed = [100 * np.mean([sklearn_ap(labels[rows, c], s[rows, c]) for c in range(4)]) for s in seeds]
        assert values[b] == pytest.approx(np.mean(per_seed), abs=1e-9)


def test_a_partially_labelled_split_resamples_its_masked_map_and_sparse_labels_alike():
    rng = np.random.default_rng(3)
    labels = (rng.random((60, 5)) < 0.3).astype(np.uint8)
    mask = (rng.random((60, 5)) < 0.6).astype(np.uint8)
    scores = (rng.random((60, 5)) * 0.7 + 0.3 * labels).astype(np.float32)
    resamples = bootstrap.Resamples.draw(60, 25)
    values = bootstrap.resampled(stored(scores, labels, mask), "map", resamples)
    for b in range(25):
        rows = resampled_rows(resamples, b)
        observed = torch.from_numpy(scores[rows])
        assert values[b] == pytest.approx(metrics.mean_average_precision(observed, labels[rows], mask[rows]), abs=1e-9)
    sparse = stored(scores, SparseLabels.from_dense(labels), SparseLabels.from_dense(mask))
    np.testing.assert_array_equal(bootstrap.resampled(sparse, "map", resamples), values)


@pytest.mark.parametrize("metric", ["cf1", "op", "cr@2"])
def test_a_resample_s_f1_family_is_sklearns_on_the_resampled_images(metric):
    rng = np.random.default_rng(4)
    labels = (rng.random((40, 5)) < 0.3).astype(np.uint8)
    scores = (rng.random((40, 5)) * 0.7 + 0.3 * labels).astype(np.float32)
    resamples = bootstrap.Resamples.draw(40, 20)
    values = bootstrap.resampled(stored(scores, labels), metric, resamples)
    name, _, k = metric.partition("@")
    chosen = metrics.predicted(torch.from_numpy(scores), int(k) if k else None).numpy()
    for b in range(20):
        rows = resampled_rows(resamples, b)
        precision, recall, _, _ = precision_recall_fscore_support(labels[rows], chosen[rows], average=None,
                                                                  zero_division=0)
        micro, _, _, _ = precision_recall_fscore_support(labels[rows], chosen[rows], average="micro", zero_division=0)
        cp, cr = precision.mean(), recall.mean()
        expected = {"cf1": 2 * cp * cr / (cp + cr), "op": micro, "cr": cr}[name]
        assert values[b] == pytest.approx(100 * expected, abs=1e-9)


def test_identical_losses_differ_by_exactly_zero_and_pairs_share_their_resamples():
    rng = np.random.default_rng(5)
    labels = (rng.random((80, 4)) < 0.3).astype(np.uint8)
    first = (rng.random((80, 4)) * 0.7 + 0.3 * labels).astype(np.float32)
    resamples = bootstrap.Resamples.draw(80, 200)
    a = bootstrap.resampled(stored(first, labels), "map", resamples)
    same = bootstrap.resampled(stored(first.copy(), labels.copy()), "map", resamples)
    assert (a - same == 0).all()  # exactly: the same images on every resample
    assert bootstrap.interval(a - same) == (0.0, 0.0) and bootstrap.p_value(a - same) == 1.0
    assert np.std(a) > 0.5  # while each loss alone spreads over the resamples


def test_percentile_interval_and_p_value_restated():
    values = np.arange(1, 1001, dtype=float)  # 1..1000
    assert bootstrap.interval(values) == pytest.approx((np.quantile(values, 0.025), np.quantile(values, 0.975)))
    differences = np.array([-1.0] * 30 + [0.0] * 10 + [2.0] * 960)
    # twice the smaller side (d <= 0: 40 of 1000), with the Monte Carlo +1: 2 * 41 / 1001
    assert bootstrap.p_value(differences) == pytest.approx(2 * 41 / 1001)
    assert bootstrap.p_value(np.full(1000, 3.0)) == pytest.approx(2 / 1001)  # never 0
    assert bootstrap.p_value(np.linspace(-1, 1, 999)) == 1.0


def test_the_95_percent_interval_of_an_map_difference_covers_the_truth():
    """The truth: the mAP difference of two scorers on a population of 100,000 images, computed exactly; each of
    400 test sets draws 200 of its images (with replacement: independent draws from it) and its paired percentile
    interval (500 resamples) should hold the truth about 95% of the time. One set of resamples serves all 400 sets
    (as it serves all the losses of a dataset): given the resamples the sets are still independent draws. Measured
    in five runs of 2,000 sets (sizes 200 and 400, other seeds): 94.2-95.2% each, a percentile interval's slight
    under-cover."""
    rng = np.random.default_rng(12)
    size, classes, sets, count = 100_000, 2, 400, 500
    labels = (rng.random((size, classes)) < [0.25, 0.5]).astype(np.uint8)
    shared = rng.normal(size=(size, classes))  # what both scorers get wrong alike: the pairing's gain
    better = labels * 1.6 + 0.8 * shared + 0.6 * rng.normal(size=(size, classes))
    worse = labels * 1.3 + 0.8 * shared + 0.6 * rng.normal(size=(size, classes))
    truth = metrics.mean_average_precision(better, labels) - metrics.mean_average_precision(worse, labels)
    drawn = rng.integers(0, size, size=(200, sets))  # [images, sets]: the sets side by side, as classes
    positive = labels[drawn].reshape(200, sets * classes) > 0
    resamples = bootstrap.Resamples.draw(200, count, seed=12)
    aps = [bootstrap.resampled_ap(scores[drawn].reshape(200, sets * classes), positive, None, resamples.dense)[0]
           for scores in (better, worse)]
    differences = 100 * (aps[0] - aps[1]).reshape(count, sets, classes).mean(axis=-1)  # [resamples, sets]
    low, high = np.quantile(differences, [0.025, 0.975], axis=0)
    coverage = np.mean((low <= truth) & (truth <= high))
    assert 0.92 <= coverage <= 0.98, coverage
