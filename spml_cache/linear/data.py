"""Stage two's data: the cache's arrays on the training device, once per run, and an observation rule's view of
them (the same features, other observed labels).

Label matrices a cache stores sparse stay `SparseLabels` (each batch's dense block is built when it is drawn);
features that do not fit the memory budget stay in the cache file (`StoredFeatures`, read a chunk at a time:
out_of_core.py). Partial labels (a cache with label masks) carry val's and test's masks, so that mAP is taken over
annotated entries (metrics.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from spml_cache.cache import FeatureSet, StoredFeatures
from spml_cache.labels import (
    SparseLabels,
    block,
    gathers_on_device,
    nonzero_count,
    observed_for_loss,
    on_device,
    positives,
    scored_classes,
)
from spml_cache.linear.out_of_core import Batch, ChunkReader, MemoryPlan, RowSource


@dataclass(frozen=True, kw_only=True)
class LinearData:
    """The cache's arrays on the training device, in the form the loop indexes directly."""

    train_features: torch.Tensor | StoredFeatures  # float32 [N, D]
    train_observed: torch.Tensor | SparseLabels  # int8 [N, C]
    train_labels: torch.Tensor | SparseLabels  # uint8 [N, C], for the oracle losses only
    eval_features: torch.Tensor | RowSource  # float32 [N_val + N_test, D]: val rows, then test rows
    num_val: int
    val_targets: torch.Tensor | SparseLabels  # [N_val, C]: full labels, or the observed positives
    test_labels: torch.Tensor | SparseLabels  # uint8 [N_test, C]
    dataset: str
    device: torch.device = torch.device("cpu")
    plan: MemoryPlan | None = None  # None: everything in memory, every class scored at once
    # Partial labels (a cache with label masks): 1 where a val / test label is annotated (dense tensors or
    # SparseLabels), and the classes each mAP averages over (those with an annotated positive); None where every
    # label is known.
    val_mask: torch.Tensor | SparseLabels | None = None
    test_mask: torch.Tensor | SparseLabels | None = None
    val_scored: np.ndarray | None = None
    test_scored: np.ndarray | None = None
    # the cache's text side, for the losses that read it: [N, C] and [N, G*G, C] image-text similarities (on the
    # host), or None
    train_similarity: torch.Tensor | None = None
    train_crop_similarity: torch.Tensor | None = None

    @classmethod
    def from_features(cls, features: FeatureSet, device: torch.device, val_labels: str = "clean",
                      plan: MemoryPlan | None = None) -> "LinearData":
        def on_device(array):
            return _on_device(array, device)

        splits = (features.val.features, features.test.features)
        if isinstance(splits[0], StoredFeatures):
            evaluated = RowSource(list(splits), device, plan.chunk_rows if plan and plan.chunk_rows else 16384)
        else:
            evaluated = on_device(np.concatenate(splits))
        val_targets = _val_targets(features.val.labels, features.val.observed, val_labels)
        val_mask = features.val.label_mask if val_labels == "clean" else None
        test_mask = features.test.label_mask
        # on the host: a loss reads them once, when it is built (the crops' [N, G*G, C] would cost device memory)
        text = {key: None if value is None else torch.from_numpy(value) for key, value in
                features.train_similarities().items()}
        return cls(
            train_features=on_device(features.train.features),
            train_observed=on_device(features.train.observed),
            train_labels=on_device(features.train.labels),
            eval_features=evaluated,
            num_val=len(features.val),
            val_targets=on_device(val_targets),
            test_labels=on_device(features.test.labels),
            dataset=features.dataset,
            device=device,
            plan=plan,
            val_mask=None if val_mask is None else on_device(val_mask),
            test_mask=None if test_mask is None else on_device(test_mask),
            val_scored=scored_classes(val_targets, val_mask),
            test_scored=scored_classes(features.test.labels, test_mask),
            **text,
        )

    def under_rule(self, train_observed, val_observed, val_labels: str = "clean") -> "LinearData":
        """The same features (not copied) with an observation rule's observed labels (observation/)."""
        targets = (self.val_targets if val_labels == "clean"
                   else _on_device(_val_targets(None, val_observed, val_labels), self.device))
        return replace(self, train_observed=_on_device(train_observed, self.device), val_targets=targets)

    @property
    def partial_test_labels(self) -> dict | None:
        """What results.json says of a partially labelled test split: how its mAP was taken; None otherwise."""
        if self.test_mask is None:
            return None
        mask = self.test_mask
        annotated = nonzero_count(mask) / float(np.prod(mask.shape))
        return {"annotated_fraction": annotated, "classes_scored": int(self.test_scored.sum()),
                "classes_left_out": int((~self.test_scored).sum()),
                "map": "per class over annotated test entries only; the mean over classes with an annotated positive"}

    @property
    def num_train(self) -> int:
        return self.train_features.shape[0]

    @property
    def num_classes(self) -> int:
        return self.train_observed.shape[1]

    @property
    def streams_train(self) -> bool:
        """The training rows are read from the cache a chunk at a time."""
        return isinstance(self.train_features, StoredFeatures)

    @property
    def scores_at_once(self) -> bool:
        """Val and test are in memory and every class is scored at once: one batched scoring, as with dense
        labels (sparse ones made dense a split at a time)."""
        return not isinstance(self.eval_features, RowSource) and self.class_block >= self.num_classes

    @property
    def dense_in_memory(self) -> bool:
        """Every array a dense tensor: what a captured CUDA graph can index (graphs.py)."""
        features_in_memory = not self.streams_train and not isinstance(self.eval_features, RowSource)
        labels = (self.train_observed, self.train_labels, self.val_targets, self.test_labels)
        return features_in_memory and all(gathers_on_device(matrix) for matrix in labels)

    @property
    def class_block(self) -> int:
        """Classes scored at once."""
        return (self.plan.class_block if self.plan else 0) or self.num_classes

    def observed_for_loss(self, whole: bool) -> torch.Tensor | None:
        """The training observed labels as a loss is built with them: int8 [N, C] on the host. Sparse ones only
        for a loss that reads the `whole` matrix (`losses.reads_whole_observed`), made dense, else None."""
        return observed_for_loss(self.train_observed, whole)

    def batch(self, rows: torch.Tensor, oracle: bool, reader: ChunkReader | None = None,
              into: Batch | None = None) -> Batch:
        """The batch of training rows `rows`: their features (read through `reader` when they stream from the
        cache) beside a ones column, and dense label blocks, gathered from tensors or built from CSR. `into`: an
        earlier batch of the same size whose tensors the gathers write into (`out=`) instead of allocating (a
        captured step replays the same addresses); it is returned when it holds the whole batch."""
        batch = into or Batch(Batch.features_buffer(len(rows), self.train_features.shape[1], self.device),
                              torch.empty(0), None)
        if reader is None:
            torch.index_select(self.train_features, 0, rows, out=batch.rows)
        else:
            reader.features(rows, out=batch.rows)
        observed = block(self.train_observed, rows, np.int8, out=into and into.observed)
        labels = block(self.train_labels, rows, np.uint8, out=into and into.labels) if oracle else None
        if observed is batch.observed and labels is batch.labels:
            return batch
        return Batch(batch.features, observed, labels)


def _on_device(array, device: torch.device):
    """A dense array as a tensor on `device`; a sparse matrix or features left in the file as they are."""
    return array if isinstance(array, StoredFeatures) else on_device(array, device)


def _val_targets(labels, observed, val_labels: str):
    """Val's targets: its full labels, or its observed positives (`--val-labels observed`)."""
    return labels if val_labels == "clean" else positives(observed)
