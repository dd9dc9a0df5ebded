"""The test set's spread: each metric recomputed on bootstrap resamples of the test images (docs/protocol.md,
"Intervals over the test images").

A resample draws N of the N test images with replacement; it is held as each image's count in it (`Resamples`),
drawn once per test-set size from a fixed seed, so every loss of a dataset is scored on the very same resamples
and the difference of two losses is paired. Counting is the whole trick that makes it fast: an image drawn twice is
the same image twice, so the resampled set never has to be built. A class's AP on a resample needs only the
order of its scores, fixed across resamples (sorted once), and running sums of the counts along that order
(`resampled_ap`); the F1 family's counts are the counts times the per-image decisions, one matrix product
(`metrics.decision_counts` with weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from spml_cache import labels as label_matrix
from spml_cache import metrics
from spml_cache.runs import StoredTest, image_ranking_precision

RESAMPLE_SEED = 0  # numpy.random.default_rng's: the same resamples on every machine, for every report
DRAW_ROWS = 1 << 24  # draws per block while counting: the indices of a block are int64, so 128 MB at most
LEVEL = 0.95


@dataclass(frozen=True)
class Resamples:
    """`count` bootstrap resamples of `num_rows` test images as `counts [N, B]`: how often each image is drawn into
    each resample (each column sums to N), uint8 where every count fits (it does but for tiny N), else int32."""

    counts: np.ndarray

    @classmethod
    def draw(cls, num_rows: int, count: int, seed: int = RESAMPLE_SEED) -> "Resamples":
        rng = np.random.default_rng(seed)
        counts = np.zeros((count, num_rows), dtype=np.int32)
        step = max(1, DRAW_ROWS // max(num_rows, 1))
        for low in range(0, count, step):  # resample b draws rng.integers(0, N, N), in order b = 0, 1, ...
            high = min(low + step, count)
            drawn = rng.integers(0, num_rows, size=(high - low, num_rows)) if num_rows else np.zeros((high - low, 0), int)
            drawn += np.arange(high - low)[:, None] * num_rows
            counts[low:high] = np.bincount(drawn.ravel(), minlength=(high - low) * num_rows).reshape(high - low, -1)
        small = counts.max(initial=0) < 256
        return cls(np.ascontiguousarray(counts.T, dtype=np.uint8 if small else np.int32))

    @property
    def count(self) -> int:
        return self.counts.shape[1]

    @cached_property
    def dense(self) -> np.ndarray:
        """The counts as `resampled_ap` sums them, `[N, B]`: integers, exact and several times faster to sum than
        floats; uint16 where every sum fits (no sum of counts exceeds N: below 2^16 images), else int32."""
        return self.counts.astype(np.uint16 if len(self.counts) < 1 << 16 else np.int32)

    @cached_property
    def weights(self) -> torch.Tensor:
        """float32 `[B, N]` (exact: every sum of whole counts stays below 2^24 for N < 2^24 images)."""
        return torch.from_numpy(self.counts.T.astype(np.float32))


def bytes_needed(count: int, num_rows: int, num_classes: int, most_positives: int, metric: str) -> int:
    """About the memory at its peak of `count` resamples of `num_rows` test images and one result's `metric` on
    them (`most_positives`: the positives of the test set's largest class), counted from the arrays made. Drawing:
    the counts in int32 and their uint8 transpose (5 bytes per image and resample) beside a block of int64 draws
    and their bincount (16 bytes an entry, `DRAW_ROWS` entries at most). Then mAP: the counts in uint8 and as
    `dense` sums them (3 per image), each class's AP and has-positive (9 per class), and one block of classes'
    running sums and ratios (30 bytes per positive, `GROUP_ENTRIES` or one class's positives per resample at
    most); the F1 family: the counts in uint8 and as float32 `weights` (5 per image), each class's counts and
    ratios (14 float64 per class). docs/benchmarks.md sets it beside the peaks measured."""
    drawing = count * 5 * num_rows + 16 * min(count * num_rows, DRAW_ROWS)
    if metric.partition("@")[0] == "map":
        scoring = count * (3 * num_rows + 9 * num_classes) + 30 * max(GROUP_ENTRIES, count * most_positives)
    else:
        scoring = count * (5 * num_rows + 14 * 8 * num_classes)
    return max(drawing, scoring)


def most_that_fit(room: int, num_rows: int, num_classes: int, most_positives: int, metric: str) -> int:
    """The most resamples whose `bytes_needed` is within `room` bytes (0: not even one)."""
    low, high = 0, max(1, room)  # a resample takes a byte at least
    while low < high:  # bytes_needed grows with the count
        middle = (low + high + 1) // 2
        fits = bytes_needed(middle, num_rows, num_classes, most_positives, metric) <= room
        low, high = (middle, high) if fits else (low, middle - 1)
    return low


GROUP_ENTRIES = 1 << 18  # (runs with a positive) x resamples per block of classes: arrays of 1-2 MB, in cache


def resampled_ap(scores: np.ndarray, positive: np.ndarray, annotated: np.ndarray | None, counts: np.ndarray,
                 points: int | None = None):
    """Per-class AP (0..1, float64 `[B, K]`) of `scores [N, K]` against bool `positive [N, K]` on every resample
    (`counts`: `Resamples.dense`, integers `[N, B]`), and whether the resample holds a positive of the class (`[B, K]`);
    with bool `annotated [N, K]` (partial labels) each class over its annotated images only; `points=11`: VOC
    2007's interpolated AP (`interpolated_runs`).

    sklearn's AP of the resampled set: the sum over distinct thresholds of the recall gained times the precision
    there. Sorted by score once per class, the images of each run of tied scores enter together (an image drawn
    twice ties with itself); only the runs holding a positive gain recall, so with P and TP the running sums of
    the counts (all images, positives) at the end of such a run k, AP = sum_k gain_k * TP_k / P_k / TP_last. The
    counts of each stretch of images up to such a run, and of each run's positives, are one sparse product each
    for a block of classes. A class with a NaN score has AP NaN (a diverged head stays visible).
    """
    if annotated is not None:
        positive = positive & annotated
    width = scores.shape[1]
    ap, has_positive = np.zeros((counts.shape[1], width)), np.zeros((counts.shape[1], width), dtype=bool)
    room, low, taken = max(1, GROUP_ENTRIES // max(counts.shape[1], 1)), 0, 0
    for column, found in enumerate(positive.sum(axis=0)):  # blocks of classes holding `room` positives at most
        if taken and taken + found > room:
            _block_ap(scores, positive, annotated, counts, slice(low, column), (ap, has_positive), points)
            low, taken = column, 0
        taken += found
    _block_ap(scores, positive, annotated, counts, slice(low, width), (ap, has_positive), points)
    diverged = np.isnan(scores).any(axis=0)
    ap[:, diverged], has_positive[:, diverged] = np.nan, True
    return ap, has_positive


def _block_ap(scores, positive, annotated, counts, classes: slice, out: tuple, points: int | None = None) -> None:
    """`resampled_ap` of the classes `classes`, written into `out` (ap, has_positive)."""
    from scipy.sparse import csr_matrix  # scikit-learn's own dependency

    keys = np.nan_to_num(-scores[:, classes].T.astype(np.float64))  # [k, N]: ascending keys, descending scores
    hits = positive[:, classes].T
    outside = np.zeros_like(hits) if annotated is None else ~annotated[:, classes].T
    order = np.lexsort((keys, outside), axis=-1)  # stable; unannotated images last, never scored
    ranked, outside = np.take_along_axis(keys, order, -1), np.take_along_axis(outside, order, -1)
    hits = np.take_along_axis(hits, order, -1).ravel()
    width, num_rows = keys.shape
    starts_run = np.ones((width, num_rows), dtype=bool)  # a run of tied scores; one starts each class's row
    starts_run[:, 1:] = (ranked[:, 1:] != ranked[:, :-1]) | (outside[:, 1:] != outside[:, :-1])
    starts_run = starts_run.ravel()
    run_of = np.cumsum(starts_run) - 1
    run_end = np.flatnonzero(np.append(starts_run[1:], True))  # the last position of each run
    hit_at = np.flatnonzero(hits)
    if len(hit_at) == 0:
        return
    hit_runs = run_of[hit_at]
    first = np.flatnonzero(np.append(True, hit_runs[1:] != hit_runs[:-1]))  # positives grouped by run
    ends = run_end[hit_runs[first]]  # where each run with a positive ends: the thresholds that gain recall
    column = ends // num_rows
    starts_class = np.flatnonzero(np.append(True, column[1:] != column[:-1]))  # its first run, per scored class
    last_end = np.full(width, -1)
    last_end[column[starts_class]] = ends[np.append(starts_class[1:] - 1, len(ends) - 1)] - column[starts_class] * num_rows
    covered = (np.arange(num_rows) <= last_end[:, None]).ravel()  # what precedes a class's last positive run
    rows, run_bounds = order.ravel(), np.append(0, np.cumsum(covered)[ends])
    ends_class = np.append(starts_class[1:], len(ends))  # one past each class's last run

    def running(members: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The counts of each group `[B, G]` and their running sums within each class (at most N: the counts'
        dtype holds them), the resamples along the rows so that every sum runs along contiguous memory."""
        grouping = csr_matrix((np.ones(len(members), counts.dtype), rows[members], bounds), shape=(len(bounds) - 1, len(counts)))
        groups = np.ascontiguousarray(np.asarray(grouping @ counts).T)  # the counts' dtype holds every sum (<= N)
        shifted = groups
        if len(starts_class) > 1:  # a class's first group takes away the class before it: one cumsum restarts at each
            shifted = groups.astype(np.int32)
            shifted[:, starts_class[1:]] -= np.add.reduceat(shifted, starts_class, axis=1)[:, :-1]
        return groups, np.cumsum(shifted, axis=1, dtype=np.int32)  # within [0, N]; int32 named: the fast loop

    _, predicted = running(np.flatnonzero(covered), run_bounds)
    gains, true_pos = running(hit_at, np.append(first, len(hit_at)))
    total = true_pos[:, ends_class - 1]
    scored = classes.start + column[starts_class]
    if points is None:
        weighted = np.add.reduceat(gains * (true_pos / np.maximum(predicted, 1)), starts_class, axis=1)  # float64
        out[0][:, scored] = np.where(total > 0, weighted / np.maximum(total, 1), 0.0)
    else:
        out[0][:, scored] = interpolated_runs(true_pos, predicted, starts_class, ends_class, points)
    out[1][:, scored] = total > 0


def interpolated_runs(true_pos: np.ndarray, predicted: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                      points: int = 11) -> np.ndarray:
    """`metrics.interpolated` on every resample, `[B, K]`, from the running sums `_block_ap` makes: a class's true
    positives and images drawn (`[B, G]`) at the end of each of its runs of tied scores holding a positive, classes
    `starts[k]:ends[k]` of the G columns. Those are the only thresholds that matter: elsewhere recall stays and
    precision falls, so no other point is the highest at any recall level."""
    every = np.arange(true_pos.shape[0])
    found = np.zeros((true_pos.shape[0], len(starts)))
    for k, (low, high) in enumerate(zip(starts, ends)):
        gained, drawn = true_pos[:, low:high], predicted[:, low:high]
        best_from = np.maximum.accumulate((gained / np.maximum(drawn, 1))[:, ::-1], axis=1)[:, ::-1]
        total = gained[:, -1:]
        ap = np.ones(len(every))  # recall level 0: the curve's point (0, 1)
        for level in range(1, points):
            first = np.minimum((gained * (points - 1) < level * total).sum(axis=1), high - low - 1)
            ap += best_from[every, first]
        found[:, k] = np.where(total[:, 0] > 0, ap / points, 0.0)
    return found


def _seed_map(scores: np.ndarray, stored: StoredTest, resamples: Resamples, points: int | None = None) -> np.ndarray:
    """One seed's mAP (0..100) on every resample, `[B]`: the mean over all classes (a class without a positive in
    the resample counting 0, as the papers' mAP), or with a label mask over the classes with an annotated positive
    in it (as a partially labelled split's mAP); `points=11`: of VOC 2007's interpolated AP."""
    ap_sum, scored = np.zeros(resamples.count), np.zeros(resamples.count)
    for low, high in label_matrix.class_blocks(stored.labels):
        positive = label_matrix.columns(stored.labels, low, high) > 0
        annotated = None if stored.mask is None else label_matrix.columns(stored.mask, low, high) != 0
        ap, has_positive = resampled_ap(scores[:, low:high], positive, annotated, resamples.dense, points)
        ap_sum += ap.sum(axis=1) if annotated is None else np.where(has_positive, ap, 0.0).sum(axis=1)
        scored += (high - low) if annotated is None else has_positive.sum(axis=1)
    return 100.0 * ap_sum / np.maximum(scored, 1)


def _seed_decisions(scores: np.ndarray, stored: StoredTest, resamples: Resamples, name: str, top_k: int | None):
    """One seed's F1-family metric `name` (0..100) on every resample, `[B]`."""
    chosen = metrics.predicted(torch.from_numpy(scores), top_k)
    parts = []
    for low, high in label_matrix.class_blocks(stored.labels):
        block_labels = torch.from_numpy(label_matrix.columns(stored.labels, low, high))
        block_mask = None if stored.mask is None else torch.from_numpy(label_matrix.columns(stored.mask, low, high))
        parts.append(metrics.decision_counts(chosen[:, low:high], block_labels, block_mask, resamples.weights))
    values, _ = metrics.f1_family(torch.cat(parts, dim=-1), stored.mask is not None)
    return values[name].numpy()


def _seed_lrap(scores: np.ndarray, stored: StoredTest, resamples: Resamples) -> np.ndarray:
    """One seed's LRAP (0..100) on every resample, `[B]`: each image's own LRAP (its labels' ranking is its own,
    whatever else is drawn) weighted by its count in the resample."""
    per_image = image_ranking_precision(torch.from_numpy(scores), stored.labels, stored.mask).numpy()
    return 100.0 * (per_image @ resamples.counts) / max(len(per_image), 1)


def resampled(stored: StoredTest, metric: str, resamples: Resamples) -> np.ndarray:
    """`metric` (`map`, `map11`, `lrap`, `cf1`, `of1@3`, ...: report/measures.py's names) of one result on every
    resample, `[B]`: the mean over its seeds of each seed's value on that resample, so the interval is around the
    table's mean."""
    name, _, k = metric.partition("@")
    rankings = {"map": _seed_map, "map11": lambda *given: _seed_map(*given, points=11), "lrap": _seed_lrap}
    per_seed = [(rankings[name](scores, stored, resamples) if name in rankings else
                 _seed_decisions(scores, stored, resamples, name, int(k) if k else None)) for scores in stored.scores]
    return np.mean(per_seed, axis=0)


def interval(values: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """The percentile interval (Efron & Tibshirani, ch. 13): the (1 - level)/2 and (1 + level)/2 quantiles of the
    resampled values (numpy's linear interpolation between order statistics)."""
    tail = (1.0 - level) / 2
    low, high = np.quantile(values, [tail, 1.0 - tail])
    return float(low), float(high)


def p_value(differences: np.ndarray) -> float:
    """Two-sided p-value of "no difference" from paired resampled differences: twice the smaller share of
    resamples on either side of 0 (0 counting on both), with the +1 of a Monte Carlo test so that it is never 0:
    p = min(1, 2 (1 + min(#{d <= 0}, #{d >= 0})) / (B + 1)). Below 0.05 about when the percentile interval leaves
    out 0."""
    below, above = int((differences <= 0).sum()), int((differences >= 0).sum())
    return min(1.0, 2.0 * (1 + min(below, above)) / (len(differences) + 1))
