"""Stage three's optimiser step: the model being trained, its loss and optimiser (`Training`), and one step on a
global batch. `spml-cache finetune` and scripts/bench_finetune.py run this very step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spml_cache import losses
from spml_cache.backbones.preprocess import Preprocess
from spml_cache.finetune import images, parallel
from spml_cache.finetune.model import FineTuneModel


@dataclass(frozen=True, kw_only=True)
class Training:
    """What every step of one config uses besides its batch: the model, what steps it (the model itself, or its
    DistributedDataParallel wrapper under torchrun), the loss, the optimiser, the input preprocessing and the
    processes."""

    model: FineTuneModel
    trainer: nn.Module
    loss_fn: losses.Loss
    optimizer: torch.optim.Optimizer
    preprocess: Preprocess | int  # the backbone's own; a side R: the papers' R x R squash
    processes: parallel.Processes


def make_optimizer(model: FineTuneModel, loss_fn: losses.Loss, lr: float, head_lr_mult: float = 1.0):
    """Adam without weight decay: the trunk at lr, the head at head_lr_mult x lr, the loss's own parameters
    (ROLE's theta) at their lr_mult x lr (`Loss.param_groups`)."""
    groups = [{"params": list(model.trunk.parameters()), "lr": lr},
              {"params": list(model.head.parameters()), "lr": lr * head_lr_mult}]
    return torch.optim.Adam(groups + loss_fn.param_groups(lr), lr=lr, weight_decay=0.0)


def train_step(training: Training, images_share: list, flips, observed: torch.Tensor, labels: torch.Tensor | None,
               index: torch.Tensor) -> torch.Tensor:
    """One optimiser step on a global batch (`observed`, `labels`, `index` are the global batch's; `images_share`
    and `flips` this process's share): device-side preprocessing, bf16 autocast on GPU, the loss on the gathered
    logits, the head-only penalty. Returns the loss (detached)."""
    device, loss_fn = training.processes.device, training.loss_fn
    x = images.model_input(images_share, training.preprocess, device, flips)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        local_logits = training.trainer(x)
    logits = parallel.global_batch(local_logits.float(), training.processes)
    value = loss_fn(logits, observed, labels=labels, index=index)
    value = value + loss_fn.penalty(training.model.head.weight.t())  # L1R/L2R: on the head only
    training.optimizer.zero_grad(set_to_none=True)
    value.backward()
    training.optimizer.step()
    return value.detach()
