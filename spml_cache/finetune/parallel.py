"""Data-parallel fine-tuning on one host: torchrun's processes, exact global-batch losses, global BatchNorm on CPU.

Data parallel keeps the single-process semantics exactly: every process draws the same permutation of the
training rows from (seed, epoch), cuts it into the same global batches, and takes its contiguous share of each.
The loss is then computed on the whole global batch in every process (logits are gathered), so losses whose
terms couple the batch (EPR's and ROLE's R_k, the large-loss rejection, OPML's log det) and per-example state
indexed by training row stay identical in every process without further communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from spml_cache.runtime.devices import resolve_device
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.ranks import Ranks, current as current_ranks


@dataclass(frozen=True)
class Processes:
    """Where this process stands: alone, or one of torchrun's (`ranks`, runtime/ranks.py), on `device`."""

    device: torch.device
    ranks: Ranks | None = None

    @property
    def rank(self) -> int:
        return self.ranks.rank if self.ranks else 0

    @property
    def world(self) -> int:
        return self.ranks.world if self.ranks else 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def start_processes(device_name: str) -> Processes:
    """One process, or (under torchrun) one of the process group: nccl on GPUs, gloo on the CPU; each process on
    its own GPU (its local rank)."""
    device = resolve_device(device_name)
    ranks = current_ranks("nccl" if device.type == "cuda" else "gloo")
    return Processes(device) if ranks is None else Processes(ranks.device(device), ranks)


def stop_processes(processes: Processes) -> None:
    if processes.ranks is not None:
        processes.ranks.leave()


def gather_rows(local: torch.Tensor, counts: list[int], processes: Processes) -> torch.Tensor:
    """Concatenate every process's `[n_r, ...]` rows in rank order (`counts` = every n_r), on every process."""
    if processes.world == 1:
        return local
    padded = local.new_zeros((max(counts), *local.shape[1:]))
    padded[: len(local)] = local
    parts = [torch.empty_like(padded) for _ in range(processes.world)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:count] for part, count in zip(parts, counts)])


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def global_batch(local_logits: torch.Tensor, processes: Processes) -> torch.Tensor:
    """The logits of the whole global batch, with this process's share live (differentiable).

    Every process computes the same loss L on the global batch; its gradient reaches the model only through the
    local share. DDP averages the model's gradients over the processes, so the share's gradient is scaled by the
    world size first: the average then equals dL/dparams exactly, while the loss's own parameters (ROLE's
    theta, identical in every process) get dL/dtheta unscaled.
    """
    if processes.world == 1:
        return local_logits
    parts = [torch.empty_like(local_logits) for _ in range(processes.world)]
    dist.all_gather(parts, local_logits.detach().contiguous())
    parts[processes.rank] = _ScaleGradient.apply(local_logits, float(processes.world))
    return torch.cat(parts)


class _SumOverProcesses(torch.autograd.Function):
    """all_reduce(SUM) with its gradient (the sum of every process's gradients), on any backend."""

    @staticmethod
    def forward(ctx, x):
        total = x.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone()
        dist.all_reduce(total)
        return total


class GlobalBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm whose training statistics span the global batch of all processes, on any device.

    torch's SyncBatchNorm serves GPUs only; this is its CPU (gloo) counterpart, so that a data-parallel CPU run
    normalises exactly as the single process does; the statistics' gradients cross processes too.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        local_count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
        sums = _SumOverProcesses.apply(torch.cat([x.sum(dim=(0, 2, 3)), local_count]))
        count = sums[-1].detach()
        mean = sums[:-1] / count
        centred = x - mean.view(1, -1, 1, 1)
        var = _SumOverProcesses.apply(centred.square().sum(dim=(0, 2, 3))) / count
        with torch.no_grad():
            self.running_mean.lerp_(mean.detach(), self.momentum)
            self.running_var.lerp_(var.detach() * count / (count - 1), self.momentum)
            self.num_batches_tracked.add_(1)
        scale = self.weight * torch.rsqrt(var + self.eps)
        return centred * scale.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)


def synchronise_batchnorm(module: nn.Module, processes: Processes) -> nn.Module:
    """Under data parallel, make every BatchNorm normalise over the global batch (in place; returns module)."""
    if processes.world == 1:
        return module
    if processes.device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            replacement = GlobalBatchNorm2d(child.num_features, child.eps, child.momentum).to(child.weight.device)
            replacement.load_state_dict(child.state_dict())
            setattr(module, name, replacement)
        else:
            synchronise_batchnorm(child, processes)
    return module


def check_batch_split(batch_sizes: list[int], processes: Processes) -> None:
    for batch_size in batch_sizes:
        if batch_size % processes.world:
            raise SpmlError(
                f"--batch-size {batch_size} does not split over {processes.world} processes: the global batch is"
                f" shared equally, so pass multiples of {processes.world}"
            )
