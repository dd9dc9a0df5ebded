"""Stage three's labels: the training batches' observed (and full) label blocks, and per-class AP of a split's
scores, for a cache whose label matrices are dense arrays or CSR (`SparseLabels`, >= 1,000 classes).

Dense caches keep the path fine-tuning always had: the training labels moved whole to the device and gathered
by row, and a split's labels scored at once. Sparse ones never become a whole dense [N, C] matrix: a training
batch's block is built from the rows of the batch on the host, then moved to the device; a split is scored a
block of classes at a time, each block's labels (and label mask) built from CSR for those classes only.
"""

from __future__ import annotations

import numpy as np
import torch

from spml_cache import losses, metrics
from spml_cache.labels import columns, for_loss, is_sparse

# Entries (rows x classes) a block of sparse labels holds when a split is scored: the AP's sort buffers are a few
# int64 copies of a block, so 2^24 entries cost a few hundred MB at most, whatever the class count.
SCORED_BLOCK_ENTRIES = 1 << 24


def loss_observed(loss: str, observed) -> torch.Tensor | None:
    """The training observed labels loss `loss` is built with (`train_observed`): a sparse cache's made dense only
    for a loss that reads the whole matrix (`losses.reads_whole_observed`, as stage two), else None."""
    found = for_loss(observed, losses.reads_whole_observed(loss))
    return None if found is None else torch.from_numpy(found)


class TrainLabels:
    """The training split's observed labels (int8) and full labels (uint8: the oracle losses read them), in the
    form each batch is drawn from: device tensors of a dense cache, CSR of a sparse one."""

    def __init__(self, observed, labels, device: torch.device) -> None:
        self.device = device
        self.sparse = is_sparse(observed)
        if self.sparse:
            self.observed, self.labels = observed, labels
        else:  # as fine-tuning always did: the whole matrices on the device
            self.observed = torch.from_numpy(observed).to(device)
            self.labels = torch.from_numpy(labels).to(device)

    def batch(self, rows: torch.Tensor, index: torch.Tensor, oracle: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The observed and full labels `[B, C]` of the training rows `rows` (on the host; `index`: the same on the
        device). A dense cache gathers both (as always); a sparse one builds the observed block on the host (no
        wait for the device), and the full one for an oracle loss only (None otherwise)."""
        if not self.sparse:
            return self.observed[index], self.labels[index]
        rows = rows.numpy()
        observed = torch.from_numpy(self.observed.rows(rows, np.int8)).to(self.device)
        labels = torch.from_numpy(self.labels.rows(rows, np.uint8)).to(self.device) if oracle else None
        return observed, labels


def split_ap(scores: torch.Tensor, labels, mask=None) -> tuple[torch.Tensor, float]:
    """Per-class AP `[C]` and mAP (0..100) of `scores [N, C]` against the split's labels `[N, C]` (and label mask,
    partial labels: 1 where annotated; None where every label is known), dense or sparse. A dense matrix is scored
    at once; a sparse one a block of classes at a time (`metrics.average_precision` scores each class on its own,
    so the result is the same)."""
    if not (is_sparse(labels) or is_sparse(mask)):
        labels = torch.from_numpy(np.asarray(labels)).to(scores.device)
        mask = None if mask is None else torch.from_numpy(np.asarray(mask))
        ap = metrics.average_precision(scores, labels, mask)
        return ap, float(metrics.mean_over_classes(ap, metrics.scored_classes(labels, mask)))
    num_rows, num_classes = labels.shape
    width = max(1, SCORED_BLOCK_ENTRIES // max(num_rows, 1))
    aps, scored = [], []
    for low in range(0, num_classes, width):
        high = min(low + width, num_classes)
        block = torch.from_numpy(columns(labels, low, high))
        block_mask = None if mask is None else torch.from_numpy(columns(mask, low, high))
        aps.append(metrics.average_precision(scores[:, low:high], block, block_mask))
        if mask is not None:
            scored.append(metrics.scored_classes(block, block_mask))
    ap = torch.cat(aps)
    return ap, float(metrics.mean_over_classes(ap, torch.cat(scored) if mask is not None else None))

