"""The rankings other evaluators report beside the papers' mAP: VOC 2007's 11-point interpolated AP (as DINOv3's
`map_voc2007` takes it from a precision-recall curve) and label ranking average precision (MTEB's multi-label
probe), against a restatement built on scikit-learn's precision-recall curve and against scikit-learn's
`label_ranking_average_precision_score`, on scores with ties, for stacked heads and partial labels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import label_ranking_average_precision_score, precision_recall_curve

from spml_cache import metrics


def restated_ap11(scores: np.ndarray, labels: np.ndarray) -> float:
    """One class: the mean over the recall levels r = 0, 0.1, ..., 1 of the highest precision of the curve at a
    recall of r or more, the curve's point (recall 0, precision 1) among them (DINOv3's recipe on torchmetrics'
    curve, which is scikit-learn's: a point per distinct score); 0 without a positive."""
    if not labels.any():
        return 0.0
    precision, recall, _ = precision_recall_curve(labels, scores)
    return float(np.mean([precision[recall * 10 >= level - 1e-9].max() for level in range(11)]))


def draws(count: int, seed: int = 0):
    """Small label matrices and scores rounded to one decimal (many ties, within and across labels)."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        rows, classes = int(rng.integers(1, 40)), int(rng.integers(1, 7))
        labels = (rng.random((rows, classes)) < 0.35).astype(np.uint8)
        yield labels, np.round(rng.random((rows, classes)), 1).astype(np.float32), rng


def test_the_11_point_ap_is_the_curve_s_interpolated_precision():
    for labels, scores, _ in draws(300):
        got = metrics.average_precision(torch.from_numpy(scores), labels, points=11).numpy()
        expected = [restated_ap11(scores[:, c], labels[:, c]) for c in range(labels.shape[1])]
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)


def test_the_11_point_ap_by_hand_and_where_it_parts_from_sklearn_s():
    # ranked: neg, pos, pos, neg, pos: precision 0, 1/2, 2/3, 2/4, 3/5 at recall 0, 1/3, 2/3, 2/3, 1
    scores = torch.tensor([[0.9], [0.8], [0.7], [0.6], [0.5]])
    labels = np.array([[0], [1], [1], [0], [1]])
    # level 0: the curve's (0, 1); 0.1-0.6: 2/3 (reached by 2/3 at recall 2/3); 0.7-1: 3/5
    assert metrics.average_precision(scores, labels, points=11).item() == pytest.approx((1 + 6 * 2 / 3 + 4 * 3 / 5) / 11)
    assert metrics.average_precision(scores, labels).item() == pytest.approx((1 / 2 + 2 / 3 + 3 / 5) / 3)
    # a recall of exactly k/10 reaches level k: 10 positives, the first 3 ranked on top
    ten = torch.arange(20, 0, -1, dtype=torch.float32).unsqueeze(1)
    hits = np.zeros((20, 1), dtype=np.uint8)
    hits[[0, 1, 2, 5, 7, 9, 11, 13, 15, 17]] = 1
    assert metrics.average_precision(ten, hits, points=11).item() == pytest.approx(restated_ap11(ten[:, 0].numpy(),
                                                                                                hits[:, 0]))


def test_the_11_point_ap_of_stacked_heads_partial_labels_and_a_diverged_head():
    rng = np.random.default_rng(1)
    labels = (rng.random((30, 4)) < 0.4).astype(np.uint8)
    labels[:, 3] = 0  # a class without positives: 0
    mask = (rng.random((30, 4)) < 0.7).astype(np.uint8)
    heads = torch.rand(3, 30, 4, generator=torch.Generator().manual_seed(0))
    heads[2, 5, 1] = torch.nan
    stacked = metrics.average_precision(heads, labels, points=11)
    alone = torch.stack([metrics.average_precision(head, labels, points=11) for head in heads])
    assert torch.equal(stacked.isnan(), alone.isnan()) and stacked.isnan().tolist()[2] == [False, True, False, False]
    torch.testing.assert_close(stacked.nan_to_num(), alone.nan_to_num(), rtol=0, atol=0)
    assert stacked[:, 3].nan_to_num().eq(0).all()
    masked = metrics.average_precision(heads[0], labels, mask, points=11).numpy()
    for c in range(4):  # the annotated rows of that class only, as if the others were not there
        kept = mask[:, c] == 1
        assert masked[c] == pytest.approx(restated_ap11(heads[0, kept, c].numpy(), labels[kept, c]), abs=1e-12)


def test_label_ranking_average_precision_is_scikit_learn_s():
    for labels, scores, rng in draws(300, seed=2):
        per_image = metrics.label_ranking_precision(torch.from_numpy(scores), labels)
        assert per_image.shape == (len(labels),) and per_image.dtype == torch.float64
        assert per_image.mean().item() == pytest.approx(label_ranking_average_precision_score(labels, scores),
                                                        abs=1e-12)
    stacked = torch.from_numpy(np.stack([scores, scores[::-1].copy()]))  # heads score alike, each on its own
    assert torch.equal(metrics.label_ranking_precision(stacked, labels)[0], metrics.label_ranking_precision(
        stacked[0], labels))


def test_label_ranking_over_the_annotated_labels_and_its_edge_rows():
    rng = np.random.default_rng(4)
    labels = (rng.random((40, 6)) < 0.3).astype(np.uint8)
    labels[0], labels[1] = 0, 1  # no positive; every label positive: 1, as scikit-learn has it
    mask = (rng.random((40, 6)) < 0.75).astype(np.uint8)
    mask[:2] = 1
    scores = rng.random((40, 6)).astype(np.float32)
    got = metrics.label_ranking_precision(torch.from_numpy(scores), labels, mask).numpy()
    assert got[0] == 1.0 and got[1] == 1.0
    for row in range(40):  # each image's annotated labels alone, through scikit-learn
        kept = mask[row] == 1
        expected = label_ranking_average_precision_score(labels[row:row + 1, kept], scores[row:row + 1, kept]) \
            if kept.sum() > 0 else 1.0
        assert got[row] == pytest.approx(expected, abs=1e-12), row
    scores[7, 2] = np.nan  # a diverged head's image stays visible
    assert np.isnan(metrics.label_ranking_precision(torch.from_numpy(scores), labels).numpy()[7])
