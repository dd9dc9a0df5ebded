"""Stage three: fine-tune ResNet-50 end to end, from the best linear head (LinearInit, seed 002) or a fresh head.

The images, splits and observed labels are the cache's rows (`root / id`), so fine-tuning sees exactly what the
linear stage saw. The recipe is the papers': R x R resize ignoring aspect ratio, random horizontal flip in
training, ImageNet normalisation, Adam without weight decay, BatchNorm in train mode. Selection is stage
two's (selection.py): per config the first epoch of best val mAP, the test mAP there, the config of best mean
val mAP over seeds. Every epoch leaves a checkpoint (model, optimiser, loss state, RNG, metric history) under
`checkpoints/`, so `--resume RUN` goes on where a killed run stopped. Under torchrun the processes share each
global batch (parallel.py); only rank 0 writes.
"""

from __future__ import annotations

import copy
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from spml_cache import backbone, cache, heads, linear, losses, protocol, runs
from spml_cache import finetune_data as data
from spml_cache import parallel
from spml_cache.errors import SpmlError
from spml_cache.extract import default_workers
from spml_cache.progress import progress_bar
from spml_cache.selection import HeadRecord, loss_results, select_config

DEFAULT_LRS = [1e-5, 1e-4]
FULL_LR_GRID = [1e-2, 1e-3, 1e-4, 1e-5]
DEFAULT_BATCH_SIZES = [8, 16]
DEFAULT_EPOCHS = 10
# The papers' per-loss fine-tuning recipes, for what the user leaves unset.
#  gr: seed 001 Table 6 (batch, lr, epochs per dataset); its authors' code trains the head at 10x the lr.
#  ll_*: Kim et al.'s code (the LL losses compared in seed 001) trains the head at 10x the lr.
#  em, em_apl: seed 003 trains 10 epochs; APL's per-dataset defaults assume T = 10.
_GR = {"voc": (8, 1e-5, 8), "coco": (16, 1e-5, 8), "nus": (16, 1e-5, 10), "cub": (8, 5e-5, 10)}
RECIPES: dict[str, dict[str, dict]] = {
    "gr": {d: {"batch_sizes": [b], "lrs": [lr], "epochs": t, "head_lr_mult": 10.0} for d, (b, lr, t) in _GR.items()},
    **{name: {"*": {"head_lr_mult": 10.0}} for name in ("ll_r", "ll_ct", "ll_cp")},
    **{name: {"*": {"epochs": 10}} for name in ("em", "em_apl")},
}


class FineTuneModel(nn.Module):
    """The ResNet-50 trunk (to the pooled 2048-d vector) and the linear head: logits `[B, C]`."""

    def __init__(self, trunk: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.trunk, self.head = trunk, head

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(images))


@dataclass
class Setup:
    """Everything resolved and validated before anything is written."""

    options: dict  # what defines the results: stored in config.json, compared on --resume
    features: cache.FeatureSet
    root: Path  # the folder the cache's ids are relative to
    rows: dict[str, np.ndarray]  # the cache rows used per split (all, or those whose image exists)
    start: runs.LinearHead | None
    initial: FineTuneModel  # on the CPU; every config starts from a copy
    processes: parallel.Processes
    workers: int
    notes: list[str]


