"""Stage two's data: the cache's arrays on the training device, once per run, and an observation rule's view of
them (the same features, other observed labels)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from spml_cache.cache import FeatureSet
from spml_cache.metrics import scored_classes


def _scored(labels: np.ndarray, mask: np.ndarray | None) -> np.ndarray | None:
    scored = scored_classes(labels, mask)
    return None if scored is None else scored.numpy()


@dataclass(frozen=True)
class LinearData:
    """The cache's arrays on the training device, in the form the loop indexes directly."""

    train_features: torch.Tensor  # float32 [N, D]
    train_observed: torch.Tensor  # int8 [N, C]
    train_labels: torch.Tensor  # uint8 [N, C], for the oracle losses only
    eval_features: torch.Tensor  # float32 [N_val + N_test, D]: val rows, then test rows
    num_val: int
    val_targets: torch.Tensor  # [N_val, C]: full labels, or the observed positives with --val-labels observed
    test_labels: torch.Tensor  # uint8 [N_test, C]
    dataset: str
    # Partial labels (a cache with label masks): 1 where a val / test label is annotated, and the classes each mAP
    # averages over (those with an annotated positive, metrics.scored_classes); None where every label is known.
    val_mask: torch.Tensor | None = None
    test_mask: torch.Tensor | None = None
    val_scored: np.ndarray | None = None
    test_scored: np.ndarray | None = None
    # the cache's text side, for the losses that read it: [N, C] and [N, G*G, C] image-text similarities (on the
    # host), or None
    train_similarity: torch.Tensor | None = None
    train_crop_similarity: torch.Tensor | None = None

    @classmethod
    def from_features(cls, features: FeatureSet, device: torch.device, val_labels: str = "clean") -> "LinearData":
        def on_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device)

        val = features.val.labels if val_labels == "clean" else (features.val.observed == 1).astype(np.uint8)
        val_mask = features.val.label_mask if val_labels == "clean" else None
        test_mask = features.test.label_mask
        # on the host: a loss reads them once, when it is built (the crops' [N, G*G, C] would cost device memory)
        text = {key: None if value is None else torch.from_numpy(value) for key, value in
                features.train_similarities().items()}
        return cls(
            train_features=on_device(features.train.features),
            train_observed=on_device(features.train.observed),
            train_labels=on_device(features.train.labels),
            eval_features=on_device(np.concatenate([features.val.features, features.test.features])),
            num_val=len(features.val),
            val_targets=on_device(val),
            test_labels=on_device(features.test.labels),
            dataset=features.dataset,
            val_mask=None if val_mask is None else on_device(val_mask),
            test_mask=None if test_mask is None else on_device(test_mask),
            val_scored=_scored(val, val_mask),
            test_scored=_scored(features.test.labels, test_mask),
            **text,
        )

    def under_rule(self, train_observed: np.ndarray, val_observed: np.ndarray, val_labels: str = "clean"
                   ) -> "LinearData":
        """The same features (not copied) with an observation rule's observed labels (observation.py)."""
        device = self.train_features.device
        targets = self.val_targets if val_labels == "clean" else torch.from_numpy((val_observed == 1).astype(np.uint8))
        return replace(self, train_observed=torch.from_numpy(np.ascontiguousarray(train_observed)).to(device),
                       val_targets=targets.to(device))

    @property
    def partial_test_labels(self) -> dict | None:
        """What results.json says of a partially labelled test split: how its mAP was taken; None otherwise."""
        if self.test_mask is None:
            return None
        left_out = int((~self.test_scored).sum())
        return {"annotated_fraction": float(self.test_mask.float().mean()), "classes_scored":
                int(self.test_scored.sum()), "classes_left_out": left_out,
                "map": "per class over annotated test entries only; the mean over classes with an annotated positive"}

    @property
    def num_train(self) -> int:
        return self.train_features.shape[0]

    @property
    def num_classes(self) -> int:
        return self.train_observed.shape[1]
