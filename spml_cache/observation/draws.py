"""The observation rules, one class each: the dense draw (an [N, C] matrix) beside the sparse one (`SparseLabels`,
datasets of many classes, never an [N, C] matrix). A sparse draw gives, entry for entry, the CSR form of its dense
draw (the same seed, the same random stream consumed in the same order), so a cache gives the same observed labels
stored sparse or dense. The rules that need instance areas (`largest`, `size`) have no sparse draw: a sparse
dataset never stores areas. The order of the classes here is the order `--observe` lists them in."""

from __future__ import annotations

import numpy as np

from spml_cache.labels import SparseLabels, contains
from spml_cache.observation.rules import ObservationRule, Param, register
from spml_cache.protocol import full_sparse, observe_labels

BLOCK_ENTRIES = 1 << 22  # random doubles drawn at a time (32 MB): `entry` and `keep-pos` draw in row blocks
COUNT = "a whole number >= 0, or all (-1)"
NEEDS_AREAS = "needs instance areas, which a dataset of sparse labels never stores"


def _fraction(name: str, letter: str) -> Param:
    return Param(name, float, lambda v: 0 < v <= 1, f"in (0, 1] (the fraction {letter})")


class _Entries:
    """Observed entries gathered piece by piece (rows, classes, values), then one CSR matrix."""

    def __init__(self) -> None:
        self.rows, self.classes, self.values = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int8)]

    def add(self, rows: np.ndarray, classes: np.ndarray, values: np.ndarray) -> None:
        self.rows.append(rows.astype(np.int64, copy=False))
        self.classes.append(classes.astype(np.int64, copy=False))
        self.values.append(values.astype(np.int8, copy=False))

    def matrix(self, shape: tuple[int, int]) -> SparseLabels:
        return SparseLabels.from_entries(np.concatenate(self.rows), np.concatenate(self.classes),
                                         np.concatenate(self.values), shape)


