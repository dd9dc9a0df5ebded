"""Images into a backbone's input: decoding (on the GPU in one call where it can), the papers' resize and the
ImageNet normalisation. Shared by stage one (extract) and stage three (finetune); each backbone's own
preprocessing (backbones/preprocess.py) is built from these."""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
import torchvision
from torchvision.io import ImageReadMode

from spml_cache.runtime.errors import SpmlError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
JPEG_MAGIC = b"\xff\xd8"  # SOI
JPEG_END = b"\xff\xd9"  # EOI
# torchvision 0.29 deprecates its decoders in favour of torchcodec; they still work and are what we want here.
_DECODE_DEPRECATION = "The image decoding and encoding capabilities of TorchVision are deprecated"
# `--decode`'s choices and the JPEG decoder each one is (a cache records the decoder as its `decoder` attr): nvjpeg
# on the GPU, or torchvision's CPU decoder (the libjpeg-turbo bundled with it) in the loader workers, whose pixels
# are the CPU's. They differ by up to ~90 levels on some pixels, which moves features (docs/fidelity.md).
DECODERS = {"gpu": "nvjpeg", "cpu": "libjpeg-turbo"}


class ImageDecodeError(SpmlError):
    """One blob of a batch could not be decoded; `index` says which."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index, self.reason = index, reason


def check_decode(decode: str | None, flag: str = "--decode") -> None:
    """`--decode`'s one check (None: not given)."""
    if decode is not None and decode not in DECODERS:
        raise SpmlError(f"{flag} {decode}: use gpu (nvjpeg, on a CUDA device) or cpu (libjpeg-turbo in the loader"
                        " workers: the CPU's pixels)")


def resolve_decode(decode: str | None, device: torch.device) -> str:
    """`--decode` on `device`: gpu or cpu; None: gpu on a CUDA device (where nvjpeg runs), cpu elsewhere. gpu on
    another device is refused in one line."""
    check_decode(decode)
    if decode is None:
        return "gpu" if device.type == "cuda" else "cpu"
    if decode == "gpu" and device.type != "cuda":
        raise SpmlError(f"--decode gpu: nvjpeg needs a CUDA device, and this run is on {device}: pass --decode cpu,"
                        " or leave it out")
    return decode


def recorded_decoder(attrs: dict) -> str | None:
    """The decoder a cache's pixels came from: its `decoder` attr or, for a cache extracted before the attr
    existed, its `device` (extraction then decoded with nvjpeg on a GPU, on the CPU otherwise); None where that is
    unknown (features imported from elsewhere, a partial file begun before the attr)."""
    if attrs.get("decoder"):
        return str(attrs["decoder"])
    device = str(attrs.get("device", ""))
    return DECODERS["gpu"] if device.startswith("cuda") else DECODERS["cpu"] if device == "cpu" else None


def recorded_decode(attrs: dict) -> str | None:
    """The `--decode` choice that decodes as a cache's pixels were (`recorded_decoder`, read back through
    `DECODERS`); None where that is unknown."""
    return {decoder: choice for choice, decoder in DECODERS.items()}.get(recorded_decoder(attrs))


def decoder_version(decode: str) -> str:
    """The decoder's version as far as torch and torchvision tell it (a cache's `decoder_version` attr)."""
    if decode == "gpu":
        return f"nvjpeg of CUDA {torch.version.cuda}, through torchvision {torchvision.__version__}"
    return (f"torchvision {torchvision.__version__}'s CPU decoder (libjpeg-turbo in its wheels; torchvision does not"
            " expose its version)")


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
