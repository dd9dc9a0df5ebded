"""ResNet-50, the papers' backbone: the torchvision model up to and including global average pooling (a normalised
`[B, 3, R, R]` batch -> `[B, 2048]`), its ImageNet weights by name (`IMAGENET1K_V1`, the papers'
`pretrained=True`, or `IMAGENET1K_V2`), a local `.pth` (a full ResNet-50 or its trunk, under any wrapper's
prefix), or `none` (random, seeded). The registry's `resnet50` entry (torchvision_models.py) builds it here."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torchvision
from torch import nn

from spml_cache.backbones.checkpoints import RandomWeightsWarning, fetch_checkpoint, file_provenance, read_state_dict
from spml_cache.runtime.errors import SpmlError

FEATURE_DIM = 2048
WEIGHT_NAMES = ("IMAGENET1K_V1", "IMAGENET1K_V2")


def _resnet50_without_fc() -> nn.Module:
    model = torchvision.models.resnet50(weights=None)
    model.fc = nn.Identity()  # the trunk ends at the pooled, flattened 2048-d vector
    return model


def checkpoint_path(name: str) -> Path:
    """Where torch keeps the cached file of an enum weight (`$TORCH_HOME/hub/checkpoints/...`)."""
    url = torchvision.models.ResNet50_Weights[name].url
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)


def _weights_name(weights: str) -> str | None:
    """The canonical enum name (`IMAGENET1K_V1`, `IMAGENET1K_V2`), `"none"`, or None for a file path."""
    if weights.lower() == "none":
        return "none"
    for name in WEIGHT_NAMES:
        if weights.upper() == name:
            return name
    return None


def weights_provenance(weights: str) -> str:
    """What the cache records as `weights`: the enum name, `sha256:<hex>` of a local file, or `none`.

    Cheap enough to compare settings before any network or model work happens.
    """
    name = _weights_name(weights)
    if name is not None:
        return name
    path = Path(weights)
    if not path.is_file():
        raise SpmlError(
            f"--weights {weights}: no such file; pass IMAGENET1K_V1, IMAGENET1K_V2, none, or a path to a ResNet-50 .pth"
        )
    return file_provenance(path)


def _fetch_enum_weights(name: str) -> Path:
    """The cached file of an enum weight, downloading it only when absent and failing fast when offline."""
    return fetch_checkpoint(torchvision.models.ResNet50_Weights[name].url, f"ImageNet weights {name}",
                            "or pass --weights PATH to a local ResNet-50 .pth")


def _match_trunk_keys(state: dict[str, torch.Tensor], trunk: nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors renamed to the trunk's keys; a file that is not a ResNet-50 state dict is an error.

    A prefix (`module.` of DDP, `trunk.` or `backbone.` of a wrapper) is found from where `conv1.weight` sits.
    """
    stems = [key[: -len("conv1.weight")] for key in state if key.endswith("conv1.weight") and "layer" not in key]
    prefix = stems[0] if len(stems) == 1 else ""
    renamed = {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}
    expected = {key: value for key, value in trunk.state_dict().items() if not key.endswith("num_batches_tracked")}
    missing = [key for key in expected if key not in renamed]
    if missing:
        shown = ", ".join(missing[:3]) + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else "")
        raise SpmlError(
            f"--weights {path}: not a ResNet-50 state dict: {len(missing)} of {len(expected)} trunk tensors"
            f" are missing ({shown})"
        )
    wrong = [key for key in expected if key in renamed and renamed[key].shape != expected[key].shape]
    if wrong:
        key = wrong[0]
        raise SpmlError(
            f"--weights {path}: not a ResNet-50 state dict: {key} has shape {tuple(renamed[key].shape)},"
            f" ResNet-50 has {tuple(expected[key].shape)} ({len(wrong)} tensor(s) differ)"
        )
    ignored = ("fc.", "num_batches_tracked")  # the classifier, and a counter that changes no output
    unexpected = [key for key in renamed if key not in expected and not any(part in key for part in ignored)]
    if unexpected:
        warnings.warn(
            f"--weights {path}: ignoring {len(unexpected)} tensor(s) a ResNet-50 trunk does not have"
            f" ({', '.join(unexpected[:3])})",
            stacklevel=3,
        )
    # Old checkpoints lack BatchNorm's num_batches_tracked; it does not affect the outputs.
    return {
        key: renamed[key].to(value.dtype) if key in renamed else torch.zeros((), dtype=value.dtype)
        for key, value in trunk.state_dict().items()
    }


def build_trunk(weights: str = "IMAGENET1K_V1") -> tuple[nn.Module, str]:
    """ResNet-50 up to and including global average pooling, and the weights' provenance string.

    `weights`: `IMAGENET1K_V1` (the papers' `pretrained=True`), `IMAGENET1K_V2`, a path to a `.pth` state
    dict (a full ResNet-50 or its trunk; loaded with `weights_only=True`), or `none` (random init, seeded).
    Returned in train mode with gradients on; callers that only extract freeze it.
    """
    name = _weights_name(weights)
    if name == "none":
        # Seeded, so that a resumed extraction continues with the same network (for a given torch version).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            trunk = _resnet50_without_fc()
        warnings.warn(
            "--weights none: the ResNet-50 is randomly initialised; its features are not ImageNet features",
            RandomWeightsWarning,
            stacklevel=2,
        )
        return trunk, "none"
    if name is not None:
        path = _fetch_enum_weights(name)
        provenance = name
    else:
        provenance = weights_provenance(weights)
        path = Path(weights)
    with torch.device("meta"):  # no random init (half a second) for weights that replace it anyway
        trunk = _resnet50_without_fc()
    trunk.load_state_dict(_match_trunk_keys(read_state_dict(path), trunk, path), assign=True)
    return trunk, provenance
