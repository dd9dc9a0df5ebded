"""timm models as trunks (`timm:NAME`, the pretrained tag in the name: `timm:convnext_base.fb_in22k`).

`timm.create_model(NAME, num_classes=0)` ends at the model's pooled (pre-logits) vector. Preprocessing is the
pretrained config's: input size, crop_pct, interpolation, mean and std (timm's evaluation transform). Weights:
`pretrained` (the default: the tag's weights through timm, from the Hugging Face hub cache, which
`HF_HUB_OFFLINE=1` keeps offline), a local `.pth` state dict, or `none` (random, seeded).

`--features last4` (layers.py) reads timm's `forward_intermediates`: a model with prefix tokens (a ViT) gives its
last four blocks' class tokens and its last block's mean patch token (through its final norm), any other its last
four feature stages, average-pooled; a model without intermediates, or a ViT without a class token, is refused.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import timm
import torch
from torch import nn

from spml_cache.backbones import DEFAULT_FEATURES, Description, Family, Request
from spml_cache.backbones.checkpoints import (
    WEIGHTS_NONE, RandomWeightsWarning, file_provenance, hub_fetch, read_state_dict,
)
from spml_cache.backbones.layers import LAST, no_blocks, pooled_stages, token_features
from spml_cache.backbones.preprocess import Preprocess
from spml_cache.images import IMAGENET_MEAN, IMAGENET_STD
from spml_cache.runtime.errors import SpmlError, unknown_name

PRETRAINED = "pretrained"
STRIPPED_PREFIXES = ("module.", "model.", "trunk.", "backbone.")


def _create(name: str, extra: dict, pretrained: bool = False) -> nn.Module:
    return timm.create_model(name, pretrained=pretrained, num_classes=0, **extra)


def _width(model: nn.Module) -> int:
    return int(getattr(model, "head_hidden_size", None) or model.num_features)


def describe(request: Request) -> Description:
    name, weights, resolution, features = request.name, request.weights, request.resolution, request.features
    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('.')[0][:6]}*")[:5]
        hint = f" (e.g. {', '.join(close)})" if close else ""
        raise SpmlError(f"--backbone timm:{name}: {unknown_name('backbone', name, timm.list_models())}: timm has no"
                        f" such model{hint}; timm.list_models() lists them")
    weights = weights or PRETRAINED
    source = _tagged(name, weights) or name  # `--weights TAG`: that tag's weights (and its preprocessing)
    with torch.device("meta"):
        model = _create(source, {})
    cfg = dict(model.pretrained_cfg)
    side = resolution or int(cfg["input_size"][-1])
    extra = {"img_size": side} if side != int(cfg["input_size"][-1]) and cfg.get("fixed_input_size") else {}
    if extra:
        with torch.device("meta"):
            model = _create(source, extra)
    tagged = f"{cfg.get('architecture', name)}.{cfg['tag']}" if cfg.get("tag") else name
    if weights == PRETRAINED or source != name:  # a tag, or the provenance a cache records, reads back the same
        weights, provenance = PRETRAINED, tagged
    elif weights.lower() == "none":
        provenance = "none"
    elif Path(weights).expanduser().is_file():
        provenance = file_provenance(Path(weights).expanduser())
    else:
        raise SpmlError(f"--weights {weights}: no such file, and not a pretrained tag of timm:{name}; use pretrained"
                        " (the name's tag's weights), a tag (timm.list_pretrained() lists them), none, or a .pth path")
    interpolation = cfg.get("interpolation") if cfg.get("interpolation") in ("bilinear", "bicubic") else "bicubic"
    mean, std = cfg.get("mean", IMAGENET_MEAN), cfg.get("std", IMAGENET_STD)
    if cfg.get("crop_mode") == "squash":
        preprocess = Preprocess(side, mean=tuple(mean), std=tuple(std))
    else:
        preprocess = Preprocess.crop(side, float(cfg.get("crop_pct") or 1.0), mean, std, interpolation)
    width = _width(model) if features == DEFAULT_FEATURES else _last4_width(model, f"timm:{name}")
    return Description(backbone=f"timm:{name}", family=Timm.name, weights=weights, provenance=provenance,
                       preprocess=preprocess, feature_dim=width, features=features,
                       extra={"create": extra, "source": source, "hub": cfg.get("hf_hub_id") or cfg.get("url") or name})


class TimmBlocks(nn.Module):
    """A timm model giving `last4` features through its `forward_intermediates`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model, self.tokens = model, _has_tokens(model)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if not self.tokens:
            return pooled_stages(self.model.forward_intermediates(images, indices=LAST, intermediates_only=True))
        blocks = self.model.forward_intermediates(images, indices=LAST, return_prefix_tokens=True, norm=True,
                                                  output_fmt="NLC", intermediates_only=True)
        return token_features([prefix[:, 0] for _, prefix in blocks], blocks[-1][0])  # the class token is first


