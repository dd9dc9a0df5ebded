"""The backbone registry: which network turns an image into the cache's pooled vector (stage one), and which
trunk fine-tuning trains (stage three).

A name picks a family:
  resnet50 (the default: the papers' ResNet-50, 448 x 448 squash), resnet101, vit_b_16, convnext_base or any
  other torchvision classification model (also as `tv:NAME`)        -> torchvision_models.py
  timm:NAME (a timm model, its pretrained tag in the name: timm:convnext_base.fb_in22k)     -> timm_models.py
  clip:ARCH/TAG (an open_clip model and its pretrained tag: clip:ViT-B-16/openai)          -> clip_models.py
  module:callable, path/to/file.py:callable, or a name from the entry-point group spml_cache.backbones (the
  user's own, loaded by runtime/plugins.py as plugin losses are)                           -> plugins.py
Each family is a `Family` registered in `FAMILIES`, with one signature: it says, before any weights are loaded
(`describe(Request)`), what the cache will record: the canonical name, the weights' provenance, its own
preprocessing and its feature width; then builds the trunk (`build(Description)`), an `nn.Module` mapping a
normalised `[B, 3, R, R]` batch to `[B, row_width]`. What a family takes beyond weights and resolution (CLIP's
`crops`, `clip_features`), the feature kinds it gives and whether stage three trains it are declared on it.
For CLIP the row is the features followed by the L2-normalised image embedding (and the crops' embeddings with
`crops`); `Description.row_shapes` says which columns are which.

`features` says which of the trunk's activations make the features (`extract --features`): `pooled` (the
default, the pooled vector, every cache before the choice) or `last4` (layers.py: a ViT's last four blocks'
class tokens and its last block's mean patch token; a CNN's last four stages, each average-pooled;
concatenated). The kind is part of the cache's identity: its file name, its `features` attr, the report's column.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spml_cache.runtime import plugins as loader
from spml_cache.runtime.errors import SpmlError, unknown_name
from spml_cache.runtime.registry import Registry

if TYPE_CHECKING:  # the registry's names and defaults stay importable without torch (the report reads them)
    from torch import nn

    from spml_cache.backbones.preprocess import Preprocess

DEFAULT = "resnet50"
CLIP_FEATURES = ("post", "pre")  # after CLIP's projection (its README's code), before it (the paper's probes)
DEFAULT_CLIP_FEATURES = "post"
PROMPT_SETS = {
    "default": ["a photo of a {}."],
    # VLPL's shipped VOC and COCO text features are of the class name alone ("*_labelonly.npy")
    "vlpl": ["{}"],
}
DEFAULT_PROMPTS = "default"
FEATURES = ("pooled", "last4")  # which activations make the features (layers.py)
DEFAULT_FEATURES = "pooled"


@dataclass(frozen=True, kw_only=True)
class Description:
    """What a backbone is, known before its weights are loaded; its `attrs` go into the cache's settings."""

    backbone: str  # the canonical registry name (the cache's `backbone` attr)
    family: str  # its family's prefix: tv, timm, clip or plugin
    weights: str  # as given (a tag, a path, none), what `build` loads
    provenance: str  # what the cache records as `weights`: a tag, sha256:<hex> of a file, or none
    preprocess: Preprocess
    feature_dim: int
    embed_dim: int = 0  # CLIP: the width of its image and text embeddings; 0 otherwise
    clip_features: str | None = None  # CLIP: pre or post (the projection)
    grid: int = 0  # CLIP with crops: G, for G x G crops' embeddings per image
    features: str = DEFAULT_FEATURES  # pooled or last4 (layers.py)
    extra: dict = field(default_factory=dict, compare=False)  # the family's own build details
    origin: str = ""  # a plugin's: where its code came from, runtime/plugins.py's `Origin` as JSON

    @property
    def slug(self) -> str:
        """The cache file's name for it: the backbone's slug, `_last4` after it for that kind."""
        return feature_slug(self.backbone, self.features)

    @property
    def resolution(self) -> int:
        """The backbone's input side R (with crops the loader's images are G x R: the whole and its G x G crops)."""
        return self.preprocess.resolution // max(self.grid, 1)

    @property
    def row_width(self) -> int:
        """Columns of one trunk output row: the features, then (CLIP) the embedding and the crops' embeddings."""
        return self.feature_dim + self.embed_dim * (1 + self.grid * self.grid)

    def row_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each per-row dataset of a split and its shape per row, in the trunk output's column order."""
        shapes = {"features": (self.feature_dim,)}
        if self.embed_dim:
            shapes["image_embeddings"] = (self.embed_dim,)
        if self.grid:
            shapes["crop_embeddings"] = (self.grid * self.grid, self.embed_dim)
        return shapes

    def attrs(self) -> dict:
        """The cache's settings attrs that say what the features are (ResNet-50's exactly as they always were)."""
        resize = self.preprocess.describe()
        if self.grid:
            resize += (f"; the whole resized to {self.resolution}x{self.resolution} (bilinear, antialiased) and cut"
                       f" into {self.grid}x{self.grid} crops of {self.resolution}x{self.resolution}")
        attrs = {
            "backbone": self.backbone, "weights": self.provenance, "resolution": self.resolution, "resize": resize,
            "mean": list(self.preprocess.mean), "std": list(self.preprocess.std), "feature_dim": self.feature_dim,
        }  # fmt: skip
        if self.clip_features is not None:  # CLIP's only
            attrs["clip_features"] = self.clip_features
        if self.features != DEFAULT_FEATURES:  # a pooled cache's attrs are what they were before the choice
            attrs["features"] = self.features
        if self.origin:
            attrs["backbone_origin"] = self.origin
        return attrs


