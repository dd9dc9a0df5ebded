"""The metric of the SPML papers: per-class average precision and mAP, with scikit-learn's semantics.

`average_precision` is `sklearn.metrics.average_precision_score` for every class and every leading (head)
index at once, on the scores' device (or, `points=11`, VOC 2007's interpolated AP); `mean_average_precision` is the
papers' mAP (0-100, the mean over all classes, a class without positives counting 0); `label_ranking_precision` is
each image's label ranking average precision. Partial labels (a `mask`, 1 where an entry is annotated) are
scored over their annotated entries only, and their mAP is the mean over the classes with an annotated positive
(`scored_classes`). docs/protocol.md, "The metric".
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from spml_cache.runtime.errors import SpmlError


def _as_tensor(values: Any) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values
    array = np.ascontiguousarray(values)
    if not array.flags.writeable:  # torch warns on read-only buffers (np.load mmap, h5py)
        array = array.copy()
    return torch.from_numpy(array)


def _order_keys(scores: torch.Tensor) -> torch.Tensor:
    """Integers with the same order and the same ties as `scores` (any layout), small enough to double."""
    if scores.element_size() >= 8:
        # 64-bit scores leave no room for the label bit: their dense ranks have the same order and ties.
        return torch.unique(scores, return_inverse=True)[1]
    if scores.is_floating_point():
        # IEEE floats are sign-magnitude: magnitude times sign of the int32 bits orders like the floats,
        # and -0.0 meets +0.0 at 0 (sklearn ties them).
        bits = scores.float().view(torch.int32)
        return (bits & 0x7FFFFFFF).mul_(bits.sign())
    return scores  # bool and integers up to 32 bits are their own keys


# Added to the key of an unannotated entry: it sorts after every annotated one (order keys are within +-2^32, their
# doubles within +-2^33), so no precision is taken at or after it, and it never ties with an annotated entry.
UNANNOTATED_KEY = 1 << 40


def _sorted_keys(scores: torch.Tensor, positive: torch.Tensor, unannotated: torch.Tensor | None = None) -> torch.Tensor:
    """int64 `[..., C, N]`, each row sorted ascending: `2 * (-order key of the score) + label`.

    Ascending keys are descending scores, tied scores stay adjacent, and the label rides along in the low
    bit: one sort of plain integers replaces an argsort and two gathers. Unannotated entries (`[C, N]`, True
    where unknown; their label is 0) go last.
    """
    *heads, num_rows, num_classes = scores.shape
    keys = torch.empty((*heads, num_classes, num_rows), dtype=torch.int64, device=scores.device)
    keys.copy_(_order_keys(scores).transpose(-1, -2))
    keys.mul_(-2).add_(positive.to(torch.int64))
    if unannotated is not None:
        keys.add_(unannotated.to(torch.int64) * UNANNOTATED_KEY)
    if keys.device.type == "cpu":
        # numpy's vectorised sort is several times faster than torch.sort on the CPU (same result: the keys are
        # plain integers), and sorts in place.
        keys.numpy().sort(axis=-1)
        return keys
    return torch.sort(keys, dim=-1).values


def average_precision(scores: torch.Tensor, labels: torch.Tensor | np.ndarray,
                      mask: torch.Tensor | np.ndarray | None = None, points: int | None = None) -> torch.Tensor:
    """Per-class average precision (0..1) of `scores [..., N, C]` against 0/1 `labels [N, C]`: `[..., C]`.

    sklearn's `average_precision_score` for every class and every leading (head) index at once:
    AP = sum over distinct score thresholds t (descending) of (R(t) - R(t_prev)) * P(t), with P and R the
    precision and recall of "score >= t"; tied scores enter together. A class without positives has AP 0.
    A column with a NaN score has AP NaN (a diverged head stays visible). Labels > 0 count as positive.
    Computed on the scores' device; float64 result. With a `mask` ([N, C], nonzero where the label is
    annotated), each class is scored over its annotated entries only, as if the others were not there.
    `points=11`: VOC 2007's interpolated AP instead (`interpolated`).
    """
    scores = _as_tensor(scores).detach()
    labels = _as_tensor(labels).to(scores.device)
    if scores.ndim < 2 or tuple(scores.shape[-2:]) != tuple(labels.shape):
        raise SpmlError(f"scores {tuple(scores.shape)} do not match labels {tuple(labels.shape)}: expected [..., N, C]")
    device = scores.device
    positive = (labels > 0).T  # [C, N]
    unannotated = None
    if mask is not None:
        unannotated = (_as_tensor(mask).to(device) == 0).T
        positive = positive & ~unannotated
    if scores.shape[-2] == 0:  # no images: no positives
        return torch.zeros(scores.shape[:-2] + scores.shape[-1:], dtype=torch.float64, device=device)

    # The [heads, C, N] buffers are large: they are reused in place, as allocating them is a good part of the
    # cost on the CPU.
    keys = _sorted_keys(scores, positive, unannotated)
    true_pos = torch.bitwise_and(keys, 1, out=torch.empty(keys.shape, dtype=torch.int32, device=device))
    true_pos.cumsum_(-1)  # true positives among the top n scores, n = 1..N
    keys >>= 1  # drop the labels: equal keys are now tied scores (an unannotated entry equals no annotated one)
    # sklearn evaluates precision at distinct thresholds only: at a cut after the last of a run of tied scores.
    is_cut = torch.ones(keys.shape, dtype=torch.bool, device=device)
    torch.ne(keys[..., 1:], keys[..., :-1], out=is_cut[..., :-1])
    if points is not None:
        return _unless_diverged(interpolated(true_pos, is_cut, positive.sum(-1), points), scores)
    gained = torch.mul(true_pos, is_cut)
    del is_cut
    at_last_cut = torch.empty_like(true_pos)
    torch.cummax(gained, dim=-1, out=(at_last_cut, keys))  # keys' buffer takes the unused argmax indices
    # Positives gained at a cut: the step of the true positives at the last cut (zero between cuts).
    torch.sub(at_last_cut[..., 1:], at_last_cut[..., :-1], out=gained[..., 1:])
    gained[..., 0] = at_last_cut[..., 0]
    del at_last_cut
    # AP * positives = sum over cuts of (positives gained) * precision; float64 products in keys' buffer.
    weighted = keys.view(torch.float64)
    del keys
    weighted.copy_(gained).mul_(true_pos)
    del gained, true_pos
    inverse_ranks = 1.0 / torch.arange(1, scores.shape[-2] + 1, device=device, dtype=torch.float64)
    # A product and a sum along each row rather than a matrix-vector product: BLAS may block a matvec by the
    # number of rows, so a head's AP would depend on how many heads were scored with it (in-process or in worker
    # processes, resumed or not); a row reduction does not.
    recall_weighted = weighted.mul_(inverse_ranks).sum(dim=-1)

    num_positives = positive.sum(-1, dtype=torch.float64)
    ap = torch.where(num_positives > 0, recall_weighted / num_positives.clamp(min=1), 0.0)
    return _unless_diverged(ap, scores)


def _unless_diverged(ap: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """`ap [..., C]` with NaN where a class's column of `scores [..., N, C]` holds a NaN (amax propagates it)."""
    if scores.is_floating_point():
        ap = torch.where(torch.isnan(scores.amax(dim=-2)), torch.nan, ap)
    return ap