def _row_blocks(labels: SparseLabels):
    """(start, stop) of consecutive row blocks of about BLOCK_ENTRIES entries."""
    step = max(1, BLOCK_ENTRIES // max(labels.num_classes, 1))
    return [(start, min(start + step, len(labels))) for start in range(0, len(labels), step)]


@register
class Single(ObservationRule):
    name = "single"
    source = "Cole et al., CVPR 2021 (generate_observed_labels.py, num_pos=1, num_neg=0)"
    summary = "one positive per image, drawn uniformly; no negatives (the SPML setting, the default)"
    keeps_a_positive = "single"

    @staticmethod
    def draw_dense(labels, areas, seed):
        return observe_labels(labels, num_pos=1, num_neg=0, seed=seed)

    @staticmethod
    def draw_sparse(labels: SparseLabels, seed: int) -> SparseLabels:
        return observe_labels(labels, num_pos=1, num_neg=0, seed=seed)


@register
class Uniform(ObservationRule):
    name = "uniform"
    source = "Cole et al., CVPR 2021 (generate_observed_labels.py: num_pos, num_neg; -1 = all)"
    summary = "K positives and M negatives per image, drawn uniformly (all of them when fewer, or K/M = all)"
    params = (Param("pos", int, lambda v: v >= -1, COUNT, default=1, all_is=-1),
              Param("neg", int, lambda v: v >= -1, COUNT, default=0, all_is=-1))
    example = "uniform:pos=K,neg=M"
    keeps_a_positive = "uniform:pos=K"  # K at least 1

    @staticmethod
    def observes_nothing(pos, neg) -> bool:
        return pos == 0 and neg == 0

    @staticmethod
    def draw_dense(labels, areas, seed, pos, neg):
        return observe_labels(labels, num_pos=pos, num_neg=neg, seed=seed)

    @staticmethod
    def draw_sparse(labels: SparseLabels, seed: int, pos: int, neg: int) -> SparseLabels:
        return observe_labels(labels, num_pos=pos, num_neg=neg, seed=seed)


@register
class Entry(ObservationRule):
    name = "entry"
    source = ("the partial-label papers' known label proportion (SST, Chen et al. AAAI 2022; SARB, Pu et al. AAAI"
              " 2022; DualCoOp, Sun et al. NeurIPS 2022)")
    summary = "every entry, positive or negative, observed with probability P"
    params = (_fraction("p", "P"),)
    example = "entry:P"

    @staticmethod
    def draw_dense(labels, areas, seed, p):
        shown = np.random.RandomState(seed).random_sample(labels.shape) < p
        return np.where(shown, np.where(labels == 1, 1, -1), 0)

    @staticmethod
    def draw_sparse(labels: SparseLabels, seed: int, p: float) -> SparseLabels:
        """`entry:P`: the dense rule draws one `random_sample([N, C])`; `random_sample` of consecutive row blocks reads
        the very same doubles in the same (row-major) order, so drawing block by block and keeping only the observed
        entries (+1 on a positive, -1 elsewhere) gives the same matrix."""
        labels = full_sparse(labels)
        rng = np.random.RandomState(seed)
        num_classes = labels.num_classes
        positive_keys = labels.keys()
        entries = _Entries()
        for start, stop in _row_blocks(labels):
            block_rows, block_classes = np.nonzero(rng.random_sample((stop - start, num_classes)) < p)
            block_rows = block_rows.astype(np.int64) + start
            keys = block_rows * num_classes + block_classes
            positive = contains(positive_keys[labels.indptr[start] : labels.indptr[stop]], keys)
            entries.add(block_rows, block_classes, np.where(positive, 1, -1))
        return entries.matrix(labels.shape)


@register
class KeepPositives(ObservationRule):
    name = "keep-pos"
    source = "positives dropped at random (a partial-positive setting; no negatives observed)"
    summary = "each positive kept with probability F, at least one per image that has one; no negatives"
    params = (_fraction("f", "F"),)
    example = "keep-pos:F"
    keeps_a_positive = "keep-pos:F"

    @staticmethod
    def draw_dense(labels, areas, seed, f):
        rng = np.random.RandomState(seed)
        positive = labels == 1
        kept = positive & (rng.random_sample(labels.shape) < f)
        for row in np.flatnonzero(positive.any(axis=1) & ~kept.any(axis=1)):  # in row order: deterministic
            kept[row, rng.choice(np.flatnonzero(positive[row]))] = True
        return kept.astype(np.int8)

    @staticmethod
    def draw_sparse(labels: SparseLabels, seed: int, f: float) -> SparseLabels:
        """`keep-pos:F`: the dense draw's `random_sample([N, C])` in row blocks (the same doubles, see `entry`), read
        at the positives only; then, in row order, one positive drawn for each row that has one but kept none."""
        labels = full_sparse(labels)
        rng = np.random.RandomState(seed)
        row_of = labels.row_of_entries()
        kept = np.zeros(labels.nnz, dtype=bool)
        for start, stop in _row_blocks(labels):
            draw = rng.random_sample((stop - start, labels.num_classes))
            low, high = labels.indptr[start], labels.indptr[stop]
            kept[low:high] = draw[row_of[low:high] - start, labels.indices[low:high]] < f
        kept_per_row = np.bincount(row_of[kept], minlength=len(labels))
        for row in np.flatnonzero((np.diff(labels.indptr) > 0) & (kept_per_row == 0)):
            low, high = labels.indptr[row], labels.indptr[row + 1]
            # the dense rule's rng.choice(its positive classes): one randint below their count, an index into them
            kept[low + rng.choice(high - low)] = True
        return labels.select(kept)


@register
class PerClass(ObservationRule):
    name = "per-class"
    source = "a per-class annotation budget (N labelled images per class and side)"
    summary = "per class, N of its positive and N of its negative images observed (all when fewer)"
    params = (Param("n", int, lambda v: v >= 0, "a whole number >= 0"),)
    per_split = True
    example = "per-class:N"

    @staticmethod
    def observes_nothing(n) -> bool:
        return n == 0

    @staticmethod
    def draw_dense(labels, areas, seed, n):
        rng = np.random.RandomState(seed)
        observed = np.zeros(labels.shape, dtype=np.int8)
        for column in range(labels.shape[1]):
            for value, mark in ((1, 1), (0, -1)):
                rows = np.flatnonzero(labels[:, column] == value)
                rng.shuffle(rows)
                observed[rows[:n], column] = mark
        return observed

    @staticmethod
    def draw_sparse(labels: SparseLabels, seed: int, n: int) -> SparseLabels:
        """`per-class:N`: class by class, the class's positive rows (from the CSR, ascending) shuffled and the first N
        kept, then its negative rows (every other row, built per class) likewise, as the dense rule does."""
        labels = full_sparse(labels)
        rng = np.random.RandomState(seed)
        order = np.argsort(labels.indices, kind="stable")  # entries class by class, rows ascending within a class
        class_rows = labels.row_of_entries()[order]
        starts = np.concatenate([[0], np.cumsum(np.bincount(labels.indices, minlength=labels.num_classes))])
        every_row = np.arange(len(labels), dtype=np.int64)
        is_positive = np.zeros(len(labels), dtype=bool)  # one class's positive rows, cleared after the class
        entries = _Entries()
        for column in range(labels.num_classes):
            positive_rows = class_rows[starts[column] : starts[column + 1]].copy()
            is_positive[positive_rows] = True
            negative_rows = every_row[~is_positive]
            is_positive[positive_rows] = False
            for chosen, mark in ((positive_rows, 1), (negative_rows, -1)):
                rng.shuffle(chosen)
                entries.add(chosen[:n], np.full(len(chosen[:n]), column), np.full(len(chosen[:n]), mark))
        return entries.matrix(labels.shape)


@register
class Largest(ObservationRule):
    name = "largest"
    source = "the deterministic extreme of the size bias of Cole, Arroyo and Perona, arXiv 2305.15584 (2023)"
    summary = "the class of the image's largest instance; no negatives"
    needs_areas = True
    why_not_sparse = NEEDS_AREAS

    @staticmethod
    def draw_dense(labels, areas, seed):
        largest = np.where(labels == 1, areas.largest, 0)
        observed = np.zeros(labels.shape, dtype=np.int8)
        rows = np.flatnonzero(largest.max(axis=1) > 0)
        observed[rows, largest[rows].argmax(axis=1)] = 1  # a tie goes to the first class
        return observed


@register
class Size(ObservationRule):
    name = "size"
    source = "Cole, Arroyo and Perona, arXiv 2305.15584 (2023), P_size; Cole et al.'s biased_labels.py"
    summary = "one positive drawn in proportion to its instances' total area; no negatives"
    needs_areas = True
    why_not_sparse = NEEDS_AREAS

    @staticmethod
    def draw_dense(labels, areas, seed):
        rng = np.random.RandomState(seed)
        weights = np.where(labels == 1, areas.total, 0).astype(np.float64)
        observed = np.zeros(labels.shape, dtype=np.int8)
        for row in np.flatnonzero(weights.sum(axis=1) > 0):
            observed[row, rng.choice(labels.shape[1], p=weights[row] / weights[row].sum())] = 1
        return observed


@register
class Given(ObservationRule):
    """On sparse labels `given` needs the dataset's sparse label mask, which `rows.draw_splits` reads directly
    (`signed_annotations`): no draw is made."""

    name = "given"
    source = "the dataset's own annotations (OpenImages' human-verified labels, a CSV's 1 / 0 cells)"
    summary = "every annotated label observed, positives and negatives; an unannotated one stays unknown"
    why_not_sparse = "observes every entry when the labels come without a sparse label mask"

    @staticmethod
    def draw_dense(labels, areas, seed):
        return 2 * labels.astype(np.int8) - 1  # draw_splits hides the unannotated entries (the dataset's mask)
