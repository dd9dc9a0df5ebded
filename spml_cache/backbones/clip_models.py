"""open_clip models as trunks (`clip:ARCH/TAG`, e.g. `clip:ViT-B-16/openai`), and their text side.

The trunk's output row is the features, then the image embedding L2-normalised: the features are CLIP's image
embedding itself (`post`, after the projection: what its README's code uses), or the pooled vector before the
projection (`pre`: what the CLIP paper's linear probes use; ViT towers only). Preprocessing is the pretrained
config's (open_clip's evaluation transform: shorter side to the input size, bicubic, centre crop, CLIP's mean and
std). Weights: the tag (default: the one in the name; open_clip fetches it into the Hugging Face hub cache, which
`HF_HUB_OFFLINE=1` keeps offline), a local checkpoint file, or `none` (random, seeded).

`--features last4` (layers.py, ViT towers of four blocks or more): the last four blocks' class tokens and the
last block's mean patch token, each through the tower's final LayerNorm and, with `--clip-features post`, its
projection (5 x the embedding width; `pre`: 5 x the tower's width). The image embedding is the tower's own, as
with `pooled`.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
import os
import warnings
from pathlib import Path

import numpy as np
import open_clip
import torch
import torch.nn.functional as F
from torch import nn

from spml_cache.backbones import DEFAULT_FEATURES, Description, Family, Request
from spml_cache.backbones.checkpoints import WEIGHTS_NONE, RandomWeightsWarning, file_provenance, hub_fetch
from spml_cache.backbones.layers import LAST, no_blocks, token_features
from spml_cache.backbones.preprocess import Preprocess
from spml_cache.runtime.errors import SpmlError, unknown_name

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def _split(rest: str) -> tuple[str, str]:
    arch, _, tag = rest.partition("/")
    if arch not in open_clip.list_models():
        close = [m for m in open_clip.list_models() if m.lower().startswith(arch[:5].lower())][:5]
        raise SpmlError(f"--backbone clip:{rest}: {unknown_name('backbone', arch, open_clip.list_models())}: open_clip"
                        " has no such model"
                        + (f" (e.g. {', '.join(close)})" if close else "") + "; open_clip.list_models() lists them")
    return arch, tag


def _side(size) -> int:
    return int(size if isinstance(size, int) else size[-1])


def describe(request: Request) -> Description:
    rest, weights, resolution, features = request.name, request.weights, request.resolution, request.features
    clip_features, crops = request.clip_features, request.crops
    arch, tag = _split(rest)
    tags = open_clip.list_pretrained_tags_by_model(arch)
    weights = weights or tag
    if not weights:
        raise SpmlError(f"--backbone clip:{arch}: name its pretrained tag, clip:{arch}/TAG ({', '.join(tags[:4])}"
                        " ...), or pass --weights PATH or --weights none")
    if weights in tags:
        provenance = weights
    elif weights.lower() == "none":
        provenance = "none"
    elif Path(weights).expanduser().is_file():
        provenance = file_provenance(Path(weights).expanduser())
    else:
        raise SpmlError(f"--weights {weights}: no such file, and not a tag of {arch} ({', '.join(tags[:6]) or 'none'}"
                        "); pass a tag, a checkpoint path or none")
    config = open_clip.get_model_config(arch)
    vision = config["vision_cfg"]
    is_vit = "timm_model_name" not in vision and isinstance(vision.get("layers"), int)
    if clip_features == "pre" and not is_vit:
        raise SpmlError(f"--clip-features pre: {arch}'s image tower has no separate projection here (ViT towers"
                        " only); use --clip-features post")
    native = _side(vision.get("image_size", 224))
    side = resolution or native
    pretrained_cfg = open_clip.get_pretrained_cfg(arch, weights) if weights in tags else {}
    cfg = {**config.get("preprocess_cfg", {}), **pretrained_cfg}
    mean, std = tuple(cfg.get("mean") or OPENAI_MEAN), tuple(cfg.get("std") or OPENAI_STD)
    interpolation = cfg.get("interpolation") if cfg.get("interpolation") in ("bilinear", "bicubic") else "bicubic"
    loaded = side * max(crops, 1)  # with crops: the image at G x R, cut into G x G crops of R by the trunk
    if cfg.get("resize_mode") == "squash":
        preprocess = Preprocess(loaded, mean=mean, std=std)
    else:
        preprocess = Preprocess.crop(loaded, 1.0, mean, std, interpolation)
    embed = int(config["embed_dim"])
    width = int(vision["width"]) if clip_features == "pre" else embed
    if features != DEFAULT_FEATURES:
        if not is_vit or int(vision["layers"]) < LAST:
            why = f"has {vision['layers']} blocks, fewer than {LAST}" if is_vit else "has no ViT image tower"
            raise no_blocks(f"clip:{rest}", why)
        width *= LAST + 1
    extra = {"arch": arch, "force_image_size": side if side != native else None}
    return Description(backbone=f"clip:{rest}", family=Clip.name, weights=weights, provenance=provenance,
                       preprocess=preprocess, feature_dim=width, embed_dim=embed, clip_features=clip_features,
                       grid=crops, features=features, extra=extra)


class ClipTrunk(nn.Module):
    """CLIP's image tower giving rows of [features, normalised embedding] and, with a `grid` G, the normalised
    embeddings of the G x G crops of its input (a G x R square: the whole image is that square resized to R);
    `class_embeddings` is its text side."""

    def __init__(self, model: nn.Module, arch: str, pre: bool, grid: int = 0, last4: bool = False) -> None:
        super().__init__()
        self.model, self.arch, self.grid, self.last4 = model, arch, grid, last4
        self.proj = None
        if pre:  # the tower stops before its projection; the projection is applied here for the embedding
            self.proj = model.visual.proj
            model.visual.proj = None

    def _embed(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.model.visual(images)
        embedding = pooled @ self.proj if self.proj is not None else pooled
        return pooled, F.normalize(embedding.float(), dim=-1).to(pooled.dtype)

    def _whole(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The features and the normalised embedding of whole images (`_embed`, or with `last4` the blocks')."""
        if not self.last4:
            return self._embed(images)
        visual = self.model.visual
        out = visual.forward_intermediates(images, indices=LAST, normalize_intermediates=True, output_fmt="NLC",
                                           output_extra_tokens=True)
        pooled = out["image_features"]  # the tower's own output: after the projection unless `pre` took it
        embedding = pooled @ self.proj if self.proj is not None else pooled
        features = token_features([prefix[:, 0] for prefix in out["image_intermediates_prefix"]],
                                  out["image_intermediates"][-1])
        if visual.proj is not None:  # post: each of the five vectors through the projection
            features = (features.view(len(images), LAST + 1, -1) @ visual.proj).flatten(1)
        return features, F.normalize(embedding.float(), dim=-1).to(pooled.dtype)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if not self.grid:
            return torch.cat(self._whole(images), dim=1)
        count, grid, side = len(images), self.grid, images.shape[-1] // self.grid
        whole = F.interpolate(images, size=(side, side), mode="bilinear", antialias=True, align_corners=False)
        crops = images.reshape(count, 3, grid, side, grid, side).permute(0, 2, 4, 1, 3, 5)  # row-major crops
        crops = crops.reshape(count * grid * grid, 3, side, side).contiguous(memory_format=torch.channels_last)
        _, crop_embeddings = self._embed(crops)
        return torch.cat([*self._whole(whole), crop_embeddings.reshape(count, -1)], dim=1)

    @torch.inference_mode()
    def class_embeddings(self, prompts: list[list[str]]) -> np.ndarray:
        """float32 [C, E]: per class, its prompts' text embeddings each normalised, averaged, normalised again
        (CLIP's prompt ensembling)."""
        tokenizer = open_clip.get_tokenizer(self.arch)
        device = next(self.model.parameters()).device
        rows = []
        with torch.autocast(device.type, enabled=False):
            for texts in prompts:
                encoded = self.model.encode_text(tokenizer(texts).to(device)).float()
                rows.append(F.normalize(F.normalize(encoded, dim=-1).mean(0), dim=0))
        return torch.stack(rows).cpu().numpy().astype(np.float32)