def interpolated(true_pos: torch.Tensor, is_cut: torch.Tensor, num_positives: torch.Tensor,
                 points: int = 11) -> torch.Tensor:
    """VOC 2007's interpolated AP (Everingham et al., IJCV 2010, Sec. 4.2), as DINOv3's `map_voc2007` takes it
    from torchmetrics' precision-recall curve: the mean over the recall levels r = 0, 1/10, ..., 1 of the highest
    precision at any distinct score threshold whose recall is at least r, the curve's point (recall 0, precision 1)
    included, so the level 0 counts 1. `true_pos [..., C, N]`: the positives among the top n scores (n = 1..N);
    `is_cut`: True at the last of a run of tied scores (a threshold); `num_positives [C]`. A level is reached where
    (points - 1) * TP >= level * P, in integers: exactly at recall k/10, as torchmetrics' float32 recall and
    `torch.linspace(0, 1, 11)` meet there. A class without positives: 0."""
    ranks = torch.arange(1, true_pos.shape[-1] + 1, device=true_pos.device, dtype=torch.float64)
    precision = torch.where(is_cut, true_pos / ranks, 0.0)  # a rank inside a run of ties is no threshold
    best_from = precision.flip(-1).cummax(-1).values.flip(-1)  # the highest precision at each rank or further down
    positives = num_positives.to(torch.int64).unsqueeze(-1)
    total = torch.ones(true_pos.shape[:-1], dtype=torch.float64, device=true_pos.device)  # level 0
    for level in range(1, points):  # recall only grows down the ranking: its first rank at the level, or past it
        first = (true_pos * (points - 1) < level * positives).sum(-1, keepdim=True).clamp(max=true_pos.shape[-1] - 1)
        total += best_from.gather(-1, first).squeeze(-1)
    return torch.where(positives.squeeze(-1) > 0, total / points, 0.0)


