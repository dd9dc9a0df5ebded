"""mAP over partial labels (docs/protocol.md, "The metric"): each class scored over its annotated entries only,
against scikit-learn run on exactly those entries; the mean over the classes with an annotated positive."""

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score

from spml_cache import metrics


def sklearn_masked_ap(scores, labels, mask):
    """Per class: sklearn on the annotated rows alone; 0 for a class without an annotated positive."""
    ap = []
    for c in range(labels.shape[1]):
        rows = mask[:, c] != 0
        positive = labels[rows, c] > 0
        ap.append(average_precision_score(positive, scores[rows, c]) if positive.any() else 0.0)
    return np.array(ap)


@pytest.mark.parametrize("decimals", [None, 1])  # 1: many ties, between annotated and unannotated entries too
def test_masked_ap_matches_sklearn_on_the_annotated_entries(decimals):
    rng = np.random.default_rng(5)
    scores = rng.normal(size=(3, 60, 7)).astype(np.float32)  # three heads
    if decimals is not None:
        scores = scores.round(decimals)
    labels = (rng.random((60, 7)) < 0.3).astype(np.uint8)
    mask = (rng.random((60, 7)) < 0.6).astype(np.uint8)
    mask[:, 6] = 0  # a class with nothing annotated
    labels[:, 5] = 0  # and one with annotated entries but no positive
    ap = metrics.average_precision(torch.from_numpy(scores), labels, mask)
    for head in range(3):
        np.testing.assert_allclose(ap[head].numpy(), sklearn_masked_ap(scores[head], labels, mask), rtol=0, atol=1e-12)


def test_masked_map_leaves_out_classes_without_an_annotated_positive():
    rng = np.random.default_rng(6)
    scores = rng.random((40, 5))
    labels = (rng.random((40, 5)) < 0.4).astype(np.uint8)
    mask = np.ones_like(labels)
    mask[labels[:, 4] == 1, 4] = 0  # class 4: its positives are all unannotated
    scored = metrics.scored_classes(labels, mask)
    assert scored.tolist() == [True, True, True, True, False]
    expected = 100 * sklearn_masked_ap(scores, labels, mask)[:4].mean()
    assert metrics.mean_average_precision(scores, labels, mask) == pytest.approx(expected, abs=1e-9)


def test_a_full_mask_is_the_papers_map():
    rng = np.random.default_rng(7)
    scores, labels = rng.random((30, 4)), (rng.random((30, 4)) < 0.5).astype(np.uint8)
    labels[:, 3] = 0  # without a mask a class without positives counts 0; a full mask leaves it out
    full = np.ones_like(labels)
    ap = metrics.average_precision(torch.from_numpy(scores), labels)
    assert torch.equal(metrics.average_precision(torch.from_numpy(scores), labels, full), ap)
    assert metrics.mean_average_precision(scores, labels) == pytest.approx(100 * ap.mean().item())
    assert metrics.mean_average_precision(scores, labels, full) == pytest.approx(100 * ap[:3].mean().item())
