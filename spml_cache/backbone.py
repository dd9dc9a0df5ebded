"""The frozen feature extractor: a torchvision ResNet-50 trunk, its weights, and the papers' preprocessing.

Shared by stage one (extract.py) and stage three (finetune.py). The trunk is ResNet-50 up to and including
global average pooling, so it maps a normalised `[B, 3, R, R]` batch to `[B, 2048]` pooled features.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import re
import socket
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.io import ImageReadMode

from spml_cache.runtime.errors import SpmlError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
FEATURE_DIM = 2048
WEIGHT_NAMES = ("IMAGENET1K_V1", "IMAGENET1K_V2")
DOWNLOAD_TIMEOUT_S = 20.0
JPEG_MAGIC = b"\xff\xd8"  # SOI
JPEG_END = b"\xff\xd9"  # EOI
# torchvision 0.29 deprecates its decoders in favour of torchcodec; they still work and are what we want here.
_DECODE_DEPRECATION = "The image decoding and encoding capabilities of TorchVision are deprecated"


class RandomWeightsWarning(UserWarning):
    """`--weights none`: the features come from a randomly initialised network."""


class ImageDecodeError(SpmlError):
    """One blob of a batch could not be decoded; `index` says which."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index, self.reason = index, reason


# --- weights ---------------------------------------------------------------------------------------------


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


def _sha256(path: Path) -> str:
    stat = path.stat()
    return _sha256_of(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    """Cached per file version: provenance is asked for before and while loading the same file."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
    return f"sha256:{_sha256(path)}"


def _fetch_enum_weights(name: str) -> Path:
    """The cached file of an enum weight, downloading it only when absent and failing fast when offline."""
    return fetch_checkpoint(torchvision.models.ResNet50_Weights[name].url, f"ImageNet weights {name}",
                            "or pass --weights PATH to a local ResNet-50 .pth")


def fetch_checkpoint(url: str, what: str, other_way: str) -> Path:
    """The file `url` names under `$TORCH_HOME/hub/checkpoints`, downloaded only when absent (not with
    SPML_OFFLINE); when missing and not fetched, one line naming the file to place there, or `other_way`."""
    path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)
    if path.is_file():
        return path
    way_out = (
        f"{what} are not cached (expected {path}; the cache folder is TORCH_HOME="
        f"{os.environ.get('TORCH_HOME', '~/.cache/torch')})"
    )
    fix = f"copy {path.name} there, {other_way}"
    if os.environ.get("SPML_OFFLINE"):
        raise SpmlError(f"{way_out} and SPML_OFFLINE is set: {fix}")
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # an unreachable network must not hang the run
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        hash_prefix = re.search(r"-([a-f0-9]+)\.", path.name)
        # download_url_to_file writes a temporary file and moves it into place, so no half file is left.
        torch.hub.download_url_to_file(url, str(path), hash_prefix and hash_prefix.group(1))
    except (OSError, RuntimeError, ValueError) as err:
        reason = getattr(err, "reason", None) or err  # urllib's "<urlopen error ...>" wraps the reason
        raise SpmlError(f"{way_out} and could not be downloaded ({reason}): {fix}") from None
    finally:
        socket.setdefaulttimeout(previous)
    return path


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A `.pth` file's tensors (loaded with `weights_only=True`, unwrapped from a training checkpoint)."""
    return _read_state_dict(path)


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle errors, zip errors, disallowed globals: all mean "not a weights file"
        text = str(err).strip()
        if "weights_only" in text or isinstance(err, pickle.UnpicklingError):
            # torch's own message advises weights_only=False, which would run whatever code the file holds
            problem = "it holds Python objects besides tensors, which are not loaded from a file"
        else:
            problem = f"{type(err).__name__}: {text.splitlines()[0][:160]}" if text else type(err).__name__
        raise SpmlError(f"--weights {path}: not a loadable PyTorch weights file ({problem}); save the ResNet-50's"
                        " weights with torch.save(model.state_dict(), PATH)") from None
    # Training checkpoints often wrap the weights one level down.
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
            loaded = loaded[key]
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise SpmlError(f"--weights {path}: not a state dict (a mapping of names to tensors); save model.state_dict()")
    return loaded


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
    trunk.load_state_dict(_match_trunk_keys(_read_state_dict(path), trunk, path), assign=True)
    return trunk, provenance


# --- images ----------------------------------------------------------------------------------------------


def as_byte_tensor(blob: bytes | torch.Tensor) -> torch.Tensor:
    """Encoded image bytes as the 1-d uint8 tensor torchvision's decoders take (empty files included)."""
    if isinstance(blob, torch.Tensor):
        return blob
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)


def _decode_one_on_cpu(data: torch.Tensor) -> torch.Tensor:
    if bytes(data[:2].tolist()) == JPEG_MAGIC:
        return torchvision.io.decode_jpeg(data, mode=ImageReadMode.RGB)
    # Some datasets hold the odd PNG or GIF under a .jpg name; decode_image handles those.
    return torchvision.io.decode_image(data, mode=ImageReadMode.RGB)


def _whole_jpeg(data: torch.Tensor) -> bool:
    """Starts with SOI and ends with EOI: what nvjpeg gets. A truncated file lacks EOI and goes to libjpeg,
    which reports truncation instead of returning a partly grey image."""
    return len(data) >= 4 and bytes(data[:2].tolist()) == JPEG_MAGIC and bytes(data[-2:].tolist()) == JPEG_END