def finetune(
    *, init: str | None = None, from_run: Path | None = None, cache_path: Path | None = None,
    dataset: str | None = None, cache_dir: Path | str = "cache", root: Path | None = None, loss: str | None = None,
    weights: str | None = None, epochs: int | None = None, lrs=None, batch_sizes=None, resolution: int | None = None,
    seeds: int | None = None, hparams: list[str] | None = None, head_lr_mult: float | None = None,
    skip_missing: bool | None = None, device: str = "auto", out: Path | str = "runs", resume: Path | None = None,
    workers: int | None = None, log: Callable[[str], None] = lambda line: None,
) -> dict:
    """Fine-tune and write `out/<dataset>/finetune-<loss>-<stamp>/`; returns its results plus `run_dir`.

    `lrs` and `batch_sizes` are comma lists or sequences (`lrs="grid"`: 1e-2..1e-5), `seeds` a count (seeds
    0..N-1), `hparams` `key=value` items. Options left as None take their defaults or, with `resume`, the
    interrupted run's values (options given must match those). The first line logged names the linear run
    and head the model starts from.
    """
    given = {"init": init, "from_run": from_run and str(from_run), "cache": cache_path and str(cache_path),
             "dataset": dataset, "loss": loss, "weights": weights, "epochs": epochs, "resolution": resolution,
             "head_lr_mult": head_lr_mult, "skip_missing": skip_missing,
             "lrs": None if lrs is None else FULL_LR_GRID if lrs == "grid" else linear.parse_list(lrs, "--lr", float),
             "batch_sizes": None if batch_sizes is None else linear.parse_list(batch_sizes, "--batch-size", int),
             "seeds": None if seeds is None else list(range(linear.parse_list([seeds], "--seeds", int)[0]))}
    given = {key: value for key, value in given.items() if value is not None}
    processes = parallel.start_processes(device)
    say = log if processes.main else (lambda line: None)
    if processes.device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # one input shape for training, one for scoring
    try:
        stored = data.resumable(Path(resume)) if resume is not None else None
        setup = _resolve(given, hparams or [], stored, root, Path(out), Path(cache_dir), processes, workers)
        for note in setup.notes + ([f"resuming {resume}"] if resume is not None else []):
            say(note)
        run_dir = Path(resume) if resume is not None else data.create_run_dir(Path(out), setup)
        try:
            return _run_grid(setup, run_dir, resumed=resume is not None, say=say)
        except torch.cuda.OutOfMemoryError:
            if resume is None and processes.main and not any(run_dir.glob("checkpoints/*.pt")):
                shutil.rmtree(run_dir, ignore_errors=True)  # nothing resumable in it yet
            raise SpmlError(
                f"CUDA out of memory on {processes.device} (resolution {setup.options['resolution']}, --batch-size"
                f" {setup.options['batch_sizes']}): pass a smaller --batch-size, or share each batch over more GPUs"
                " with torchrun --nproc-per-node N"
            ) from None
    finally:
        parallel.stop_processes(processes)


# --- resolution: everything is checked before the run directory exists ------------------------------------


def _resolve(given: dict, hp_items: list, stored, root, out: Path, cache_dir: Path, processes, workers) -> Setup:
    if stored is not None:
        given = {**stored["options"], **data.same_as_stored(given, hp_items, stored)}
        root = root if root is not None else Path(stored["root"])
    options, features, start = _resolve_options(given, hp_items, out, cache_dir, processes)
    if stored is not None and cache.cache_id(features.attrs) != stored["cache_id"]:
        raise SpmlError(f"--resume {stored['run_dir']}: {features.path} was rebuilt since that run began;"
                        " start a new run")
    notes = [data.describe_start(start, options)]
    if root is None:
        raise SpmlError("no image root: pass --root DIR (where the cache was extracted from) or set SPML_DATA")
    ids = {split: getattr(features, split).ids for split in cache.SPLITS}
    image_root, rows, skipped = data.usable_rows(features.dataset, Path(root), ids, options["skip_missing"])
    notes += [skipped] if skipped else []
    trunk, provenance = backbone.build_trunk(options["weights"])
    if start is not None and provenance != features.attrs.get("weights"):
        notes.append(f"note: {features.path} was extracted with weights {features.attrs.get('weights')} but the trunk"
                     f" starts from {provenance}, so the start is not the linear stage's model (see --weights)")
    head = nn.Linear(backbone.FEATURE_DIM, len(features.classes))
    if start is not None:
        head.weight.data.copy_(start.weight)
        head.bias.data.copy_(start.bias)
    workers = default_workers(processes.device) if workers is None else workers
    return Setup(options, features, image_root, rows, start, FineTuneModel(trunk, head), processes, workers, notes)


