"""The observation rules' draws on sparse full labels (`SparseLabels`, datasets of many classes), never an [N, C]
matrix: each gives, entry for entry, the CSR form of its dense draw in observation.py (the same seed, the same
random stream consumed in the same order), so a cache gives the same observed labels stored sparse or dense.

The rules that need instance areas (`largest`, `size`) have no sparse draw: a sparse dataset never stores areas.
"""

from __future__ import annotations

import numpy as np

from spml_cache.cache import sparse
from spml_cache.cache.sparse import SparseLabels
from spml_cache.errors import SpmlError
from spml_cache.protocol import full_sparse, observe_labels

BLOCK_ENTRIES = 1 << 22  # random doubles drawn at a time (32 MB): `entry` and `keep-pos` draw in row blocks


def check(rule, flag: str) -> None:
    """Refuse, in one line, a rule (observation.Rule) with no sparse draw: areas, or `given` without a sparse mask."""
    if rule.entry.sparse_draw is None:
        why = ("needs instance areas, which a dataset of sparse labels never stores" if rule.entry.needs_areas
               else "observes every entry when the labels come without a sparse label mask")
        raise SpmlError(f"{flag} {rule}: this cache stores its labels sparse (many classes), and {rule.name} {why}:"
                        f" use {flag} single, uniform, entry, keep-pos or per-class (or given with a label mask)")


def single(labels: SparseLabels, seed: int) -> SparseLabels:
    return observe_labels(labels, num_pos=1, num_neg=0, seed=seed)


def uniform(labels: SparseLabels, seed: int, pos: int, neg: int) -> SparseLabels:
    return observe_labels(labels, num_pos=pos, num_neg=neg, seed=seed)


def _row_blocks(labels: SparseLabels):
    """(start, stop) of consecutive row blocks of about BLOCK_ENTRIES entries."""
    step = max(1, BLOCK_ENTRIES // max(labels.num_classes, 1))
    return [(start, min(start + step, len(labels))) for start in range(0, len(labels), step)]


def entry(labels: SparseLabels, seed: int, p: float) -> SparseLabels:
    """`entry:P`: the dense rule draws one `random_sample([N, C])`; `random_sample` of consecutive row blocks reads
    the very same doubles in the same (row-major) order, so drawing block by block and keeping only the observed
    entries (+1 on a positive, -1 elsewhere) gives the same matrix."""
    labels = full_sparse(labels)
    rng = np.random.RandomState(seed)
    num_classes = labels.num_classes
    positive_keys = labels.keys()
    rows, classes, values = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int8)]
    for start, stop in _row_blocks(labels):
        block_rows, block_classes = np.nonzero(rng.random_sample((stop - start, num_classes)) < p)
        block_rows = block_rows.astype(np.int64) + start
        keys = block_rows * num_classes + block_classes
        positive = sparse.contains(positive_keys[labels.indptr[start] : labels.indptr[stop]], keys)
        rows.append(block_rows)
        classes.append(block_classes.astype(np.int64))
        values.append(np.where(positive, 1, -1).astype(np.int8))
    return SparseLabels.from_entries(np.concatenate(rows), np.concatenate(classes), np.concatenate(values),
                                     labels.shape)


def keep_positives(labels: SparseLabels, seed: int, f: float) -> SparseLabels:
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


def per_class(labels: SparseLabels, seed: int, n: int) -> SparseLabels:
    """`per-class:N`: class by class, the class's positive rows (from the CSR, ascending) shuffled and the first N
    kept, then its negative rows (every other row, built per class) likewise, as the dense rule does."""
    labels = full_sparse(labels)
    rng = np.random.RandomState(seed)
    order = np.argsort(labels.indices, kind="stable")  # entries class by class, rows ascending within a class
    class_rows = labels.row_of_entries()[order]
    starts = np.concatenate([[0], np.cumsum(np.bincount(labels.indices, minlength=labels.num_classes))])
    every_row = np.arange(len(labels), dtype=np.int64)
    is_positive = np.zeros(len(labels), dtype=bool)  # one class's positive rows, cleared after the class
    rows, classes, values = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int8)]
    for column in range(labels.num_classes):
        positive_rows = class_rows[starts[column] : starts[column + 1]].copy()
        is_positive[positive_rows] = True
        negative_rows = every_row[~is_positive]
        is_positive[positive_rows] = False
        for chosen, mark in ((positive_rows, 1), (negative_rows, -1)):
            rng.shuffle(chosen)
            rows.append(chosen[:n])
            classes.append(np.full(len(chosen[:n]), column, np.int64))
            values.append(np.full(len(chosen[:n]), mark, np.int8))
    return SparseLabels.from_entries(np.concatenate(rows), np.concatenate(classes), np.concatenate(values),
                                     labels.shape)
