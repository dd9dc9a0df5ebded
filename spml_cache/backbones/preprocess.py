"""A backbone's own preprocessing: how a decoded image becomes its `[B, 3, R, R]` input.

Two ways: the papers' squash (resize to R x R ignoring the aspect ratio, bilinear, antialiased: ResNet-50's
default, through `resize`, byte for byte as before), or a pretrained config's resize of the shorter side
to `resize` pixels then a centre crop of R x R (torchvision's, timm's and open_clip's evaluation transforms). The
resized images stay uint8 until `normalise` (the loader workers ship uint8, a quarter of float32's size).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from spml_cache.images import IMAGENET_MEAN, IMAGENET_STD, normalise, resize
from spml_cache.runtime.errors import SpmlError

INTERPOLATIONS = {"bilinear": InterpolationMode.BILINEAR, "bicubic": InterpolationMode.BICUBIC}


@dataclass(frozen=True)
class Preprocess:
    """R (the input side), how to get there, and the mean and std to normalise with (on a 0..1 scale)."""

    resolution: int
    _: KW_ONLY
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    resize: int = 0  # the shorter side before the centre crop; 0: squash to R x R, no crop
    interpolation: str = "bilinear"

    def __post_init__(self) -> None:
        if self.interpolation not in INTERPOLATIONS:
            raise SpmlError(f"interpolation {self.interpolation}: use bilinear or bicubic")
        object.__setattr__(self, "mean", tuple(float(v) for v in self.mean))
        object.__setattr__(self, "std", tuple(float(v) for v in self.std))

    @classmethod
    def crop(cls, resolution: int, crop_pct: float, mean, std, interpolation: str) -> "Preprocess":
        """Shorter side to round(R / crop_pct), then the centre R x R (timm's crop_pct convention)."""
        return cls(resolution, mean=tuple(mean), std=tuple(std), resize=max(resolution, round(resolution / crop_pct)),
                   interpolation=interpolation)

    def describe(self) -> str:
        """The cache's `resize` attr."""
        if not self.resize:
            return f"{self.resolution}x{self.resolution}, {self.interpolation}, antialiased, no crop"
        return (f"shorter side {self.resize}, {self.interpolation}, antialiased, centre crop"
                f" {self.resolution}x{self.resolution}")

    def images(self, images: list[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
        """uint8 `[B, 3, R, R]` on `device` from decoded uint8 `[3, H, W]` images."""
        if not self.resize:
            return resize(images, self.resolution, device)
        mode, side = INTERPOLATIONS[self.interpolation], self.resolution
        out = torch.empty((len(images), 3, side, side), dtype=torch.uint8, device=device)
        for index, image in enumerate(images):
            image = image.to(device)
            if image.device.type == "cpu":  # torch's uint8 kernels (made to match PIL's, which the libraries use)
                resized = TF.resize(image, [self.resize], interpolation=mode, antialias=True)
            else:  # no uint8 kernel on a GPU: float, rounded to 8-bit levels and clamped (bicubic overshoots)
                resized = TF.resize(image.float(), [self.resize], interpolation=mode, antialias=True)
                resized = resized.round_().clamp_(0, 255).to(torch.uint8)
            out[index] = TF.center_crop(resized, [side, side])
        return out

    def normalise(self, batch: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """uint8 `[B, 3, R, R]` -> normalised `dtype`, channels_last (`normalise` with this mean/std)."""
        return normalise(batch, dtype, self.mean, self.std)

    def __call__(self, images: list[torch.Tensor], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.normalise(self.images(images, device), dtype)