def _resolve_options(given: dict, hp_items: list, out: Path, cache_dir: Path, processes):
    """Every option's value (given, else the loss's recipe, else the default), the cache, the starting head."""
    options = {"init": "best", **given}
    if options["init"] not in ("best", "imagenet"):
        raise SpmlError(f"--init {options['init']}: use best (LinearInit) or imagenet (a fresh head)")
    if options["init"] == "imagenet" and "from_run" in options:
        raise SpmlError("--from RUN names a linear run to start from: it goes with --init best, not --init imagenet")
    features = cache.load(options["cache"]) if "cache" in options else None
    start = _choose_head(options, features, out) if options["init"] == "best" else None
    if start is not None:
        options.update(from_run=str(start.run.resolve()), loss=start.loss)
    if "loss" not in options:
        raise SpmlError("--loss NAME is needed with --init imagenet (spml-cache losses lists the names)")
    if features is None:
        features = cache.load((start and start.cache) or linear.find_cache(None, options.get("dataset"), cache_dir))
    if options.get("dataset", features.dataset) != features.dataset:
        raise SpmlError(f"--dataset {options['dataset']} but {features.path} holds {features.dataset}:"
                        " drop one of them")
    options.update(cache=str(Path(features.path).resolve()), dataset=features.dataset)
    if start is not None:
        data.check_head(start, len(features.classes), len(features.train), features.path)
    recipe = RECIPES.get(options["loss"], {})
    defaults = {"lrs": DEFAULT_LRS, "batch_sizes": DEFAULT_BATCH_SIZES, "epochs": DEFAULT_EPOCHS, "head_lr_mult": 1.0,
                "seeds": [0], "skip_missing": False, "resolution": int(features.attrs["resolution"]),
                "weights": data.default_weights(features.attrs), **recipe.get("*", {}),
                **recipe.get(features.dataset, {})}
    options = {**defaults, **options}
    if "hparams" not in options:  # the linear head's values, then --hp; resolved as the linear stage does
        given_hparams = linear.parse_hparams(hp_items, [options["loss"]])[options["loss"]]
        overrides = {**(start.hparams if start else {}), **given_hparams}
        settings = linear.LinearSettings([options["loss"]], [], [], 0, [], {options["loss"]: overrides}, "clean")
        options["hparams"] = linear.resolved_hparams(settings, features)[options["loss"]]
    for flag, value, least in (("--epochs", options["epochs"], 1), ("--resolution", options["resolution"], 32)):
        if value < least:
            raise SpmlError(f"{flag} {value}: must be at least {least}")
    if not options["head_lr_mult"] > 0:
        raise SpmlError(f"--head-lr-mult {options['head_lr_mult']}: must be positive")
    parallel.check_batch_split(options["batch_sizes"], processes)
    return options, features, start


def _choose_head(options: dict, features: cache.FeatureSet | None, out: Path) -> runs.LinearHead:
    if "from_run" in options:
        return runs.read_linear_head(Path(options["from_run"]), options.get("loss"))
    dataset = features.dataset if features is not None else options.get("dataset")
    if dataset is None or "loss" not in options:
        raise SpmlError("--init best needs --loss and --dataset (or --cache) to find the newest linear run,"
                        " or --from RUN")
    cache_id = cache.cache_id(features.attrs) if features is not None else None
    return runs.read_linear_head(data.newest_linear_run(out, dataset, options["loss"], cache_id), options["loss"])


def _build_loss(options: dict, features: cache.FeatureSet, seed: int, device: torch.device) -> losses.Loss:
    built = losses.build(options["loss"], num_classes=len(features.classes), dataset=features.dataset, num_heads=1,
                         train_observed=torch.from_numpy(features.train.observed), seed=seed, **options["hparams"])
    return built.to(device)


# --- training --------------------------------------------------------------------------------------------


def _run_grid(setup: Setup, run_dir: Path, resumed: bool, say) -> dict:
    options, records, began = setup.options, [], time.perf_counter()
    if setup.processes.main:
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        if resumed:
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # rebuilt from the checkpoints' histories
    for lr in options["lrs"]:  # grid order as stage two's: lr, then batch size
        for batch_size in options["batch_sizes"]:
            for seed in options["seeds"]:
                records.append(_train_config(setup, run_dir, HeadRecord(options["loss"], lr, batch_size, seed), say))
    if setup.processes.world > 1:
        dist.barrier()  # rank 0 has written every best model
    selection = select_config(records)
    model = copy.deepcopy(setup.initial).to(setup.processes.device, memory_format=torch.channels_last)
    train_maps, saved, scores = [], {}, {}
    for record in selection.records if selection else []:
        state = runs.load_checkpoint(data.checkpoint(run_dir, record, best=True))
        model.load_state_dict(state["model"])
        train = torch.sigmoid(_score(model, setup, "train"))
        train_maps.append(protocol.mean_average_precision(train, _labels(setup, "train")))
        if record is selection.representative:
            saved = {"model": state["model"], "loss_state": state["loss_state"], "lr": record.lr,
                     "batch_size": record.batch_size, "seed": record.seed, "epoch": record.best_epoch,
                     "hparams": options["hparams"]}
            scores = {"train": train, **{s: torch.sigmoid(_score(model, setup, s)) for s in ("val", "test")}}
    if not setup.processes.main:
        return {}
    entry = loss_results(records, selection, options["hparams"], train_maps, time.perf_counter() - began)
    results = {"stage": "finetune", "dataset": options["dataset"], "cache_id": cache.cache_id(setup.features.attrs),
               "complete": True, "init": data.init_summary(setup), "losses": {options["loss"]: entry}}
    runs.save_checkpoint(run_dir / "best.pt", {options["loss"]: saved} if saved else {})
    if scores:
        runs.write_npz(run_dir / "scores" / f"{options['loss']}.npz",
                       **{split: values.cpu().numpy().astype(np.float16) for split, values in scores.items()})
    runs.write_npz(run_dir / "labels.npz", train_observed=setup.features.train.observed[setup.rows["train"]],
                   **{f"{s}_labels": getattr(setup.features, s).labels[setup.rows[s]] for s in cache.SPLITS})
    runs.write_json(run_dir / runs.RESULTS, results)  # last: its presence marks a finished run
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return {**results, "run_dir": str(run_dir)}