def drain_before_gpu_decode(device: torch.device) -> None:
    """Wait until the calling thread's current stream on `device` has run everything queued on it.

    nvjpeg's hardware decoder writes its outputs without waiting for the stream it is given, into memory that
    torch's caching allocator hands out as soon as it is freed on that stream, possibly while queued kernels
    still read it (torchvision pull request 9606; the stage-one non-finite batches fit this): draining the stream
    first leaves nothing queued that could read such memory. Every GPU decode goes through `decode_jpegs`,
    which calls this: extraction with and without its feed thread, and fine-tuning."""
    torch.cuda.current_stream(device).synchronize()


def decode_jpegs(
    blobs: list[bytes | torch.Tensor], device: torch.device | str = "cpu", *, skip_bad: bool = False
) -> list[torch.Tensor | None]:
    """Decode a batch of encoded images to RGB `uint8 [3, H, W]` tensors on `device`.

    On a GPU the whole JPEGs of the batch go to nvjpeg in one call, once the current stream is drained
    (`drain_before_gpu_decode`); the rest (a PNG under a .jpg name, a truncated file) and, if nvjpeg fails (a
    corrupt file, CMYK), the whole batch are decoded one by one on the CPU, which also names the culprit. An
    image that cannot be decoded raises `ImageDecodeError` (its `index` says which), or comes back as None with
    `skip_bad`.
    """
    device = torch.device(device)
    data = [as_byte_tensor(blob) for blob in blobs]
    images: list[torch.Tensor | None] = [None] * len(data)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DECODE_DEPRECATION, category=DeprecationWarning)
        on_gpu = [i for i, datum in enumerate(data) if device.type == "cuda" and _whole_jpeg(datum)]
        if on_gpu:
            drain_before_gpu_decode(device)
            try:
                decoded = torchvision.io.decode_jpeg([data[i] for i in on_gpu], mode=ImageReadMode.RGB, device=device)
                for i, image in zip(on_gpu, decoded):
                    images[i] = image
            except RuntimeError:
                on_gpu = []  # retry every image on the CPU, which tells a bad file from an nvjpeg limit
        decoded_on_gpu = set(on_gpu)
        for index, datum in enumerate(data):
            if index in decoded_on_gpu:
                continue
            try:
                images[index] = _decode_one_on_cpu(datum).to(device)
            except (RuntimeError, ValueError) as err:
                if not skip_bad:
                    reason = str(err).rsplit(", ", 1)[-1]  # drop torchvision's C++ source location
                    raise ImageDecodeError(index, reason) from None
    return images


def resize(images: list[torch.Tensor], resolution: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """uint8 `[B, 3, R, R]`: each image resized to R x R ignoring aspect ratio, bilinear and antialiased.

    Results are rounded to uint8 levels, as the reference's PIL resize of a uint8 image gives: on the CPU
    the native uint8 kernel does it, on a GPU float math rounded back. Images of equal size share one call, and
    go to their places through one index tensor copied to the device once per batch (a Python list as an index
    is copied anew at every use, from pageable memory: a copy that may wait for the stream).
    """
    device = torch.device(device)
    batch = torch.empty((len(images), 3, resolution, resolution), dtype=torch.uint8, device=device)
    by_size: dict[tuple[int, int], list[int]] = {}
    for index, image in enumerate(images):
        by_size.setdefault(tuple(image.shape[-2:]), []).append(index)
    places = torch.tensor([i for indices in by_size.values() for i in indices])
    if device.type == "cuda":  # from pinned memory the copy is queued; from pageable memory it may wait for the stream
        places = places.pin_memory()
    places = places.to(device, non_blocking=True)
    start = 0
    for indices in by_size.values():
        group = torch.stack([images[i] for i in indices]).to(device, non_blocking=True)
        if device.type == "cpu":
            resized = F.interpolate(group, size=(resolution, resolution), mode="bilinear", antialias=True)
        else:
            resized = F.interpolate(group.float(), size=(resolution, resolution), mode="bilinear", antialias=True)
            resized = resized.round_().clamp_(0, 255)
        batch.index_copy_(0, places[start : start + len(indices)], resized.to(torch.uint8))
        start += len(indices)
    return batch


@functools.lru_cache(maxsize=4)
def _mean_std_255(device: torch.device, mean: tuple = IMAGENET_MEAN, std: tuple = IMAGENET_STD
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Made once per device: a fresh host-to-GPU copy every batch would wait for the GPU to catch up."""
    mean = torch.tensor(mean, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(std, device=device).view(1, 3, 1, 1) * 255
    return mean, std


def normalise(batch: torch.Tensor, dtype: torch.dtype = torch.float32, mean: tuple = IMAGENET_MEAN,
              std: tuple = IMAGENET_STD) -> torch.Tensor:
    """uint8 `[B, 3, R, R]` -> mean/std normalised `dtype` (ImageNet's unless given), channels_last, on the
    batch's device."""
    mean, std = _mean_std_255(batch.device, tuple(mean), tuple(std))
    normalised = (batch.float() - mean) / std
    return normalised.to(dtype).contiguous(memory_format=torch.channels_last)


def preprocess(
    images: list[torch.Tensor], resolution: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The papers' preprocessing: `resize` to R x R, then `normalise`. Returns `[B, 3, R, R]` channels_last."""
    return normalise(resize(images, resolution, device), dtype)