@contextmanager
def _quiet():
    """open_clip logs on the root logger (a random init, a failed download): quiet while it builds."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        root.setLevel(level)


def build(description: Description) -> nn.Module:
    arch, weights = description.extra["arch"], description.weights
    options = {"force_image_size": description.extra.get("force_image_size")}
    pre = description.clip_features == "pre"
    if weights.lower() == "none":
        with _quiet(), torch.random.fork_rng(devices=[]):  # open_clip logs "initialized randomly": we warn below
            torch.manual_seed(0)
            model = open_clip.create_model(arch, pretrained=None, **options)
        warnings.warn(f"--weights none: clip:{arch} is randomly initialised; its features are not CLIP's",
                      RandomWeightsWarning, stacklevel=2)
        return ClipTrunk(model, arch, pre, description.grid, description.features != DEFAULT_FEATURES)
    source = str(Path(weights).expanduser()) if Path(weights).expanduser().is_file() else weights
    tried: list[str] = []
    try:
        with _quiet(), hub_fetch(tried):  # its own log lines, and the hub's, would come before our one line
            model = open_clip.create_model(arch, pretrained=source, require_pretrained=True, **options)
    except Exception as err:  # hub, network, file format errors: all mean "these weights cannot be loaded"
        if source != weights:
            raise SpmlError(f"--weights {weights}: not an open_clip checkpoint for {arch} ({type(err).__name__}:"
                            f" {str(err).splitlines()[0][:160] if str(err) else ''})") from None
        cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
        hub = (open_clip.get_pretrained_cfg(arch, weights) or {}).get("hf_hub") or "its hub repository"
        raise SpmlError(f"clip:{arch}/{weights}: the pretrained weights ({hub.rstrip('/')}) are not in the hub cache"
                        f" {cache} and could not be fetched{tried[0]} ({type(err).__name__}): download them once where there is a"
                        " network (HF_HOME says where they go), pass --weights PATH to a local checkpoint,"
                        f" {WEIGHTS_NONE}") from None
    return ClipTrunk(model, arch, pre, description.grid, description.features != DEFAULT_FEATURES)


class Clip(Family):
    """open_clip's image towers, `clip:ARCH/TAG`, with their text side; never fine-tuned here."""

    name = "clip"
    called = "a CLIP image tower"
    library = "open_clip"
    takes = ("crops", "clip_features")
    fine_tunes = False
    describe = staticmethod(describe)
    build = staticmethod(build)
