"""Label matrices in the HDF5 cache: dense datasets, or CSR groups for caches of many classes.

A `labels.SparseLabels` is stored as a group `/{split}/<name>` with the datasets `indptr` (int64 [N+1]), `indices`
(int32 [nnz]) and `values` (int8 [nnz]) and the attrs format="csr" and shape=[N, C], in place of the dense
dataset; any other [N, C] matrix (a test-label mask) can be stored the same way. Dense stays the default below
`SPARSE_MIN_CLASSES` classes (VOC, COCO, NUS-WIDE and CUB caches do not change).
"""

from __future__ import annotations

import h5py
import numpy as np

from spml_cache.cache.schema import plain
from spml_cache.labels import SparseLabels, dense, is_sparse
from spml_cache.runtime.errors import SpmlError

SPARSE_MIN_CLASSES = 1000  # `extract --labels auto` stores label matrices of this many classes or more as CSR
LABEL_FORMATS = ("auto", "dense", "sparse")
DEFAULT_FORMAT = "auto"


def format_of(matrix) -> str:
    """How a label matrix read from a cache was stored there: "dense" or "sparse" (the words of `--labels`)."""
    return "sparse" if is_sparse(matrix) else "dense"


def resolve_format(choice: str, num_classes: int, flag: str = "--labels") -> str:
    """`--labels auto|dense|sparse` for a dataset of `num_classes` classes: dense or sparse."""
    if not isinstance(choice, str) or choice not in LABEL_FORMATS:
        raise SpmlError(f"{flag} {choice!r}: use auto (sparse from {SPARSE_MIN_CLASSES} classes), dense or sparse")
    if choice == "auto":
        return "sparse" if num_classes >= SPARSE_MIN_CLASSES else "dense"
    return choice


def store(group: h5py.Group, name: str, matrix, sparse: bool, dtype) -> None:
    """Write a label matrix (dense or SparseLabels) as `group[name]`: a dense dataset, or the CSR group."""
    if not sparse:
        group.create_dataset(name, data=dense(matrix, dtype))
        return
    matrix = matrix if is_sparse(matrix) else SparseLabels.from_dense(matrix)
    csr = group.create_group(name)
    csr.attrs["format"], csr.attrs["shape"] = "csr", list(matrix.shape)
    csr.create_dataset("indptr", data=matrix.indptr.astype(np.int64))
    csr.create_dataset("indices", data=matrix.indices.astype(np.int32))
    csr.create_dataset("values", data=matrix.values.astype(np.int8))


def stored_sparse(node) -> bool:
    """Whether a stored label matrix is the CSR group (else a dense dataset); a group of another format is refused
    in one line (no reader could index it)."""
    if not isinstance(node, h5py.Group):
        return False
    found = node.attrs.get("format")
    if found not in ("csr", b"csr"):
        raise SpmlError(f"{node.file.filename}: {node.name} is a group with format {plain(found)!r}, not a CSR"
                        " matrix (format \"csr\") nor a dataset: rebuild the cache (extract --force)")
    return True


def stored_shape(node) -> tuple[int, ...]:
    """The shape of a stored label matrix, dense or CSR, without reading it."""
    return tuple(int(v) for v in node.attrs["shape"]) if stored_sparse(node) else tuple(node.shape)


def read(node, dtype):
    """A stored label matrix: a numpy array (dense) or a SparseLabels (CSR), checked for a consistent CSR."""
    if not stored_sparse(node):
        return node[...].astype(dtype, copy=False)
    rows, columns = stored_shape(node)
    matrix = SparseLabels(node["indptr"][...].astype(np.int64), node["indices"][...].astype(np.int32),
                          node["values"][...].astype(np.int8), columns)
    nnz = len(matrix.indices)
    if (len(matrix.indptr) != rows + 1 or matrix.indptr[0] != 0 or matrix.indptr[-1] != nnz
            or len(matrix.values) != nnz or (np.diff(matrix.indptr) < 0).any()
            or (nnz and (matrix.indices.min() < 0 or matrix.indices.max() >= columns))):
        raise SpmlError(f"{node.file.filename}: {node.name} is not a consistent CSR matrix of shape {[rows, columns]};"
                        " rebuild the cache (extract --force)")
    row = unordered_row(matrix)
    if row is not None:
        raise SpmlError(f"{node.file.filename}: {node.name} is not a consistent CSR matrix: row {row} holds a class"
                        " twice or out of ascending order; rebuild the cache (extract --force)")
    return matrix


def unordered_row(matrix: SparseLabels) -> int | None:
    """The first row whose stored classes are not strictly ascending (a class twice, or out of order), or None:
    every reader (`rows`, `columns`, `keys`, the content hash) takes a row's classes as a sorted set."""
    within = np.diff(matrix.indices) <= 0  # entry k+1 not after entry k ...
    starts = matrix.indptr[1:-1]
    within[starts[(starts > 0) & (starts < matrix.nnz)] - 1] = False  # ... unless k+1 starts the next row
    bad = np.flatnonzero(within)
    return int(np.searchsorted(matrix.indptr, bad[0], side="right") - 1) if len(bad) else None
