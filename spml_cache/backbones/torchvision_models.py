"""torchvision classification models as trunks: `resnet50` (resnet50.py's, exactly as before), and any other
(resnet101, vit_b_16, convnext_base, ...) with its weights enum and that enum's own evaluation transform.

The trunk is the model with its last `nn.Linear` (the ImageNet classifier) replaced by the identity, so it ends
at the pooled vector the classifier read (ResNet: after average pooling; ViT: the class token after the last
norm; ConvNeXt: after pooling and its LayerNorm). Weights: an enum member's name (`DEFAULT` = the enum's
default), a local `.pth` state dict, or `none` (random, seeded).

`--features last4` (layers.py): a VisionTransformer's last four encoder blocks (class tokens and the last one's
mean patch token, each through the encoder's final LayerNorm); a CNN's last four stages (ResNet, ResNeXt and Wide
ResNet's layer1-4, ConvNeXt's four stages), average-pooled; other models are refused in one line.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torchvision
from torch import nn

from spml_cache.backbones import DEFAULT_FEATURES, Description, Family, Request, resnet50
from spml_cache.backbones.checkpoints import RandomWeightsWarning, fetch_checkpoint, file_provenance, read_state_dict
from spml_cache.backbones.layers import LAST, StageTaps, no_blocks, token_features
from spml_cache.backbones.preprocess import Preprocess
from spml_cache.runtime.errors import SpmlError, unknown_name

RESNET50 = "resnet50"
RESNET50_RESOLUTION = 448  # the papers' 448 x 448 squash
STRIPPED_PREFIXES = ("module.", "model.", "trunk.", "backbone.")


def _check_name(name: str) -> None:
    known = torchvision.models.list_models(module=torchvision.models)
    if name not in known:
        close = [k for k in known if k.startswith(name[:4])][:6] or ["resnet50", "resnet101", "vit_b_16"]
        raise SpmlError(f"--backbone {name}: {unknown_name('backbone', name, known)}, not a torchvision classification"
                        f" model (e.g. {', '.join(close)}); for timm or CLIP use timm:NAME or clip:ARCH/TAG")


def _enum(name: str):
    return torchvision.models.get_model_weights(name)


def _member(name: str, weights: str):
    """The enum member `weights` names (`DEFAULT` included), or None for none and for a file."""
    if weights.lower() == "none":
        return None
    enum = _enum(name)
    if weights.upper() == "DEFAULT":
        return enum.DEFAULT
    for member in enum:
        if member.name == weights.upper():
            return member
    if Path(weights).expanduser().is_file():
        return None
    tags = ", ".join(member.name for member in enum)
    raise SpmlError(f"--weights {weights}: no such file, and {name}'s weights are {tags} (or none, or a .pth path)")


def describe(request: Request) -> Description:
    name, weights, features = request.name, request.weights, request.features
    _check_name(name)
    if name == RESNET50:
        weights = weights or "IMAGENET1K_V1"
        width = resnet50.FEATURE_DIM if features == DEFAULT_FEATURES else _last4_width(name)
        return Description(backbone=RESNET50, family=Torchvision.name, weights=weights,
                           provenance=resnet50.weights_provenance(weights),
                           preprocess=Preprocess(request.resolution or RESNET50_RESOLUTION), feature_dim=width,
                           features=features)
    weights = weights or "DEFAULT"
    member = _member(name, weights)
    if member is not None:
        provenance = member.name
    elif weights.lower() == "none":
        provenance = "none"
    else:
        provenance = file_provenance(Path(weights).expanduser())
    transform = (member or _enum(name).DEFAULT).transforms()  # the architecture's own evaluation transform
    crop, resize = transform.crop_size[0], transform.resize_size[0]
    side = request.resolution or crop
    interpolation = transform.interpolation.value
    preprocess = Preprocess.crop(side, crop / resize, transform.mean, transform.std, interpolation)
    with torch.device("meta"):
        _, width = _trunk(name)
    width = width if features == DEFAULT_FEATURES else _last4_width(name)
    return Description(backbone=name, family=Torchvision.name, weights=weights, provenance=provenance,
                       preprocess=preprocess, feature_dim=width, features=features)


class VitBlocks(nn.Module):
    """A torchvision VisionTransformer giving `token_features` of its last four encoder blocks (its own forward
    up to the encoder, block by block)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        model, encoder = self.model, self.model.encoder
        tokens = model._process_input(images)
        tokens = torch.cat([model.class_token.expand(len(tokens), -1, -1), tokens], dim=1)
        tokens = encoder.dropout(tokens + encoder.pos_embedding)
        blocks = []
        for layer in encoder.layers:
            tokens = layer(tokens)
            blocks.append(tokens)
        normed = [encoder.ln(block) for block in blocks[-LAST:]]
        return token_features([block[:, 0] for block in normed], normed[-1][:, 1:])


