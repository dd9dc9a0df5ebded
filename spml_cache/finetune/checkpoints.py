"""Stage three's hand-overs and run directory: the linear run's head it starts from (LinearInit, with ROLE's label
matrix), the checks that head must pass, the run directory it writes (through `runs.py`), its per-config
checkpoints, and what a resumed run must agree with.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from spml_cache import backbone, cache, losses, runs
from spml_cache.errors import SpmlError
from spml_cache.selection import HeadRecord

if TYPE_CHECKING:  # settings.py imports this module: Setup and FinetuneSettings are named for annotations only
    from spml_cache.finetune.settings import FinetuneSettings, Setup

THETA_CLIP = 1e-5


def role_theta_handover(theta: torch.Tensor) -> torch.Tensor:
    """ROLE's label logits carried into fine-tuning: logit(clip(Q, 1e-5, 1 - 1e-5)) with Q = sigmoid(theta)."""
    q = torch.sigmoid(theta.double()).clamp(THETA_CLIP, 1 - THETA_CLIP)
    return torch.logit(q).to(theta.dtype)


def default_weights(cache_attrs: dict) -> str:
    """The weights that made the cache when they have a name (what LinearInit needs), else IMAGENET1K_V1."""
    weights = str(cache_attrs.get("weights", ""))
    return weights if weights in (*backbone.WEIGHT_NAMES, "none") else "IMAGENET1K_V1"


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


def describe_start(head: runs.LinearHead | None, settings: FinetuneSettings) -> str:
    """The first line a fine-tuning run prints: where it starts from."""
    if head is None:
        return f"ImageNet init: a fresh {settings.loss} head on the {settings.weights} trunk ({settings.cache})"
    described = ", ".join(f"{key.replace('_', ' ')} {value:g}" for key, value in head.settings.items()
                          if value is not None)
    val = f", val mAP {head.val_map:.2f}" if head.val_map is not None else ""
    return f"LinearInit from {head.run}: the {head.loss} head ({described}{val})"


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


def same_as_stored(given: dict, overrides: dict, stored: dict) -> None:
    """The options given with --resume must be the interrupted run's; else say what differs."""
    before = stored["options"]
    hparams = losses.overrides_for([before["loss"]], overrides)[before["loss"]]
    differs = [f"--hp {key}={value} vs {before['hparams'].get(key)}" for key, value in hparams.items()
               if before["hparams"].get(key) != value]
    for key, value in given.items():
        same_path = key in ("from_run", "cache") and Path(value).resolve() == Path(before.get(key) or "").resolve()
        if value != before.get(key) and not same_path:
            differs.append(f"{key} {value} vs {before.get(key)}")
    if differs:
        raise SpmlError(f"--resume {stored['run_dir']}: that run has another configuration"
                        f" ({'; '.join(differs)} there): resume with its settings, or start a new run")


def create_run_dir(out: Path, setup: Setup) -> Path:
    """Rank 0 makes the directory and writes config.json and env.json; every process learns its path."""
    run_dir = [None]
    if setup.processes.main:
        settings, features = setup.settings, setup.features
        grid = {"losses": [settings.loss], "lrs": settings.lrs, "batch_sizes": settings.batch_sizes,
                "epochs": settings.epochs, "seeds": settings.seeds, "hparams": {settings.loss: settings.hparams},
                "val_labels": "clean", "fidelity": settings.fidelity}
        run_dir[0] = runs.start_run(
            out, stage="finetune", label=settings.loss, features=features, device=setup.processes.device, grid=grid,
            processes=setup.processes.world, options=settings.as_dict(), root=str(setup.root),
            init=init_summary(setup),
            skipped_images={s: len(getattr(features, s)) - len(setup.rows[s]) for s in cache.SPLITS},
        )
    if setup.processes.world > 1:
        dist.broadcast_object_list(run_dir, src=0)
    return Path(run_dir[0])


def init_summary(setup: Setup) -> dict:
    if setup.start is None:
        return {"mode": "imagenet", "weights": setup.settings.weights}
    start = setup.start
    return {"mode": "best", "run": str(start.run), "loss": start.loss, **start.settings, "val_map": start.val_map,
            "weights": setup.settings.weights}


def checkpoint(run_dir: Path, record: HeadRecord, best: bool = False) -> Path:
    """The config's last checkpoint, or the model of its best epoch (named by the epoch, so that a kill between
    writing it and the checkpoint that records it leaves the recorded best model in place)."""
    tag = f"lr{record.lr:g}-b{record.batch_size}-s{record.seed}"
    return run_dir / "checkpoints" / (f"{tag}.best-{record.best_epoch}.pt" if best else f"{tag}.pt")