def feature_label(backbone: str, features: str | None) -> str:
    """A cache's backbone and feature kind as the report names them: `vit_b_16` (pooled), `vit_b_16+last4`."""
    return backbone if features in (None, DEFAULT_FEATURES) else f"{backbone}+{features}"


def slug(name: str) -> str:
    """The name as the cache file names it: `-`, `:` and `/` become `_` (find_cache splits names at `-`)."""
    return re.sub(r"[-:/]", "_", name)


def feature_slug(backbone: str, features: str | None) -> str:
    """A backbone and feature kind as file names carry them (the cache's, a run directory's): `resnet50`,
    `timm_vit_base_patch14_dinov2.lvd142m_last4`."""
    return slug(backbone) + ("" if features in (None, DEFAULT_FEATURES) else f"_{features}")


@dataclass(frozen=True, kw_only=True)
class Request:
    """What `describe` is asked for, as every family's `describe` takes it: the name within the family and the
    options (None: the family's default)."""

    name: str  # within the family: resnet50, convnext_base.fb_in22k, ViT-B-16/openai, mynets:fn, my_entry_point
    weights: str | None = None
    resolution: int | None = None
    features: str = DEFAULT_FEATURES
    clip_features: str = DEFAULT_CLIP_FEATURES
    crops: int = 0


# The options only some families take: the family declares it takes one (`Family.takes`); given to another, the
# option is refused with its own words.
OPTIONS = {
    "crops": ("--crops", "crop embeddings are for clip:ARCH/TAG backbones only"),
    "clip_features": ("--clip-features", "only for clip:ARCH/TAG backbones"),
}


class Family:
    """A family of backbones, an entry of `FAMILIES` under the prefix its names start with. One signature for all:
    `describe(Request)` says what the cache will record, before any weights are loaded; `build(Description)`
    makes the trunk. What it takes and gives is declared, so that `describe` checks every family alike."""

    name: str = ""  # the prefix: tv, timm, clip (plugin: reached by a spec's form, never typed)
    called: str = ""  # what one of its backbones is, in a refusal: "a CLIP image tower"
    library: str | None = None  # the package whose version the cache records beside torch's and torchvision's
    takes: tuple[str, ...] = ()  # the OPTIONS it takes
    features: tuple[str, ...] = FEATURES  # the feature kinds it gives
    fine_tunes: bool = True  # whether stage three trains it end to end

    @staticmethod
    def describe(request: Request) -> Description:
        raise NotImplementedError

    @staticmethod
    def build(description: Description) -> nn.Module:
        raise NotImplementedError

    @classmethod
    def check(cls, request: Request, shown: str) -> None:
        """Refuse, in one line, an option it does not take or a feature kind it does not give."""
        for option, (flag, only) in OPTIONS.items():
            value = getattr(request, option)
            if option not in cls.takes and value != getattr(Request, option):
                raise SpmlError(f"{flag} {value}: {only}")
        if request.features not in cls.features:
            raise SpmlError(f"--features {request.features}: {shown} is {cls.called}; use --features"
                            f" {' or '.join(cls.features)} with it")


def _family(prefix: str, where: str, package: str | None = None, extra: str | None = None):
    """The loader of a family (`where`: module:class), imported when the family is used, once `package` (which
    the extra `extra` installs) is found importable."""

    def load() -> type[Family]:
        if package is not None:
            if os.environ.get("SPML_OFFLINE"):  # the project's offline switch is the hub's too (read on its import)
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
            try:
                importlib.import_module(package)
            except ImportError:
                raise SpmlError(f"--backbone {prefix}:...: needs the {package} package: pip install"
                                f' "spml-cache[{extra}]"') from None
        module, _, name = where.partition(":")
        return getattr(importlib.import_module(module), name)

    return load