def _stages(model: nn.Module, name: str) -> list[nn.Module]:
    """A CNN's last four stages, in order."""
    if all(hasattr(model, f"layer{i}") for i in range(1, 5)):  # ResNet, ResNeXt, Wide ResNet
        return [getattr(model, f"layer{i}") for i in range(1, 5)]
    if isinstance(model, torchvision.models.ConvNeXt):  # stages at 1, 3, 5, 7, downsampling between them
        return [model.features[i] for i in (1, 3, 5, 7)]
    raise no_blocks(name, "has no blocks or stages this reads (torchvision: VisionTransformer, ResNet, ResNeXt,"
                          " Wide ResNet, ConvNeXt)")


def _last4(model: nn.Module, name: str) -> nn.Module:
    """The trunk giving `last4` features."""
    if isinstance(model, torchvision.models.VisionTransformer):
        return VitBlocks(model)
    return StageTaps(model, _stages(model, name))


def _last4_width(name: str) -> int:
    """The width of `name`'s last4 features, from a forward pass on the meta device (no weights, no compute)."""
    with torch.device("meta"):
        model, _ = _trunk(name)
        if isinstance(model, torchvision.models.VisionTransformer):
            return (LAST + 1) * model.hidden_dim
        return int(_last4(model, name)(torch.empty(1, 3, 64, 64)).shape[1])


def _trunk(name: str) -> tuple[nn.Module, int]:
    """The model with its last Linear replaced by the identity, and that Linear's input width."""
    model = torchvision.models.get_model(name, weights=None)
    last = [(path, module) for path, module in model.named_modules() if isinstance(module, nn.Linear)][-1]
    path, linear = last
    parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
    setattr(parent, path.rsplit(".", 1)[-1], nn.Identity())
    return model, linear.in_features


def _state_for(trunk: nn.Module, state: dict, what: str, name: str) -> dict:
    """The file's tensors under the trunk's keys (a wrapper's prefix dropped, the classifier ignored)."""
    for prefix in STRIPPED_PREFIXES:
        if state and all(key.startswith(prefix) for key in state):
            state = {key[len(prefix):]: value for key, value in state.items()}
    expected = trunk.state_dict()
    missing = [key for key in expected if key not in state and not key.endswith("num_batches_tracked")]
    wrong = [key for key in expected if key in state and state[key].shape != expected[key].shape]
    if missing or wrong:
        first = (missing or wrong)[0]
        raise SpmlError(f"--weights {what}: not a {name} state dict ({len(missing)} of {len(expected)} trunk tensors"
                        f" missing, {len(wrong)} of another shape, e.g. {first})")
    return {key: state[key].to(value.dtype) if key in state else torch.zeros((), dtype=value.dtype)
            for key, value in expected.items()}


def build(description: Description) -> nn.Module:
    trunk = _pooled_trunk(description)
    return trunk if description.features == DEFAULT_FEATURES else _last4(trunk, description.backbone)


def _pooled_trunk(description: Description) -> nn.Module:
    name, weights = description.backbone, description.weights
    if name == RESNET50:
        return resnet50.build_trunk(weights)[0]
    member = _member(name, weights)
    if member is None and weights.lower() == "none":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            trunk, _ = _trunk(name)
        warnings.warn(f"--weights none: the {name} is randomly initialised; its features are not pretrained",
                      RandomWeightsWarning, stacklevel=2)
        return trunk
    if member is not None:
        path = fetch_checkpoint(member.url, f"{name} weights {member.name}",
                                         f"or pass --weights PATH to a local {name} .pth")
    else:
        path = Path(weights).expanduser()
    trunk, _ = _trunk(name)  # not on the meta device: a model's non-persistent buffers are made at init
    trunk.load_state_dict(_state_for(trunk, read_state_dict(path), str(path), name))
    return trunk


class Torchvision(Family):
    """torchvision's classification models: `resnet50` (the default), `resnet101`, `tv:NAME`."""

    name = "tv"
    called = "a torchvision model"
    describe = staticmethod(describe)
    build = staticmethod(build)
