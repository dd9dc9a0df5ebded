"""Stage three's inputs: the linear run's head (LinearInit), the cache's images on disk, the batches of one or
several processes (their collectives are in parallel.py), the device-side augmentation, and the run directory.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Sampler

from spml_cache import backbone, cache, datasets, linear, runs
from spml_cache.datasets.base import find_missing
from spml_cache.errors import SpmlError
from spml_cache.selection import HeadRecord

if TYPE_CHECKING:  # finetune.py imports this module, so Setup is named only for the annotations
    from spml_cache.finetune import Setup

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


# --- the linear stage's head (LinearInit) ----------------------------------------------------------------

THETA_CLIP = 1e-5
WEIGHT_NAMES = ("IMAGENET1K_V1", "IMAGENET1K_V2", "none")


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


def check_head(head: runs.LinearHead, num_classes: int, num_train: int, cache_path: Path) -> None:
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


# --- the run directory -----------------------------------------------------------------------------------


def resumable(run_dir: Path) -> dict:
    if not (run_dir / "config.json").exists():
        raise SpmlError(f"--resume {run_dir}: not a run directory (no config.json)")
    config = runs.read_json(run_dir / "config.json")
    if config.get("stage") != "finetune":
        raise SpmlError(f"--resume {run_dir}: a {config.get('stage')} run; only fine-tuning runs resume here")
    if runs.is_complete(run_dir):
        raise SpmlError(f"--resume {run_dir}: that run is already complete (results.json)")
    return {**config, "run_dir": str(run_dir)}


def same_as_stored(given: dict, hp_items: list, stored: dict) -> dict:
    """The options given with --resume, which must be the interrupted run's; else say what differs."""
    before = stored["options"]
    hparams = linear.parse_hparams(hp_items, [before["loss"]])[before["loss"]]
    differs = [f"--hp {key}={value} vs {before['hparams'].get(key)}" for key, value in hparams.items()
               if before["hparams"].get(key) != value]
    for key, value in given.items():
        same_path = key in ("from_run", "cache") and Path(value).resolve() == Path(before.get(key) or "").resolve()
        if value != before.get(key) and not same_path:
            differs.append(f"{key} {value} vs {before.get(key)}")
    if differs:
        raise SpmlError(f"--resume {stored['run_dir']}: that run has another configuration"
                        f" ({'; '.join(differs)} there): resume with its settings, or start a new run")
    return given


def create_run_dir(out: Path, setup: Setup) -> Path:
    """Rank 0 makes the directory and writes config.json and env.json; every process learns its path."""
    run_dir = [None]
    if setup.processes.main:
        options, features = setup.options, setup.features
        run_dir[0] = runs.make_run_dir("finetune", options["dataset"], options["loss"], out)
        runs.write_json(run_dir[0] / "config.json", {
            "stage": "finetune", "dataset": options["dataset"], "cache": options["cache"],
            "cache_id": cache.cache_id(features.attrs), "cache_attrs": features.attrs, "classes": features.classes,
            "losses": [options["loss"]], "lrs": options["lrs"], "batch_sizes": options["batch_sizes"],
            "epochs": options["epochs"], "seeds": options["seeds"], "hparams": {options["loss"]: options["hparams"]},
            "val_labels": "clean", "device": str(setup.processes.device), "processes": setup.processes.world,
            "options": options, "root": str(setup.root), "init": init_summary(setup),
            "skipped_images": {s: len(getattr(features, s)) - len(setup.rows[s]) for s in cache.SPLITS},
        })
        runs.write_json(run_dir[0] / "env.json", runs.env_info(setup.processes.device))
    if setup.processes.world > 1:
        dist.broadcast_object_list(run_dir, src=0)
    return Path(run_dir[0])


def init_summary(setup: Setup) -> dict:
    if setup.start is None:
        return {"mode": "imagenet", "weights": setup.options["weights"]}
    start = setup.start
    return {"mode": "best", "run": str(start.run), "loss": start.loss, **start.settings, "val_map": start.val_map,
            "weights": setup.options["weights"]}


def checkpoint(run_dir: Path, record: HeadRecord, best: bool = False) -> Path:
    """The config's last checkpoint, or the model of its best epoch (named by the epoch, so that a kill between
    writing it and the checkpoint that records it leaves the recorded best model in place)."""
    tag = f"lr{record.lr:g}-b{record.batch_size}-s{record.seed}"
    return run_dir / "checkpoints" / (f"{tag}.best-{record.best_epoch}.pt" if best else f"{tag}.pt")


def record_state(record: HeadRecord) -> dict:
    """A HeadRecord as plain values (weights_only-loadable); `record_from` inverts it."""
    state = {f.name: getattr(record, f.name) for f in fields(HeadRecord) if f.name != "best_state"}
    state["best_test_ap"] = None if record.best_test_ap is None else torch.from_numpy(np.asarray(record.best_test_ap))
    return state


def record_from(state: dict) -> HeadRecord:
    best_test_ap = state["best_test_ap"]
    return HeadRecord(**{**state, "best_test_ap": None if best_test_ap is None else best_test_ap.numpy()})


def metric_lines(record: HeadRecord, first: int = 1) -> list[dict]:
    """The metrics.jsonl lines of `record`'s epochs from `first` on (the diverged epoch last, as linear's)."""
    keys = {"loss": record.loss, "lr": record.lr, "batch_size": record.batch_size, "seed": record.seed}
    lines = [{**keys, "epoch": e + 1, "train_loss": t, "val_map": v, "test_map": m}
             for e, (t, v, m) in enumerate(zip(record.train_loss, record.val_map, record.test_map))]
    if record.diverged_epoch is not None:
        lines.append({**keys, "epoch": record.diverged_epoch, "train_loss": None, "val_map": None, "test_map": None,
                      "diverged": True})
    return lines[first - 1 :]
