"""The label matrix, dense or sparse, and everything that reads it: the one seam between the two forms.

A label matrix is an [N, C] array of a split's full (0/1), observed (1 / 0 unknown / -1) or mask labels. Below a
thousand classes it is a dense numpy array; at OpenImages scale (1.7M x 9,600 is 16 GB dense, a few hundred MB
sparse) a `SparseLabels`: an int8 matrix in CSR form whose zeros are absent (full labels keep their 1s, observed
labels their 1s and -1s). The functions below take either form and answer in the same way (rows, class blocks,
counts, comparisons), so that code outside this module and `cache/` never asks which form it holds. How the cache
stores the two forms is `cache/csr.py`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spml_cache.runtime.errors import SpmlError


@dataclass(frozen=True)
class SparseLabels:
    """An int8 [N, C] label matrix in CSR form: row i's non-zero columns `indices[indptr[i]:indptr[i+1]]`
    (ascending), their values `values[...]`."""

    indptr: np.ndarray  # int64 [N + 1]
    indices: np.ndarray  # int32 [nnz]
    values: np.ndarray  # int8 [nnz]
    num_classes: int

    @classmethod
    def from_dense(cls, dense: np.ndarray, block_rows: int = 65536) -> "SparseLabels":
        dense = np.asarray(dense)
        if dense.ndim != 2:
            raise SpmlError(f"labels have shape {dense.shape}: expected [rows, classes]")
        counts, indices, values = [np.zeros(0, np.int64)], [], []
        for start in range(0, len(dense), block_rows):
            block = dense[start : start + block_rows]
            rows, cols = np.nonzero(block)
            counts.append(np.bincount(rows, minlength=len(block)).astype(np.int64))
            indices.append(cols.astype(np.int32))
            values.append(block[rows, cols].astype(np.int8))
        indptr = np.concatenate([[0], np.cumsum(np.concatenate(counts))]).astype(np.int64)
        return cls(indptr, _joined(indices, np.int32), _joined(values, np.int8), int(dense.shape[1]))

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.indptr) - 1, self.num_classes

    def __len__(self) -> int:
        return len(self.indptr) - 1

    @property
    def nnz(self) -> int:
        return len(self.indices)

    def rows(self, index, dtype=np.int8) -> np.ndarray:
        """The dense block `[len(index), C]` of the rows `index` (an int array, in any order), built now."""
        taken = self.take(np.asarray(index, dtype=np.int64).reshape(-1))
        out = np.zeros(taken.shape, dtype=dtype)
        out[taken.row_of_entries(), taken.indices] = taken.values
        return out

    def row_range(self, start: int, stop: int, dtype=np.int8) -> np.ndarray:
        """The dense block of rows `start:stop`."""
        return self.rows(np.arange(start, min(stop, len(self))), dtype)

    def columns(self, low: int, high: int, rows: int | None = None, dtype=np.uint8) -> np.ndarray:
        """The dense block `[rows or N, high - low]` of the classes `low:high` (of the first `rows` rows)."""
        rows = len(self) if rows is None else rows
        end = self.indptr[rows]
        indices, values = self.indices[:end], self.values[:end]
        keep = (indices >= low) & (indices < high)
        row_of = self.row_of_entries()[:end][keep]
        out = np.zeros((rows, high - low), dtype=dtype)
        out[row_of, indices[keep] - low] = values[keep]
        return out

    def to_dense(self, dtype=np.int8) -> np.ndarray:
        return self.row_range(0, len(self), dtype)

    def equal(self, value: int) -> "SparseLabels":
        """The 0/1 matrix of the entries equal to `value` (non-zero), still sparse."""
        matched = self.select(self.values == value)
        return SparseLabels(matched.indptr, matched.indices, np.ones(matched.nnz, np.int8), self.num_classes)

    def rows_with(self, value: int) -> np.ndarray:
        """bool [N]: the rows holding at least one entry equal to `value`."""
        return np.diff(self.equal(value).indptr) > 0

    def take(self, index) -> "SparseLabels":
        """The rows `index`, in that order, still sparse."""
        index = np.asarray(index, dtype=np.int64)
        lengths = self.indptr[index + 1] - self.indptr[index]
        positions = np.repeat(self.indptr[index], lengths) + (
            np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths))
        indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        return SparseLabels(indptr, self.indices[positions], self.values[positions], self.num_classes)

    def row_of_entries(self) -> np.ndarray:
        """int64 [nnz]: the row of each stored entry."""
        return np.repeat(np.arange(len(self), dtype=np.int64), np.diff(self.indptr))

    def keys(self) -> np.ndarray:
        """int64 [nnz]: each stored entry's flat position `row * C + class` (ascending for a canonical matrix)."""
        return self.row_of_entries() * self.num_classes + self.indices

    def select(self, keep: np.ndarray) -> "SparseLabels":
        """The stored entries where the bool [nnz] `keep` is true, still sparse."""
        kept_before = np.concatenate([[0], np.cumsum(keep, dtype=np.int64)])
        return SparseLabels(kept_before[self.indptr], self.indices[keep], self.values[keep], self.num_classes)

    def canonical(self) -> "SparseLabels":
        """The same matrix with no stored zero and each row's classes ascending (as `from_dense` makes them)."""
        matrix = self.select(self.values != 0) if (self.values == 0).any() else self
        rows = matrix.row_of_entries()
        step = np.diff(matrix.indices.astype(np.int64))
        if (step > 0).all() or ((step > 0) | (np.diff(rows) > 0)).all():
            return matrix
        order = np.lexsort((matrix.indices, rows))
        return SparseLabels(matrix.indptr, matrix.indices[order], matrix.values[order], matrix.num_classes)

    @classmethod
    def from_entries(cls, rows, classes, values, shape: tuple[int, int]) -> "SparseLabels":
        """The matrix holding `values` at (`rows`, `classes`) (each position once, in any order), CSR sorted."""
        rows, classes = np.asarray(rows, dtype=np.int64), np.asarray(classes, dtype=np.int64)
        order = np.argsort(rows * shape[1] + classes, kind="stable")
        counts = np.bincount(rows, minlength=shape[0]).astype(np.int64)
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return cls(indptr, classes[order].astype(np.int32), np.asarray(values, dtype=np.int8)[order], int(shape[1]))

    def __eq__(self, other) -> bool:
        return (isinstance(other, SparseLabels) and self.num_classes == other.num_classes
                and np.array_equal(self.indptr, other.indptr) and np.array_equal(self.indices, other.indices)
                and np.array_equal(self.values, other.values))

    __hash__ = None

    def nbytes(self) -> int:
        return self.indptr.nbytes + self.indices.nbytes + self.values.nbytes


