"""Stage three's labels: the training batches' observed (and, for an oracle loss, full) label blocks, for a cache
whose label matrices are dense arrays or CSR (`labels.SparseLabels`, >= 1,000 classes).

Dense matrices are moved whole to the device once and gathered by row there; sparse ones never become a whole
dense [N, C] matrix: a batch's block is built on the host from the rows of the batch, then moved to the device
(`labels.block`). A split's AP is `labels.average_precision`, a block of classes at a time.
"""

from __future__ import annotations

import numpy as np
import torch

from spml_cache import losses
from spml_cache.labels import block, observed_for_loss, on_device


def loss_observed(loss: str, observed) -> torch.Tensor | None:
    """The training observed labels loss `loss` is built with (`train_observed`): a sparse cache's made dense only
    for a loss that reads the whole matrix (`losses.reads_whole_observed`, as stage two), else None."""
    return observed_for_loss(observed, losses.reads_whole_observed(loss))


class TrainLabels:
    """The training split's observed labels (int8) and full labels (uint8: the oracle losses read them), in the
    form each batch is drawn from (`labels.on_device`)."""

    def __init__(self, observed, labels, device: torch.device) -> None:
        self.observed, self.labels = on_device(observed, device), on_device(labels, device)

    def batch(self, rows: torch.Tensor, index: torch.Tensor, oracle: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The observed labels `[B, C]` of the training rows `rows` (on the host; `index`: the same on the device),
        and their full labels for an oracle loss (None otherwise)."""
        host_rows = rows.numpy()
        observed = block(self.observed, index, np.int8, host_rows)
        return observed, block(self.labels, index, np.uint8, host_rows) if oracle else None