def label_ranking_precision(scores: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray,
                            mask: torch.Tensor | np.ndarray | None = None) -> torch.Tensor:
    """Each image's label ranking average precision (0..1), float64 `[..., N]`, of `scores [..., N, C]` against 0/1
    `labels [N, C]`; their mean is scikit-learn's `label_ranking_average_precision_score` (MTEB's multi-label
    probe). Per image: the mean over its positive labels j of (positives scoring at least s_j) / (labels scoring at
    least s_j), ties counted above (scikit-learn's "max" rank); an image with no positive, or with every label
    positive, scores 1, as scikit-learn has it. With a `mask`, over each image's annotated labels only. An image
    with a NaN score is NaN."""
    scores = _as_tensor(scores).detach()
    labels = _as_tensor(labels).to(scores.device)
    if scores.ndim < 2 or tuple(scores.shape[-2:]) != tuple(labels.shape):
        raise SpmlError(f"scores {tuple(scores.shape)} do not match labels {tuple(labels.shape)}: expected [..., N, C]")
    positive = labels > 0
    annotated = None if mask is None else _as_tensor(mask).to(scores.device) != 0
    if annotated is not None:
        positive = positive & annotated
    # _sorted_keys sorts each row of its `[..., C, N]` output: fed the transpose, each image's labels, best first
    keys = _sorted_keys(scores.transpose(-1, -2), positive, None if annotated is None else ~annotated)
    hits = keys & 1
    found = hits.cumsum(-1)  # positives among the image's top n labels
    keys >>= 1  # the scores' order alone: equal keys are tied labels (an unannotated one equals none annotated)
    ranked = torch.searchsorted(keys, keys, right=True)  # labels scoring at least as high, ties counted
    precision = found.gather(-1, ranked - 1).double() / ranked
    count = positive.sum(-1)
    labelled = torch.full_like(count, positive.shape[-1]) if annotated is None else annotated.sum(-1)
    value = (precision * hits).sum(-1) / count.clamp(min=1)
    value = torch.where((count == 0) | (count == labelled), 1.0, value)
    if scores.is_floating_point():
        value = torch.where(torch.isnan(scores).any(dim=-1), torch.nan, value)
    return value


def scored_classes(labels: torch.Tensor | np.ndarray, mask: torch.Tensor | np.ndarray | None = None) -> torch.Tensor | None:
    """bool `[C]`: the classes a partially labelled split's mAP averages over, those with an annotated positive;
    None without a mask (the papers' mAP: every class, one without positives counting 0)."""
    if mask is None:
        return None
    labels = _as_tensor(labels)
    return ((labels > 0) & (_as_tensor(mask).to(labels.device) != 0)).any(dim=0)


def mean_over_classes(ap: torch.Tensor, scored: torch.Tensor | None = None) -> torch.Tensor:
    """mAP on the 0..100 scale from per-class AP `[..., C]`: the mean over every class, or over `scored` ones."""
    if scored is None:
        return 100.0 * ap.mean(dim=-1)
    scored = scored.to(ap.device)
    return 100.0 * (ap * scored).sum(dim=-1) / scored.sum().clamp(min=1)


def mean_average_precision(scores: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray,
                           mask: torch.Tensor | np.ndarray | None = None) -> float:
    """mAP on the 0..100 scale of one `[N, C]` score matrix, numpy or torch inputs: the mean over ALL classes of
    `average_precision` (classes without positives count as 0); with a `mask`, over the annotated entries and the
    classes with an annotated positive (`scored_classes`)."""
    scores = _as_tensor(scores)
    if scores.ndim != 2 or scores.shape[-1] == 0:
        raise SpmlError(f"mean_average_precision wants scores [N, C] with C >= 1, got {tuple(scores.shape)}")
    ap = average_precision(scores, labels, mask)
    return float(mean_over_classes(ap, scored_classes(labels, mask)))


# --- decisions: the F1 family of the multi-label literature (docs/protocol.md, "Decisions at a threshold") -----

THRESHOLD = 0.5  # on the sigmoid score: a label is predicted where its score is at least this
TOP_K = 3  # the most labels predicted per image by the top-k variants (`cf1@3`): the COCO literature's three


