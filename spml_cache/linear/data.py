"""Stage two's data: the cache's arrays on the training device, once per run, and an observation rule's view of
them (the same features, other observed labels)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from spml_cache.cache import FeatureSet


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
    # the cache's text side, for the losses that read it: [N, C] and [N, G*G, C] image-text similarities (on the
    # host), or None
    train_similarity: torch.Tensor | None = None
    train_crop_similarity: torch.Tensor | None = None

    @classmethod
    def from_features(cls, features: FeatureSet, device: torch.device, val_labels: str = "clean") -> "LinearData":
        def on_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device)

        val = features.val.labels if val_labels == "clean" else (features.val.observed == 1).astype(np.uint8)
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
    def num_train(self) -> int:
        return self.train_features.shape[0]

    @property
    def num_classes(self) -> int:
        return self.train_observed.shape[1]
