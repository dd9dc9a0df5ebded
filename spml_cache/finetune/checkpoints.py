"""Stage three's run directory: the config.json and env.json it starts with (through `runs/`), what its
results say it started from, and its per-config checkpoints (the last epoch's state, and the model of the
config's best epoch), which `--resume` goes on from.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from spml_cache import cache, runs
from spml_cache.finetune.settings import Setup
from spml_cache.selection import HeadRecord


def create_run_dir(out: Path, setup: Setup) -> Path:
    """Rank 0 makes the directory and writes config.json and env.json; every process learns its path."""
    run_dir = [None]
    if setup.processes.main:
        settings, features = setup.settings, setup.features
        run_dir[0] = runs.start_run(
            out, stage="finetune", label=settings.key, features=features, device=setup.processes.device,
            options=settings.options.stored(), losses=[settings.loss], processes=setup.processes.world,
            root=str(setup.root),
            skipped_images={s: len(getattr(features, s)) - len(setup.rows[s]) for s in cache.SPLITS},
        )
    if setup.processes.world > 1:
        dist.broadcast_object_list(run_dir, src=0)
    return Path(run_dir[0])


def init_summary(setup: Setup) -> dict:
    if setup.start is None:
        return {"mode": "imagenet", "weights": setup.settings.options.weights}
    start = setup.start
    return {"mode": "best", "run": str(start.run), "loss": start.loss, **start.settings, "val_map": start.val_map,
            "weights": setup.settings.options.weights}


def checkpoint(run_dir: Path, record: HeadRecord, best: bool = False) -> Path:
    """The config's last checkpoint, or the model of its best epoch (named by the epoch, so that a kill between
    writing it and the checkpoint that records it leaves the recorded best model in place)."""
    tag = f"lr{record.lr:g}-b{record.batch_size}-s{record.seed}"
    return run_dir / "checkpoints" / (f"{tag}.best-{record.best_epoch}.pt" if best else f"{tag}.pt")
