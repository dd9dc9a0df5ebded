"""Stage three's inputs: the linear run's head (LinearInit), the cache's images on disk, the batches of one or
several processes, the device-side augmentation, and the few collectives that data-parallel fine-tuning needs.

Data parallel keeps the single-process semantics exactly: every process draws the same permutation of the
training rows from (seed, epoch), cuts it into the same global batches, and takes its contiguous share of each.
The loss is then computed on the whole global batch in every process (logits are gathered), so losses whose
terms couple the batch (EPR's and ROLE's R_k, the large-loss rejection, OPML's log det) and per-example state
indexed by training row stay identical in every process without further communication.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from spml_cache import backbone, datasets, runs
from spml_cache.datasets.base import find_missing
from spml_cache.devices import resolve_device
from spml_cache.errors import SpmlError

EVAL_BATCH_SIZE = 32
MISSING_SHOWN = 3


# --- images on disk --------------------------------------------------------------------------------------


def usable_rows(dataset: str, root: Path, ids: dict[str, list[str]], skip_missing: bool) -> tuple[Path, dict, str]:
    """The folder the ids are relative to (the dataset's layout at `root` or `root/<dataset>`), the rows per
    split whose image exists there, and a note on those left out; missing images are refused unless skipped."""
    if dataset in datasets.names():
        try:
            found = datasets.resolve_root(dataset, root)
            root = found.parent if found.is_file() else found  # a CSV root: ids are relative to its folder
        except SpmlError:
            pass  # annotations elsewhere or gone: the images may still be under root; the count below decides
    gone = {split: set(find_missing(root, split_ids)) for split, split_ids in ids.items()}
    rows = {split: np.array([r for r, i in enumerate(split_ids) if i not in gone[split]], dtype=np.int64)
            for split, split_ids in ids.items()}
    missing = [i for split, split_ids in ids.items() for i in split_ids if i in gone[split]]
    if not missing:
        return root, rows, ""
    shown = ", ".join(missing[:MISSING_SHOWN]) + (", ..." if len(missing) > MISSING_SHOWN else "")
    described = f"{len(missing)} of {sum(map(len, ids.values()))} images are missing under {root} ({shown})"
    if not skip_missing:
        raise SpmlError(f"{described}: pass --root DIR where the images are, or leave them out with --skip-missing")
    if any(len(split_rows) == 0 for split_rows in rows.values()):
        raise SpmlError(f"{described}, and a split has none left: check --root")
    return root, rows, f"skipping: {described}"


class ImageFiles(Dataset):
    """Item `row` is (row, the file's bytes), or (row, the decoded uint8 image) when `decode` is set.

    Workers only read (and, for a CPU run, decode); resizing, flipping and normalising happen on the device.
    """

    def __init__(self, root: Path, ids: list[str], decode: bool) -> None:
        self.paths = [root / i for i in ids]
        self.decode = decode

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, row: int):
        blob = torch.from_numpy(np.fromfile(self.paths[row], dtype=np.uint8))
        if self.decode:
            return row, backbone.decode_jpegs([blob], "cpu")[0]
        return row, blob


def _collate(items: list) -> tuple[list[int], list[torch.Tensor]]:
    return [row for row, _ in items], [image for _, image in items]


class EpochBatches(Sampler):
    """Training batches: a permutation of `rows` per epoch, cut into global batches of `batch_size` (a trailing
    partial batch is dropped, as the reference's training loader does); a process takes its contiguous share
    of each. `flips[row]` says whether the row's image is mirrored this epoch."""

    def __init__(self, rows: np.ndarray, num_rows_total: int, batch_size: int, seed: int, rank: int, world: int):
        self.rows, self.num_rows_total = torch.as_tensor(rows, dtype=torch.long), num_rows_total
        self.batch_size, self.share = batch_size, batch_size // world
        self.seed, self.rank = seed, rank
        self.set_epoch(1)

    def set_epoch(self, epoch: int) -> None:
        # (seed, epoch) alone decide the epoch's order and flips, so a resumed run redraws them exactly.
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        self.order = self.rows[torch.randperm(len(self.rows), generator=generator)]
        self.flips = torch.rand(self.num_rows_total, generator=generator) < 0.5

    def __len__(self) -> int:
        return len(self.rows) // self.batch_size

    def __iter__(self):
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            mine = start + self.rank * self.share
            yield self.order[mine : mine + self.share].tolist()


class ShardBatches(Sampler):
    """Evaluation batches: this process's contiguous shard of `rows`, in order."""

    def __init__(self, rows: np.ndarray, rank: int, world: int, batch_size: int = EVAL_BATCH_SIZE):
        bounds = np.linspace(0, len(rows), world + 1).round().astype(int)
        self.rows = [int(r) for r in rows[bounds[rank] : bounds[rank + 1]]]
        self.counts = np.diff(bounds).tolist()
        self.batch_size = batch_size

    def __len__(self) -> int:
        return -(-len(self.rows) // self.batch_size)

    def __iter__(self):
        for start in range(0, len(self.rows), self.batch_size):
            yield self.rows[start : start + self.batch_size]


def loader(files: ImageFiles, batches: Sampler, workers: int) -> DataLoader:
    return DataLoader(
        files, batch_sampler=batches, num_workers=workers, collate_fn=_collate, persistent_workers=workers > 0
    )


def model_input(images: list[torch.Tensor], resolution: int, device: torch.device, flips: torch.Tensor | None = None):
    """Decode (when given bytes) and preprocess on the device; mirror the rows where `flips` is set."""
    if images and images[0].dim() == 1:
        images = backbone.decode_jpegs(images, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch = backbone.preprocess(images, resolution, device, dtype)
    if flips is not None:
        # Mirroring commutes with the resize and the per-channel normalisation, so it can come last.
        mask = flips.to(device).view(-1, 1, 1, 1)
        batch = torch.where(mask, batch.flip(-1), batch).contiguous(memory_format=torch.channels_last)
    return batch


# --- data parallel ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Processes:
    """Where this process stands: `rank` of `world` processes, on `device`."""

    rank: int
    world: int
    device: torch.device
    owns_group: bool = False  # this run started the process group, so it ends it

    @property
    def main(self) -> bool:
        return self.rank == 0


def start_processes(device_name: str) -> Processes:
    """One process, or (under torchrun) join the process group: nccl on GPUs, gloo on the CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Processes(0, 1, resolve_device(device_name))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Processes(dist.get_rank(), dist.get_world_size(), device, owns_group)


def stop_processes(processes: Processes) -> None:
    if processes.owns_group and dist.is_initialized():
        dist.destroy_process_group()


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


# --- the linear stage's head (LinearInit) ----------------------------------------------------------------

THETA_CLIP = 1e-5
WEIGHT_NAMES = ("IMAGENET1K_V1", "IMAGENET1K_V2", "none")


@dataclass(frozen=True)
class LinearHead:
    """The selected head of one loss in a finished linear run, and what it was trained with."""

    run: Path
    loss: str
    weight: torch.Tensor  # [C, D]
    bias: torch.Tensor  # [C]
    loss_state: dict  # ROLE: {"theta": [1, N_train, C]}
    settings: dict  # lr, batch_size, seed, epoch
    hparams: dict
    val_map: float | None
    cache: str | None
    cache_id: str | None


def role_theta_handover(theta: torch.Tensor) -> torch.Tensor:
    """ROLE's label logits carried into fine-tuning: logit(clip(Q, 1e-5, 1 - 1e-5)) with Q = sigmoid(theta)."""
    q = torch.sigmoid(theta.double()).clamp(THETA_CLIP, 1 - THETA_CLIP)
    return torch.logit(q).to(theta.dtype)


def default_weights(cache_attrs: dict) -> str:
    """The weights that made the cache when they have a name (what LinearInit needs), else IMAGENET1K_V1."""
    weights = str(cache_attrs.get("weights", ""))
    return weights if weights in WEIGHT_NAMES else "IMAGENET1K_V1"


def newest_linear_run(runs_root: Path, dataset: str, loss: str, cache_id: str | None) -> Path:
    """The newest finished linear run of `dataset` under `runs_root` that trained `loss` (on that cache)."""
    folder = Path(runs_root) / dataset
    usable = []
    for path in sorted(folder.glob("linear-*")) if folder.is_dir() else []:
        if not (runs.is_complete(path) and (path / "best.pt").exists()):
            continue
        try:
            results = runs.read_json(path / runs.RESULTS)
        except SpmlError:  # a garbled results.json: not a run to start from
            continue
        if loss in results.get("losses", {}) and cache_id in (None, results.get("cache_id")):
            usable.append(path)
    if not usable:
        where = f"{folder}" + (f" on cache {cache_id}" if cache_id else "")
        raise SpmlError(
            f"no finished linear run of loss {loss} for {dataset} under {where}: create one with"
            f" `spml-cache linear --loss {loss} --dataset {dataset}` (or --cache FILE), or pass --from RUN or"
            " --init imagenet"
        )
    return max(usable, key=lambda path: (runs.run_stamp(path), path.name))


def read_linear_head(run: Path, loss: str | None) -> LinearHead:
    """Loss `loss`'s head from linear run `run` (default: the loss of best val mAP there)."""
    results = runs.load_results(run)
    if results.get("stage") != "linear":
        raise SpmlError(f"--from {run} is a {results.get('stage')} run; LinearInit starts from a linear run")
    trained = results["losses"]
    if loss is None:
        loss = max(trained, key=lambda name: trained[name].get("val_map") or -1.0)
    if loss not in trained:
        raise SpmlError(f"--from {run} trained {', '.join(trained)}, not {loss}: pass one of those to --loss")
    entry = runs.load_checkpoint(run / "best.pt").get(loss)
    if not isinstance(entry, dict) or "head" not in entry:
        raise SpmlError(f"{run / 'best.pt'} holds no head for {loss}: re-run spml-cache linear --loss {loss}")
    config = runs.read_json(run / "config.json") if (run / "config.json").exists() else {}
    return LinearHead(
        run=Path(run), loss=loss, weight=entry["head"]["weight"].float(), bias=entry["head"]["bias"].float(),
        loss_state=dict(entry.get("loss_state") or {}),
        settings={key: entry.get(key) for key in ("lr", "batch_size", "seed", "epoch")},
        hparams=dict(entry.get("hparams") or trained[loss].get("selected", {}).get("hparams") or {}),
        val_map=trained[loss].get("val_map"), cache=config.get("cache"), cache_id=config.get("cache_id"),
    )


def check_head(head: LinearHead, num_classes: int, num_train: int, cache_path: Path) -> None:
    """A head (and ROLE's theta) must fit the cache that fine-tuning reads."""
    rows, width = head.weight.shape
    if rows != num_classes or width != backbone.FEATURE_DIM:
        raise SpmlError(
            f"{head.run / 'best.pt'}: the {head.loss} head is [{rows}, {width}] but {cache_path} has {num_classes}"
            f" classes of {backbone.FEATURE_DIM}-d features: fine-tune with the cache that run used, or re-run"
            " spml-cache linear on this one"
        )
    theta = head.loss_state.get("theta")
    if theta is not None and tuple(theta.shape[-2:]) != (num_train, num_classes):
        raise SpmlError(
            f"{head.run / 'best.pt'}: ROLE's theta is {tuple(theta.shape)} but {cache_path} has {num_train} training"
            " rows: fine-tune with the cache that run used"
        )


def describe_start(head: LinearHead | None, options: dict) -> str:
    """The first line a fine-tuning run prints: where it starts from."""
    if head is None:
        return f"ImageNet init: a fresh {options['loss']} head on the {options['weights']} trunk ({options['cache']})"
    settings = ", ".join(f"{key.replace('_', ' ')} {value:g}" for key, value in head.settings.items()
                         if value is not None)
    val = f", val mAP {head.val_map:.2f}" if head.val_map is not None else ""
    return f"LinearInit from {head.run}: the {head.loss} head ({settings}{val})"
