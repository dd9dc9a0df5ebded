"""Stage three's model, built where the run starts: the trunk the cache's backbone describes (`Setup.trunk`,
with the run's weights and resolution) and the linear head (the linear run's head for LinearInit, else each
config's seeded fresh one)."""

from __future__ import annotations

import torch
from torch import nn

from spml_cache import backbones
from spml_cache.finetune.settings import Setup


class FineTuneModel(nn.Module):
    """The backbone's trunk (to its pooled vector, 2048-d for ResNet-50) and the linear head: logits `[B, C]`."""

    def __init__(self, trunk: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.trunk, self.head = trunk, head

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(images))


def initial_model(setup: Setup) -> FineTuneModel:
    """The model every config starts from a copy of, on the CPU: the trunk with its weights (`RandomWeightsWarning`
    for none), and the head LinearInit starts from (a fresh head otherwise, which each config replaces by its
    seed's: `protocol.initial_head`)."""
    trunk = backbones.build(setup.trunk)  # first: a random trunk (--weights none) draws before the head does
    head = nn.Linear(setup.trunk.feature_dim, len(setup.features.classes))
    if setup.start is not None:
        head.weight.data.copy_(setup.start.weight)
        head.bias.data.copy_(setup.start.bias)
    return FineTuneModel(trunk, head)