def _train_config(setup: Setup, run_dir: Path, record: HeadRecord, say) -> HeadRecord:
    processes, options, features = setup.processes, setup.options, setup.features
    device, path = processes.device, data.checkpoint(run_dir, record)
    if processes.world > 1:
        dist.barrier()  # every process has looked at this config's checkpoint before rank 0 writes its next one
    checkpoint = runs.load_checkpoint(path) if path.exists() else None
    if checkpoint is not None:
        record = data.record_from(checkpoint["record"])
        if processes.main:
            runs.append_metrics(run_dir, data.metric_lines(record))
        if checkpoint["done"]:
            return record
    model = copy.deepcopy(setup.initial)
    if setup.start is None:
        model.head.weight.data, model.head.bias.data = heads.linear_init(backbone.FEATURE_DIM, len(features.classes),
                                                                         record.seed)
    # channels_last as the inputs (and the extraction) are: also what keeps DDP's gradient buckets aligned.
    model = parallel.synchronise_batchnorm(model.to(device, memory_format=torch.channels_last), processes)
    loss_fn = _build_loss(options, features, record.seed, device)
    if setup.start is not None and "theta" in setup.start.loss_state:
        loss_fn.theta.data.copy_(data.role_theta_handover(setup.start.loss_state["theta"]))
    lr = record.lr
    optimizer = make_optimizer(model, loss_fn, lr, options["head_lr_mult"])
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        loss_fn.load_state_dict(checkpoint["loss_state"])
        torch.set_rng_state(checkpoint["rng"]["torch"])
        if checkpoint["rng"]["cuda"]:
            torch.cuda.set_rng_state_all(checkpoint["rng"]["cuda"])
    trainer = model if processes.world == 1 else DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
    batches = data.EpochBatches(setup.rows["train"], len(features.train), record.batch_size, record.seed,
                                processes.rank, processes.world)
    train_loader = data.loader(data.ImageFiles(setup.root, features.train.ids, decode=device.type == "cpu"), batches,
                               setup.workers)
    observed = torch.from_numpy(features.train.observed).to(device)
    labels = torch.from_numpy(features.train.labels).to(device)
    for epoch in range(len(record.train_loss) + 1, options["epochs"] + 1):
        train_logits = None
        if loss_fn.needs_train_logits:
            train_logits = torch.zeros(1, len(features.train), len(features.classes), device=device)
            train_logits[0, torch.as_tensor(setup.rows["train"], device=device)] = _score(model, setup, "train")
        loss_fn.start_epoch(epoch, options["epochs"], train_logits)
        batches.set_epoch(epoch)
        label = f"lr {lr:g} batch {record.batch_size} seed {record.seed} epoch {epoch}/{options['epochs']}"
        train_loss = _train_epoch(trainer, model, loss_fn, optimizer, train_loader, batches, observed, labels, setup,
                                  label)
        if math.isfinite(train_loss):
            val_ap, test_ap = (protocol.average_precision(torch.sigmoid(_score(model, setup, split)),
                                                          _labels(setup, split)) for split in ("val", "test"))
            val_map, test_map = 100 * val_ap.mean().item(), 100 * test_ap.mean().item()
            if record.add_epoch(epoch, train_loss, val_map, test_map, test_ap.cpu().numpy()) and processes.main:
                runs.save_checkpoint(data.checkpoint(run_dir, record, best=True),
                                     {"model": model.state_dict(), "loss_state": loss_fn.state_dict()})
            say(f"{label}: train loss {train_loss:.4f}, val mAP {val_map:.2f}, test mAP {test_map:.2f}"
                + (" (best so far)" if record.best_epoch == epoch else ""))
        else:
            record.diverged_epoch = epoch
            say(f"{label}: the loss is {train_loss}: diverged, stopped")
        done = epoch == options["epochs"] or record.diverged_epoch is not None
        if processes.main:
            state = {"record": data.record_state(record), "done": done}
            if not done:  # a finished config keeps only its record (and its best model)
                state.update(model=model.state_dict(), optimizer=optimizer.state_dict(),
                             loss_state=loss_fn.state_dict(), rng={"torch": torch.get_rng_state(),
                                  "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else []})
            runs.save_checkpoint(path, state)
            for stale in path.parent.glob(f"{path.stem}.best-*.pt"):
                if stale != data.checkpoint(run_dir, record, best=True):
                    stale.unlink()
            runs.append_metrics(run_dir, data.metric_lines(record, epoch))
        if done:
            break
    return record


def _train_epoch(trainer, model, loss_fn, optimizer, train_loader, batches, observed, labels, setup, label) -> float:
    processes = setup.processes
    trainer.train()
    total, steps = torch.zeros((), device=processes.device), 0
    with progress_bar(label, total=len(batches) * batches.batch_size, unit="img") as bar:
        for step, (rows, images) in enumerate(train_loader):
            index = batches.order[step * batches.batch_size : (step + 1) * batches.batch_size].to(processes.device)
            total += train_step(trainer, model, loss_fn, optimizer, images, batches.flips[rows], observed[index],
                                labels[index], index, setup.options["resolution"], processes)
            steps += 1
            if processes.main:
                bar.advance(batches.batch_size)
    return total.item() / max(steps, 1)


def make_optimizer(model: FineTuneModel, loss_fn: losses.Loss, lr: float, head_lr_mult: float = 1.0):
    """Adam without weight decay: the trunk at lr, the head at head_lr_mult x lr, the loss's own parameters
    (ROLE's theta) at their lr_mult x lr."""
    groups = [{"params": list(model.trunk.parameters()), "lr": lr},
              {"params": list(model.head.parameters()), "lr": lr * head_lr_mult}]
    groups += [{"params": [p], "lr": lr * getattr(p, "lr_mult", 1.0)} for p in loss_fn.parameters()]
    return torch.optim.Adam(groups, lr=lr, weight_decay=0.0)


def train_step(trainer: nn.Module, model: FineTuneModel, loss_fn: losses.Loss, optimizer, images: list, flips,
               observed: torch.Tensor, labels: torch.Tensor, index: torch.Tensor, resolution: int,
               processes: parallel.Processes) -> torch.Tensor:
    """One optimiser step on a global batch (`observed`, `labels`, `index` are the global batch's; `images` and
    `flips` this process's share): device-side preprocessing, bf16 autocast on GPU, the loss on the gathered
    logits, the head-only penalty. Returns the loss (detached)."""
    x = data.model_input(images, resolution, processes.device, flips)
    with torch.autocast(processes.device.type, dtype=torch.bfloat16, enabled=processes.device.type == "cuda"):
        local_logits = trainer(x)
    logits = parallel.global_batch(local_logits.float(), processes)
    value = loss_fn(logits, observed, labels=labels, index=index)
    value = value + loss_fn.penalty(model.head.weight.t())  # L1R/L2R: on the head only
    optimizer.zero_grad(set_to_none=True)
    value.backward()
    optimizer.step()
    return value.detach()


@torch.no_grad()
def _score(model: FineTuneModel, setup: Setup, split: str) -> torch.Tensor:
    """Logits `[N_used, C]` of the split's used rows (eval mode, no flip), gathered from every process."""
    processes, device = setup.processes, setup.processes.device
    shards = data.ShardBatches(setup.rows[split], processes.rank, processes.world)
    files = data.ImageFiles(setup.root, getattr(setup.features, split).ids, decode=device.type == "cpu")
    model.eval()
    outputs = [torch.zeros(0, model.head.out_features, device=device)]
    for _, images in data.loader(files, shards, setup.workers):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            outputs.append(model(data.model_input(images, setup.options["resolution"], device)).float())
    return parallel.gather_rows(torch.cat(outputs), shards.counts, processes)


def _labels(setup: Setup, split: str) -> torch.Tensor:
    return torch.from_numpy(getattr(setup.features, split).labels[setup.rows[split]]).to(setup.processes.device)