def _has_tokens(model: nn.Module) -> bool:
    return getattr(model, "num_prefix_tokens", None) is not None


def _last4_width(model: nn.Module, backbone: str) -> int:
    """The width of a timm model's last4 features (refusing a model they cannot be read from)."""
    if not hasattr(model, "forward_intermediates"):
        raise no_blocks(backbone, "gives no intermediate blocks in timm (no forward_intermediates)")
    if _has_tokens(model):
        if getattr(model, "cls_token", None) is None:
            raise no_blocks(backbone, "has no class token to read from its blocks")
        return (LAST + 1) * int(model.embed_dim)
    stages = model.feature_info[-LAST:]
    if len(stages) < LAST:
        raise no_blocks(backbone, f"has {len(stages)} feature stages, fewer than {LAST}")
    return sum(int(stage["num_chs"]) for stage in stages)


def _tagged(name: str, weights: str) -> str | None:
    """The tagged timm name `weights` stands for: a tag of `name`'s architecture (`fb_in22k`), or a tagged name
    of it (`convnext_tiny.fb_in22k`, what a cache records); None otherwise."""
    architecture = name.split(".")[0]
    for candidate in (weights, f"{architecture}.{weights}"):
        if candidate.split(".")[0] == architecture and "." in candidate and candidate in timm.list_pretrained(
                f"{architecture}.*"):
            return candidate
    return None


def _load_file(model: nn.Module, path: Path, name: str) -> None:
    state = read_state_dict(path)
    for prefix in STRIPPED_PREFIXES:
        if state and all(key.startswith(prefix) for key in state):
            state = {key[len(prefix):]: value for key, value in state.items()}
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys:
        raise SpmlError(f"--weights {path}: not a timm {name} state dict ({len(result.missing_keys)} trunk tensors"
                        f" missing, e.g. {result.missing_keys[0]})")


def build(description: Description) -> nn.Module:
    model = _pooled_trunk(description)
    return model if description.features == DEFAULT_FEATURES else TimmBlocks(model)


def _pooled_trunk(description: Description) -> nn.Module:
    name, weights = description.backbone.split(":", 1)[1], description.weights
    extra = description.extra.get("create", {})
    source = description.extra.get("source", name)
    if weights.lower() == "none":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = _create(name, extra)
        warnings.warn(f"--weights none: timm:{name} is randomly initialised; its features are not pretrained",
                      RandomWeightsWarning, stacklevel=2)
        return model
    if weights == PRETRAINED:
        tried: list[str] = []
        try:
            with hub_fetch(tried):
                return _create(source, extra, pretrained=True)
        except Exception as err:  # hub errors, missing files offline, network errors: all mean "no weights here"
            cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
            raise SpmlError(
                f"timm:{name}: its pretrained weights ({description.extra.get('hub')}) are not in the hub cache"
                f" {cache} and could not be fetched{tried[0]} ({type(err).__name__}): download them once where there"
                " is a network (HF_HOME says where they go), pass --weights PATH to a local .pth,"
                f" {WEIGHTS_NONE}"
            ) from None
    model = _create(name, extra)
    _load_file(model, Path(weights).expanduser(), name)
    return model


class Timm(Family):
    """timm's models, `timm:NAME` (the pretrained tag in the name)."""

    name = "timm"
    called = "a timm model"
    library = "timm"
    describe = staticmethod(describe)
    build = staticmethod(build)