def predicted(scores: torch.Tensor | np.ndarray, top_k: int | None = None) -> torch.Tensor:
    """bool `[..., N, C]`: the labels predicted from sigmoid `scores [..., N, C]`: each score >= THRESHOLD (ML-GCN's
    `logit >= 0`: a score of exactly 0.5 is predicted); with `top_k`, of each image's k highest scores those at or
    above the threshold, as ML-GCN's evaluation code (`overall_topk`, which the COCO papers' top-3 tables reuse)
    takes them, so an image has at most k. Among tied scores the lower class index goes first (a stable sort)."""
    scores = _as_tensor(scores)
    if top_k is None:
        return scores >= THRESHOLD
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :top_k]
    top = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, order, True)
    return top & (scores >= THRESHOLD)


def decision_counts(predicted: torch.Tensor, labels: torch.Tensor | np.ndarray,
                    mask: torch.Tensor | np.ndarray | None = None, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float64 `[..., 3, C]`: per class the true positives, the predicted positives and the positives of the bool
    `predicted [..., N, C]` against 0/1 `labels [N, C]`, over the annotated entries only (`mask`, partial labels:
    an unannotated entry is neither a false positive nor a missed one, as mAP leaves it out). With `weights`
    (`[B, N]`, an image's count in each bootstrap resample) each image counts that many times: `[..., B, 3, C]`."""
    device = predicted.device
    positive = _as_tensor(labels).to(device) > 0
    if mask is not None:
        annotated = _as_tensor(mask).to(device) != 0
        predicted, positive = predicted & annotated, positive & annotated
    counts = torch.stack(torch.broadcast_tensors(predicted & positive, predicted, positive), dim=-2)  # [..., N, 3, C]
    counts = counts.flatten(-2)  # [..., N, 3C]: a count is a sum over the images ...
    if weights is None:
        summed = counts.sum(dim=-2, dtype=torch.float64)
    else:  # ... or a weighted sum, one per resample: a matrix product, in float32 exact for whole counts (each
        # partial sum is a whole number no larger than the resample's size, N < 2^24)
        summed = torch.matmul(weights.to(device, torch.float32), counts.to(torch.float32)).to(torch.float64)
    return summed.unflatten(-1, (3, -1))


def _ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator, 0 where the denominator is 0 (scikit-learn's `zero_division=0`)."""
    return torch.where(denominator > 0, numerator / denominator.clamp(min=1e-300), 0.0)


def _harmonic(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    return _ratio(2 * first * second, first + second)


F1_FAMILY = ("cp", "cr", "cf1", "op", "or", "of1")


def f1_family(counts: torch.Tensor, partial: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The multi-label literature's CP, CR, CF1, OP, OR, OF1 (0..100, `[...]` each) and the per-class F1 (0..1,
    `[..., C]`) from `decision_counts` `[..., 3, C]`.

    Per class, precision = TP / predicted and recall = TP / positives, 0 where the denominator is 0 (a class never
    predicted has precision 0: ML-GCN's code and scikit-learn's `zero_division=0`). CP and CR are their means over
    the classes; CF1 is the harmonic mean of CP and CR, as ML-GCN and ASL define it: NOT scikit-learn's macro F1,
    the mean of the per-class F1s (the two differ whenever the classes' precisions and recalls differ). OP, OR and
    OF1 take the counts over every entry (scikit-learn's micro averages). `partial` (a split with a label mask):
    the class means are over the classes with an annotated positive, as that split's mAP is."""
    true_pos, chosen, positives = counts.unbind(-2)
    precision, recall = _ratio(true_pos, chosen), _ratio(true_pos, positives)
    if partial:
        scored = (positives > 0).to(torch.float64)
    else:
        scored = torch.ones_like(positives)
    classes = scored.sum(-1).clamp(min=1)
    cp, cr = (precision * scored).sum(-1) / classes, (recall * scored).sum(-1) / classes
    op, overall_recall = _ratio(true_pos.sum(-1), chosen.sum(-1)), _ratio(true_pos.sum(-1), positives.sum(-1))
    values = {"cp": cp, "cr": cr, "cf1": _harmonic(cp, cr), "op": op, "or": overall_recall,
              "of1": _harmonic(op, overall_recall)}
    # 2TP / (predicted + positives) is 2PR / (P + R) of the class; 0 for a class neither predicted nor positive
    return {name: 100.0 * value for name, value in values.items()}, _ratio(2 * true_pos, chosen + positives)
