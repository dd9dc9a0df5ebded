"""`--features last4`: the multi-layer features of DINOv2's linear evaluation, for every family.

A transformer (ViT) gives the class tokens of its last four blocks, each through the tower's final norm, and the
mean of its last block's patch tokens (normed the same way), concatenated: 5 x its width. A CNN gives the
outputs of its last four stages, each average-pooled over its spatial positions, concatenated: the sum of their
channels. Each family (torchvision_models.py, timm_models.py, clip_models.py) finds the blocks or stages in
its own models; what they do with them is here, so that every family concatenates the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from spml_cache.runtime.errors import SpmlError

LAST = 4  # blocks or stages read


def token_features(class_tokens: list[torch.Tensor], last_patches: torch.Tensor) -> torch.Tensor:
    """`[B, 5 D]`: the blocks' class tokens `[B, D]` in block order, then the mean of the last block's patch
    tokens `[B, L, D]`."""
    return torch.cat([*class_tokens, last_patches.mean(dim=1)], dim=1)


def pooled_stages(maps: list[torch.Tensor]) -> torch.Tensor:
    """`[B, sum C]`: each stage's `[B, C, H, W]` map averaged over its positions, in stage order."""
    return torch.cat([feature_map.mean(dim=(2, 3)) for feature_map in maps], dim=1)


def no_blocks(backbone: str, why: str) -> SpmlError:
    """The one line for a backbone `--features last4` cannot read."""
    return SpmlError(f"--features last4: {backbone} {why}; use --features pooled with it")


class StageTaps(nn.Module):
    """A CNN whose `stages` (its last four, in order) are read as it runs: `forward` gives `pooled_stages` of
    their outputs instead of the model's own output (hooks, so that the model's own forward, and its weights'
    key names, stay as they are)."""

    def __init__(self, model: nn.Module, stages: list[nn.Module]) -> None:
        super().__init__()
        self.model = model
        self._outputs: list[torch.Tensor] = []
        for stage in stages:
            stage.register_forward_hook(lambda _module, _inputs, output: self._outputs.append(output))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self._outputs.clear()
        try:
            self.model(images)
            return pooled_stages(self._outputs)
        finally:
            self._outputs.clear()