# The families, each a class of its module, imported when used (they import torch and their packages); the
# prefixes a name may start with are every family's but the plugins', which a name reaches as a spec
# (`module:callable`, `file.py:callable`) or an entry point's name.
PLUGIN = "plugin"
FAMILIES: Registry[type[Family]] = Registry("backbone family")
FAMILIES.register_lazy("tv", _family("tv", "spml_cache.backbones.torchvision_models:Torchvision", "torchvision"))
FAMILIES.register_lazy("timm", _family("timm", "spml_cache.backbones.timm_models:Timm", "timm", "timm"))
FAMILIES.register_lazy("clip", _family("clip", "spml_cache.backbones.clip_models:Clip", "open_clip", "clip"))
FAMILIES.register_lazy(PLUGIN, _family(PLUGIN, "spml_cache.backbones.plugins:Plugins"))


def family_of(name: str) -> tuple[str, str]:
    """(family prefix, the name within the family): `timm:x` -> (timm, x), `tv:x` and `x` -> (tv, x), a spec
    (`module:callable` with the module on the path, `file.py:callable`) or an installed entry point's name ->
    (plugin, name)."""
    prefix, colon, rest = name.partition(":")
    if not colon:
        return (PLUGIN, name) if _plugin_named(name) else ("tv", name)
    if prefix not in FAMILIES or prefix == PLUGIN:
        if loader.findable(name):
            return PLUGIN, name
        typed = [family for family in FAMILIES if family != PLUGIN]
        raise SpmlError(f"--backbone {name}: {unknown_name('backbone family', prefix, typed)}, nor"
                        " a module found on the path; use a torchvision name (resnet50, vit_b_16, ...), timm:NAME,"
                        " clip:ARCH/TAG, module:callable or path/to/file.py:callable (docs/your-own-backbone.md)")
    return prefix, rest


def family(name: str) -> type[Family]:
    """The family of backbone `name` (its module imported)."""
    return FAMILIES.get(family_of(name)[0])


def describe(name: str = DEFAULT, weights: str | None = None, resolution: int | None = None,
             clip_features: str = DEFAULT_CLIP_FEATURES, crops: int = 0,
             features: str = DEFAULT_FEATURES) -> Description:
    """The backbone `name` with `weights` (None: the family's default) at side `resolution` (None: its own),
    giving `features` (pooled or last4)."""
    if features not in FEATURES:
        raise SpmlError(f"--features {features}: use pooled (the pooled vector) or last4 (the last four blocks or"
                        " stages, concatenated)")
    if clip_features not in CLIP_FEATURES:
        raise SpmlError(f"--clip-features {clip_features}: use post (after the projection) or pre (before it)")
    prefix, rest = family_of(name)
    found = FAMILIES.get(prefix)
    request = Request(name=rest, weights=weights, resolution=resolution, features=features,
                      clip_features=clip_features, crops=crops)
    found.check(request, name)
    if crops and crops < 2:
        raise SpmlError(f"--crops {crops}: use 2 or more (a G x G grid), or leave it out")
    return found.describe(request)


def _plugin_named(name: str) -> bool:
    """Whether the plain name `name` is an installed entry point of spml_cache.backbones; one that is also a
    torchvision model is refused (`tv:NAME` names torchvision's)."""
    point = loader.entry_point(name, loader.BACKBONES)
    if point is None:
        return False
    import torchvision

    if name in torchvision.models.list_models():
        raise SpmlError(f"--backbone {name}: both torchvision's model and the entry point {point.value} of"
                        f" {point.group} have this name; pass tv:{name} for torchvision's, or {point.value}")
    return True


def build(description: Description) -> nn.Module:
    """The trunk, in train mode with gradients on (extraction freezes it); `RandomWeightsWarning` for none."""
    return FAMILIES.get(description.family).build(description)


def prompts(choice: str = DEFAULT_PROMPTS) -> list[str]:
    """`--prompts default|vlpl|FILE`: the templates, each with one `{}` for the class name."""
    if choice in PROMPT_SETS:
        return list(PROMPT_SETS[choice])
    from pathlib import Path

    path = Path(choice).expanduser()
    if not path.is_file():
        raise SpmlError(f"--prompts {choice}: use default, vlpl, or a text file with one template per line")
    templates = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    wrong = [t for t in templates if t.count("{}") != 1]
    if not templates or wrong:
        raise SpmlError(f"--prompts {choice}: every line must hold one {{}} for the class name"
                        + (f" ({wrong[0]!r} does not)" if wrong else " (the file is empty)"))
    return templates


def class_prompts(classes: list[str], templates: list[str]) -> list[list[str]]:
    """Per class, its prompts: each template with the class name ('_' read as a space)."""
    return [[template.replace("{}", name.replace("_", " ")) for template in templates] for name in classes]


def templates_attr(templates: list[str]) -> str:
    return json.dumps(list(templates))