def _joined(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


def stack(parts: list) -> SparseLabels | np.ndarray:
    """The rows of `parts` one after the other (one class count), in their form (all dense or all sparse)."""
    if not is_sparse(parts[0]):
        return np.concatenate([np.asarray(part) for part in parts])
    offsets = np.cumsum([0] + [part.nnz for part in parts[:-1]], dtype=np.int64)
    indptr = np.concatenate([[0]] + [part.indptr[1:] + offset for part, offset in zip(parts, offsets)])
    return SparseLabels(indptr.astype(np.int64), _joined([p.indices for p in parts], np.int32),
                        _joined([p.values for p in parts], np.int8), parts[0].num_classes)


def contains(known: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """bool [len(keys)]: which `keys` are among the int64 `known` (entry keys, see `keys`), by a binary search in
    the sorted `known` (np.isin argsorts both together, or builds a table as long as the key range, N x C)."""
    if len(known) == 0:
        return np.zeros(len(keys), dtype=bool)
    if (np.diff(known) < 0).any():
        known = np.sort(known)
    at = np.minimum(np.searchsorted(known, keys), len(known) - 1)
    return known[at] == keys


def is_sparse(matrix) -> bool:
    return isinstance(matrix, SparseLabels)


def dense(matrix, dtype=np.int8) -> np.ndarray:
    """A label matrix as a dense array (a sparse one built now: only where it is known to be small)."""
    return matrix.to_dense(dtype) if is_sparse(matrix) else np.asarray(matrix).astype(dtype, copy=False)


def take(matrix, rows, dtype=None):
    """The rows `rows` (indices, in that order) of a dense or sparse label matrix, in its form: a sparse one stays
    sparse (its dtype is its own); a dense one as `dtype` when given; None stays None."""
    if matrix is None:
        return None
    if is_sparse(matrix):
        return matrix.take(np.asarray(rows, dtype=np.int64))
    return matrix[rows] if dtype is None else np.asarray(matrix[rows], dtype=dtype)


def head(matrix, count: int, dtype=None):
    """The first `count` rows of a dense or sparse label matrix, in its form (all of them: the matrix itself)."""
    if matrix is None or count == len(matrix) and (dtype is None or is_sparse(matrix)):
        return matrix
    return take(matrix, np.arange(count), dtype)


def as_full(labels):
    """Full labels as the protocol keeps them: dense uint8, or sparse as they are."""
    return labels if is_sparse(labels) else np.asarray(labels, dtype=np.uint8)


def positives(observed):
    """1 where `observed` holds an observed positive, in its form (dense uint8, or sparse)."""
    return observed.equal(1) if is_sparse(observed) else (np.asarray(observed) == 1).astype(np.uint8)


def nonzero_count(matrix) -> int:
    """The non-zero entries of a label matrix: numpy, torch (any device) or sparse."""
    if is_sparse(matrix):
        return int(np.count_nonzero(matrix.values))
    if hasattr(matrix, "count_nonzero"):  # a torch tensor, counted where it lives
        return int(matrix.count_nonzero())
    return int(np.count_nonzero(matrix))


def value_count(matrix, value: int) -> int:
    """How many entries of a dense or sparse label matrix equal `value` (non-zero)."""
    return int(((matrix.values if is_sparse(matrix) else np.asarray(matrix)) == value).sum())


def columns(matrix, low: int, high: int, dtype=np.uint8, rows: int | None = None) -> np.ndarray:
    """The classes `low:high` of a dense or sparse label matrix (its first `rows` rows; None: all), as a dense block
    (of that class range only)."""
    if is_sparse(matrix):
        return matrix.columns(low, high, rows, dtype=dtype)
    return np.ascontiguousarray(np.asarray(matrix)[:rows, low:high]).astype(dtype, copy=False)


def rows_with(matrix, value: int) -> np.ndarray:
    """bool [N]: the rows of a dense or sparse label matrix holding `value` somewhere."""
    return matrix.rows_with(value) if is_sparse(matrix) else (np.asarray(matrix) == value).any(axis=1)


def for_figures(matrix) -> np.ndarray | None:
    """A label matrix as report's figures read it (`labels.npz`): a dense one as it is; None for a sparse one, which
    is never made dense for them (a cache of many classes: it would be [N, C] of them)."""
    return None if is_sparse(matrix) else np.asarray(matrix)


def to_arrays(matrix, name: str) -> dict[str, np.ndarray]:
    """A label matrix as named arrays for an .npz file (`from_arrays` reads them back): a dense one as `name`; a
    sparse one as its CSR parts, `name_csr_indptr`, `_indices`, `_values`, `_classes` (never made dense)."""
    if not is_sparse(matrix):
        return {name: np.asarray(matrix)}
    return {f"{name}_csr_indptr": matrix.indptr, f"{name}_csr_indices": matrix.indices,
            f"{name}_csr_values": matrix.values, f"{name}_csr_classes": np.array(matrix.num_classes, np.int64)}


def from_arrays(arrays, name: str):
    """The label matrix `to_arrays` wrote as `name` into `arrays` (an open .npz file), in its form; else None."""
    if name in arrays or f"{name}_csr_indptr" not in arrays:
        return np.asarray(arrays[name]) if name in arrays else None
    parts = [np.asarray(arrays[f"{name}_csr_{part}"], dtype) for part, dtype in
             (("indptr", np.int64), ("indices", np.int32), ("values", np.int8))]
    return SparseLabels(*parts, int(arrays[f"{name}_csr_classes"]))


def hide_unannotated(observed, mask):
    """`observed` with every unannotated entry (mask 0) unknown: a rule never observes a label nobody annotated
    (its 0 is not a known negative). Sparse observed labels stay sparse (a sparse mask is never made dense)."""
    if mask is None:
        return observed
    if not is_sparse(observed):
        return np.where(dense(mask) != 0, observed, 0).astype(np.int8)
    if is_sparse(mask):
        annotated = contains(mask.keys()[mask.values != 0], observed.keys())
    else:
        annotated = np.asarray(mask)[observed.row_of_entries(), observed.indices] != 0
    return observed.select(annotated)


def same(first, second) -> bool:
    """Whether two label matrices, each dense or sparse, hold the same values (a dense one made CSR to compare)."""
    if not (is_sparse(first) or is_sparse(second)):
        return np.array_equal(first, second)
    first, second = (m if is_sparse(m) else SparseLabels.from_dense(m) for m in (first, second))
    return first == second


def count_positive(matrix, mask=None) -> int:
    """How many entries of a dense or sparse label matrix are positive (> 0); with a `mask` (partial labels, the
    same form: non-zero where annotated), the annotated ones only."""
    if mask is None:
        return int((matrix.values > 0).sum()) if is_sparse(matrix) else int((np.asarray(matrix) > 0).sum())
    if is_sparse(matrix) and is_sparse(mask):
        return int(contains(mask.keys()[mask.values != 0], matrix.keys()[matrix.values > 0]).sum())
    return int(((dense(matrix) > 0) & (dense(mask) != 0)).sum())


def signed_annotations(labels, mask):
    """The annotated entries of `mask`, +1 where `labels` holds a positive and -1 elsewhere, 0 where unannotated:
    every annotated label observed (the `given` observation rule), in the labels' form (sparse stays sparse)."""
    if not (is_sparse(labels) and is_sparse(mask)):
        return hide_unannotated(2 * dense(labels, np.int8) - 1, mask)
    signs = np.where(contains(labels.keys()[labels.values > 0], mask.keys()), 1, -1).astype(np.int8)
    return SparseLabels(mask.indptr.copy(), mask.indices.copy(), signs, mask.num_classes)


# --- on the training device (torch, imported when first needed: the protocol's users do without it) -----------

# Entries (rows x classes) of one class block when a split is scored: the AP's sort buffers are a few int64 copies
# of a block, so 2^24 entries cost a few hundred MB at most, whatever the class count.
SCORED_BLOCK_ENTRIES = 1 << 24


def on_device(matrix, device):
    """A dense label matrix as a tensor on `device` (gathered from by `block`); a sparse one stays on the host."""
    import torch

    if is_sparse(matrix) or isinstance(matrix, torch.Tensor) and matrix.device == torch.device(device):
        return matrix
    return torch.as_tensor(np.ascontiguousarray(matrix)).to(device)


def gathers_on_device(matrix) -> bool:
    """Whether `block` gathers this matrix's rows on the device (an `on_device` tensor), not from a sparse one."""
    import torch

    return isinstance(matrix, torch.Tensor)


def block(matrix, rows, dtype, host_rows: np.ndarray | None = None, out=None):
    """The dense `[B, C]` label block of `rows` (a tensor on the training device): gathered there from an
    `on_device` tensor (into `out` when given), or built on the host from a sparse matrix (from `host_rows` when the
    caller has them, so as not to wait for the device) and moved to the device (a new tensor, whatever `out`)."""
    import torch

    if gathers_on_device(matrix):
        return matrix.index_select(0, rows) if out is None else torch.index_select(matrix, 0, rows, out=out)
    wanted = host_rows if host_rows is not None else rows.cpu().numpy()
    return torch.from_numpy(matrix.rows(np.asarray(wanted), dtype)).to(rows.device)


def observed_for_loss(observed, whole: bool):
    """The training observed labels a loss is built with (`train_observed`), a tensor on the host: a dense matrix
    as it is; a sparse one made dense only for a loss that reads the `whole` matrix (per-example state, [N, C]
    anyway), else None."""
    import torch

    if is_sparse(observed):
        return torch.from_numpy(observed.to_dense(np.int8)) if whole else None
    return observed.cpu() if isinstance(observed, torch.Tensor) else torch.from_numpy(np.asarray(observed))


def class_blocks(matrix) -> list[tuple[int, int]]:
    """The class ranges `(low, high)` a split of this label matrix is scored in (SCORED_BLOCK_ENTRIES each at most):
    `columns(matrix, low, high)` is then a bounded dense block, whatever the form and the class count."""
    width = max(1, SCORED_BLOCK_ENTRIES // max(len(matrix), 1))
    return [(low, min(low + width, matrix.shape[1])) for low in range(0, matrix.shape[1], width)]


def tensor_columns(matrix, low: int, high: int, device, rows: int | None = None):
    """The classes `low:high` of the first `rows` rows (None: all) as a tensor on `device`: sliced from a tensor (a
    view, where it is on `device` already), built from a numpy or sparse matrix."""
    import torch

    if isinstance(matrix, torch.Tensor):
        return matrix[:rows, low:high].to(device)
    return torch.from_numpy(columns(matrix, low, high, rows=rows)).to(device)


def decision_counts(predicted, labels, mask=None):
    """`metrics.decision_counts` (`[..., 3, C]`) of bool `predicted [..., N, C]` against a split's labels and mask,
    dense (numpy, tensor) or sparse, a block of classes at a time (each class counted alone: the same counts)."""
    import torch

    from spml_cache import metrics

    parts = []
    for low, high in class_blocks(labels):
        labelled = tensor_columns(labels, low, high, predicted.device)
        annotated = None if mask is None else tensor_columns(mask, low, high, predicted.device)
        parts.append(metrics.decision_counts(predicted[..., low:high], labelled, annotated))
    return torch.cat(parts, dim=-1)


def scored_classes(labels, mask) -> np.ndarray | None:
    """bool [C]: the classes with an annotated positive (`metrics.scored_classes`), a block of classes at a time;
    None without a mask (every class is scored)."""
    if mask is None:
        return None
    return np.concatenate([((columns(labels, low, high) > 0) & (columns(mask, low, high) > 0)).any(axis=0)
                           for low, high in class_blocks(labels)])


def average_precision(scores, labels, mask=None, points=None):
    """Per-class AP `[C]` and mAP (0..100) of `scores [N, C]` against a split's labels (and label mask, partial
    labels: 1 where annotated; None where every label is known), dense or sparse, a block of classes at a time
    (`metrics.average_precision` scores each class on its own, so the result does not depend on the blocks);
    `points=11`: VOC 2007's interpolated AP."""
    import torch

    from spml_cache import metrics

    aps, scored = [], []
    for low, high in class_blocks(labels):
        labelled = tensor_columns(labels, low, high, scores.device)
        annotated = None if mask is None else tensor_columns(mask, low, high, scores.device)
        aps.append(metrics.average_precision(scores[:, low:high], labelled, annotated, points))
        if mask is not None:
            scored.append(metrics.scored_classes(labelled, annotated))
    ap = torch.cat(aps)
    return ap, float(metrics.mean_over_classes(ap, torch.cat(scored) if mask is not None else None))
