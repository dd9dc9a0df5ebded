"""Every SPML loss of the papers behind one contract (spec/losses.md); a registry in the style of timm."""

from __future__ import annotations

from spml_cache.errors import SpmlError
from spml_cache.losses.base import _REGISTRY, Loss, register

# Importing a family module registers its losses; the order here is the order `names()` lists them in.
from spml_cache.losses import (  # noqa: E402,F401  (imported for registration)
    oracles,
    assume_negative,
    estimating,
    acknowledge,
    robust,
    large_loss,
    generalized,
    pairwise,
)

__all__ = ["Loss", "build", "describe", "get", "names", "register"]


def names() -> list[str]:
    """Registered loss names, in the order of spec/losses.md."""
    return list(_REGISTRY)


def get(name: str) -> type[Loss]:
    """The loss class registered as `name`; a clear error listing the valid names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise SpmlError(f"unknown loss '{name}'; valid: {', '.join(names())}") from None


def build(name: str, *, num_classes: int, num_train: int | None = None, dataset: str | None = None, **kwargs) -> Loss:
    """Build loss `name`. kwargs: `num_heads`, `train_observed`, `seed`, and any hyperparameter override."""
    return get(name)(num_classes=num_classes, num_train=num_train, dataset=dataset, **kwargs)


def describe() -> list[dict]:
    """One row per registered loss, what `spml-cache losses` prints: name, description, reference, defaults
    (a default derived at build time shows how, e.g. "1/(C-1)"), per-dataset defaults, state and flags."""
    rows = []
    for name, cls in _REGISTRY.items():
        rows.append(
            {
                "name": name,
                "description": cls.description,
                "reference": cls.reference,
                "defaults": {
                    key: cls.derived.get(key, "derived at build time") if value is None else value
                    for key, value in cls.defaults.items()
                },
                "dataset_defaults": cls.dataset_defaults,
                "state": cls.state,
                "oracle": cls.oracle,
                "needs_train_logits": cls.needs_train_logits,
                "reconstructed": cls.reconstructed,
            }
        )
    return rows
