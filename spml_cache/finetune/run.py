"""Stage three: fine-tune ResNet-50 end to end, from the best linear head (LinearInit, Cole et al. 2021) or a fresh head.

The images, splits and observed labels are the cache's rows (`root / id`), so fine-tuning sees exactly what the
linear stage saw. The recipe is the papers': R x R resize ignoring aspect ratio, random horizontal flip in
training, ImageNet normalisation, Adam without weight decay, BatchNorm in train mode. Selection is stage
two's (selection.py): per config the first epoch of best val mAP, the test mAP there, the config of best mean
val mAP over seeds. Every epoch leaves a checkpoint (model, optimiser, loss state, RNG, metric history) under
`checkpoints/`, so `--resume RUN` goes on where a killed run stopped. Under torchrun the processes share each
global batch (parallel.py); only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import copy
import math
import shlex
import shutil
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from spml_cache import losses, runs
from spml_cache.finetune import checkpoints, images as data, parallel
from spml_cache.finetune.labels import TrainLabels, loss_observed
from spml_cache.finetune.settings import FineTuneModel, FinetuneOptions, Resumed, Setup, resolve
from spml_cache.finetune.start import role_theta_handover
from spml_cache.labels import average_precision, take
from spml_cache.losses.base import Fidelity
from spml_cache.observation import DEFAULT_RULE
from spml_cache.protocol import initial_head
from spml_cache.runtime import locks
from spml_cache.runtime.devices import default_workers
from spml_cache.runtime.errors import DiskFull, Interrupted, SpmlError
from spml_cache.runtime.progress import progress_bar
from spml_cache.selection import HeadRecord, loss_results, select_config, stops_early


def finetune(
    *, init: str | None = None, from_run: Path | None = None, cache_path: Path | None = None,
    dataset: str | None = None, cache_dir: Path | str | None = None, root: Path | None = None, loss: str | None = None,
    weights: str | None = None, epochs: int | None = None, lrs: Sequence[float] | None = None,
    batch_sizes: Sequence[int] | None = None, resolution: int | None = None, seeds: int | None = None,
    hparams: dict[str, float] | None = None, head_lr_mult: float | None = None, skip_missing: bool | None = None,
    device: str = "auto", out: Path | str = "runs", resume: Path | None = None, workers: int | None = None,
    fidelity: Fidelity | str | None = None, log: Callable[[str], None] = lambda line: None,
) -> dict:
    """Fine-tune and write `out/<dataset>/finetune-<loss>-<stamp>/`; returns its results plus `run_dir`.

    `seeds` is a count (seeds 0..N-1), `hparams` loss hyperparameter overrides `{key: value}`. Options left as
    None take their defaults or, with `resume`, the interrupted run's values (options given must match those).
    The first line logged names the linear run and head the model starts from.
    """
    options = FinetuneOptions(
        init=init, from_run=from_run, cache=cache_path, dataset=dataset, loss=loss, weights=weights,
        resolution=resolution, epochs=epochs, lrs=None if lrs is None else list(lrs),
        batch_sizes=None if batch_sizes is None else list(batch_sizes), seeds=seeds, head_lr_mult=head_lr_mult,
        skip_missing=skip_missing, hparams=hparams, fidelity=fidelity,
    )
    processes = parallel.start_processes(device)
    say = log if processes.main else (lambda line: None)
    if processes.device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # one input shape for training, one for scoring
    try:
        resumed = Resumed.read(Path(resume)) if resume is not None else None
        workers = default_workers(processes.device) if workers is None else workers
        setup = resolve(options, resumed, root=root, out=Path(out), cache_dir=cache_dir, processes=processes,
                        workers=workers)
        for note in setup.notes + ([f"resuming {resume}"] if resume is not None else []):
            say(note)
        run_dir = Path(resume) if resume is not None else checkpoints.create_run_dir(Path(out), setup)
        # one process at a time in a run directory (rank 0 speaks for a torchrun group)
        with locks.held(run_dir, f"run directory {run_dir}") if processes.main else contextlib.nullcontext():
            try:
                return _run_grid(setup, run_dir, resumed=resume is not None, say=say)
            except KeyboardInterrupt:
                if not processes.main:
                    raise SystemExit(130) from None  # rank 0 says what was kept
                raise Interrupted(f"every finished epoch is kept in {run_dir / 'checkpoints'}",
                                  f"spml-cache finetune --resume {shlex.quote(str(run_dir))}") from None
            except DiskFull as full:  # every finished epoch is kept
                raise full.going_on(f"go on with: spml-cache finetune --resume {shlex.quote(str(run_dir))}") from None
            except torch.cuda.OutOfMemoryError:
                if resume is None and processes.main and not any(run_dir.glob("checkpoints/*.pt")):
                    shutil.rmtree(run_dir, ignore_errors=True)  # nothing resumable in it yet
                raise SpmlError(
                    f"CUDA out of memory on {processes.device} (resolution {setup.settings.resolution}, --batch-size"
                    f" {setup.settings.batch_sizes}): pass a smaller --batch-size, or share each batch over more GPUs"
                    " with torchrun --nproc-per-node N"
                ) from None
    finally:
        parallel.stop_processes(processes)


def _build_loss(setup: Setup, seed: int, device: torch.device) -> losses.Loss:
    features, settings = setup.features, setup.settings
    # no text side to pass: a loss that reads one needs a CLIP cache, whose tower is not fine-tuned (start.py)
    built = losses.build(settings.loss, num_classes=len(features.classes), dataset=features.dataset, num_heads=1,
                         train_observed=loss_observed(settings.loss, features.train.observed), seed=seed,
                         fidelity=settings.fidelity, **settings.hparams)
    return built.to(device)


# --- training --------------------------------------------------------------------------------------------


def _run_grid(setup: Setup, run_dir: Path, resumed: bool, say) -> dict:
    settings, records, began = setup.settings, [], time.perf_counter()
    starts: dict = {}  # the starting models' scores, shared by the configs that start alike
    if setup.processes.main:
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        if resumed:
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # rebuilt from the checkpoints' histories
    for lr in settings.lrs:  # grid order as stage two's: lr, then batch size
        for batch_size in settings.batch_sizes:
            for seed in settings.seeds:
                record = HeadRecord(settings.loss, lr, batch_size, seed, rule=settings.rule)
                records.append(_train_config(setup, run_dir, record, starts, say))
    if setup.processes.world > 1:
        dist.barrier()  # rank 0 has written every best model
    selection = select_config(records)
    model = copy.deepcopy(setup.initial).to(setup.processes.device, memory_format=torch.channels_last)
    train_maps, saved, scores = [], {}, {}
    for record in selection.records if selection else []:
        state = runs.load_checkpoint(checkpoints.checkpoint(run_dir, record, best=True))
        model.load_state_dict(state["model"])
        train = torch.sigmoid(_score(model, setup, "train"))
        train_maps.append(average_precision(train, _labels(setup, "train"))[1])
        if record is selection.representative:
            saved = {"model": state["model"], "loss_state": state["loss_state"], "lr": record.lr,
                     "batch_size": record.batch_size, "seed": record.seed, "epoch": record.best_epoch,
                     "hparams": settings.hparams}
            scores = {"train": train, **{s: torch.sigmoid(_score(model, setup, s)) for s in ("val", "test")}}
    if not setup.processes.main:
        return {}
    entry = loss_results(records, selection, settings.hparams, train_maps, time.perf_counter() - began)
    if scores:
        runs.write_scores(run_dir, settings.key, **scores)
    features, rows = setup.features, setup.rows
    runs.write_labels(run_dir, train_labels=take(features.train.labels, rows["train"]),
                      train_observed=take(features.train.observed, rows["train"]),
                      val_labels=take(features.val.labels, rows["val"]), test_labels=take(features.test.labels, rows["test"]))
    if selection and all(record.start for record in selection.records):  # a run begun before epoch 0 had none
        entry.update(start_summary(selection.records, entry["test_map"]))
    if settings.rule != DEFAULT_RULE:
        entry = {"loss": settings.loss, "rule": settings.rule, **entry}
    results = runs.finish_run(run_dir, stage="finetune", features=features, losses={settings.key: entry},
                              checkpoints={settings.key: saved} if saved else {}, init=checkpoints.init_summary(setup),
                              fidelity=settings.fidelity)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return {**results, "run_dir": str(run_dir)}


def start_summary(chosen: list[HeadRecord], test_map: float) -> dict:
    """results.json's `start`: the selected config's model before any step (epoch 0), mean over its seeds, and
    `below_start` when fine-tuning ended below it in test mAP."""
    start = {key: float(np.mean([record.start[key] for record in chosen])) for key in ("val_map", "test_map")}
    return {"start": start, "below_start": test_map < start["test_map"]}


def _label(record: HeadRecord, epoch: int, epochs: int) -> str:
    return f"lr {record.lr:g} batch {record.batch_size} seed {record.seed} epoch {epoch}/{epochs}"


def _train_config(setup: Setup, run_dir: Path, record: HeadRecord, starts: dict, say) -> HeadRecord:
    """Train one (lr, batch size, seed) for its epochs, from its checkpoint when it has one; returns its record."""
    processes, settings, features = setup.processes, setup.settings, setup.features
    device, path = processes.device, checkpoints.checkpoint(run_dir, record)
    if processes.world > 1:
        dist.barrier()  # every process has looked at this config's checkpoint before rank 0 writes its next one
    checkpoint = runs.load_checkpoint(path) if path.exists() else None
    if checkpoint is not None:
        record = HeadRecord.from_state(checkpoint["record"])
        if processes.main:
            runs.append_metrics(run_dir, record.metric_lines())
        if checkpoint["done"]:
            return record
    model, loss_fn, optimizer = _config_model(setup, record, checkpoint)
    if checkpoint is None:
        _score_start(setup, run_dir, record, model, loss_fn, starts, say)
    trainer = model if processes.world == 1 else DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
    batches = data.EpochBatches(setup.rows["train"], len(features.train), record.batch_size, record.seed,
                                processes.rank, processes.world)
    train_loader = data.loader(data.ImageFiles(setup.root, features.train.ids, decode=device.type == "cpu"), batches,
                               setup.workers)
    train_labels = TrainLabels(features.train.observed, features.train.labels, device)
    for epoch in range(len(record.train_loss) + 1, settings.epochs + 1):
        train_logits = None
        if loss_fn.needs_train_logits:
            train_logits = torch.zeros(1, len(features.train), len(features.classes), device=device)
            train_logits[0, torch.as_tensor(setup.rows["train"], device=device)] = _score(model, setup, "train")
        loss_fn.start_epoch(epoch, settings.epochs, train_logits)
        batches.set_epoch(epoch)
        label = _label(record, epoch, settings.epochs)
        train_loss = _train_epoch(trainer, model, loss_fn, optimizer, train_loader, batches, train_labels, setup,
                                  label)
        _evaluate(setup, run_dir, record, epoch, train_loss, model, loss_fn, label, say)
        done = epoch == settings.epochs or record.diverged_epoch is not None or record.stopped_epoch is not None
        if processes.main:
            _save_config_epoch(run_dir, path, record, epoch, done, model, optimizer, loss_fn, device)
        if done:
            break
    return record


def _config_model(setup: Setup, record: HeadRecord, checkpoint: dict | None):
    """The config's model (LinearInit's head, or its seed's fresh one), loss and optimiser, on the device, in the
    state of its checkpoint when it has one."""
    processes, features = setup.processes, setup.features
    model = copy.deepcopy(setup.initial)
    if setup.start is None:
        model.head.weight.data, model.head.bias.data = initial_head(model.head.in_features, len(features.classes),
                                                                    record.seed)
    # channels_last as the inputs (and the extraction) are: also what keeps DDP's gradient buckets aligned.
    model = parallel.synchronise_batchnorm(model.to(processes.device, memory_format=torch.channels_last), processes)
    loss_fn = _build_loss(setup, record.seed, processes.device)
    if setup.start is not None and "theta" in setup.start.loss_state:
        loss_fn.theta.data.copy_(role_theta_handover(setup.start.loss_state["theta"]))
    optimizer = make_optimizer(model, loss_fn, record.lr, setup.settings.head_lr_mult)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        loss_fn.load_state_dict(checkpoint["loss_state"])
        torch.set_rng_state(checkpoint["rng"]["torch"])
        if checkpoint["rng"]["cuda"]:
            torch.cuda.set_rng_state_all(checkpoint["rng"]["cuda"])
    return model, loss_fn, optimizer


def _score_start(setup: Setup, run_dir: Path, record: HeadRecord, model: FineTuneModel, loss_fn: losses.Loss,
                 starts: dict, say) -> None:
    """Epoch 0: val and test mAP of the model the config starts from, before any step. With LinearInit that is
    the linear run's head on the trunk that made the cache: the linear run's numbers again, on the same device."""
    kept = record.batch_size if loss_fn.drops_last else None  # as every epoch's evaluation
    key = (None if setup.start is not None else record.seed, kept)  # a fresh head is its seed's own
    if key not in starts:
        starts[key] = {f"{split}_map": _scored_split(model, setup, split, kept)[1] for split in ("val", "test")}
    label, scores = f"{_label(record, 0, setup.settings.epochs)} (the starting model, before any step)", starts[key]
    if not all(math.isfinite(value) for value in scores.values()):  # never a NaN in the run's files
        say(f"{label}: its scores are not finite (val mAP {scores['val_map']}, test mAP {scores['test_map']})")
        return
    record.start = dict(scores)
    if setup.processes.main:
        runs.append_metrics(run_dir, record.metric_lines())
    say(f"{label}: val mAP {scores['val_map']:.2f}, test mAP {scores['test_map']:.2f}")


def _evaluate(setup: Setup, run_dir: Path, record: HeadRecord, epoch: int, train_loss: float, model: FineTuneModel,
              loss_fn: losses.Loss, label: str, say) -> None:
    """Score val and test after an epoch into `record` (and keep the model of a new best epoch), or mark the
    config diverged; stop it early where the fidelity's rule says so."""
    if not math.isfinite(train_loss):
        record.diverged_epoch = epoch
        say(f"{label}: the loss is {train_loss}: diverged, stopped")
        return
    kept = record.batch_size if loss_fn.drops_last else None  # the authors' evaluation loaders may drop it too
    (val_ap, val_map), (test_ap, test_map) = (_scored_split(model, setup, split, kept) for split in ("val", "test"))
    if not (math.isfinite(val_map) and math.isfinite(test_map)):  # a NaN score: never a result
        record.diverged_epoch = epoch
        say(f"{label}: train loss {train_loss:.4f}, but the model's scores are not finite (val mAP {val_map}, test"
            f" mAP {test_map}): diverged, stopped")
        return
    if record.add_epoch(epoch, train_loss, val_map, test_map, test_ap.cpu().numpy()) and setup.processes.main:
        runs.save_checkpoint(checkpoints.checkpoint(run_dir, record, best=True),
                             {"model": model.state_dict(), "loss_state": loss_fn.state_dict()})
    say(f"{label}: train loss {train_loss:.4f}, val mAP {val_map:.2f}, test mAP {test_map:.2f}"
        + (" (best so far)" if record.best_epoch == epoch else ""))
    rule = loss_fn.early_stop
    if rule and stops_early(record, *rule):
        record.stopped_epoch = epoch
        say(f"{label}: stopped early, as the paper's code does ({rule[0]} {rule[1]:g})")


def _save_config_epoch(run_dir: Path, path: Path, record: HeadRecord, epoch: int, done: bool, model, optimizer,
                       loss_fn, device: torch.device) -> None:
    """The config's checkpoint after an epoch (a finished config keeps only its record and its best model)."""
    state = {"record": record.to_state(), "done": done}
    if not done:
        state.update(model=model.state_dict(), optimizer=optimizer.state_dict(), loss_state=loss_fn.state_dict(),
                     rng={"torch": torch.get_rng_state(),
                          "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else []})
    runs.save_checkpoint(path, state)
    for stale in path.parent.glob(f"{path.stem}.best-*.pt"):
        if stale != checkpoints.checkpoint(run_dir, record, best=True):
            stale.unlink()
    runs.append_metrics(run_dir, record.metric_lines(epoch))


def _train_epoch(trainer, model, loss_fn, optimizer, train_loader, batches, train_labels, setup, label) -> float:
    processes = setup.processes
    trainer.train()
    total, steps = torch.zeros((), device=processes.device), 0
    with progress_bar(label, total=len(batches) * batches.batch_size, unit="img") as bar:
        for step, (rows, images) in enumerate(train_loader):
            batch_rows = batches.order[step * batches.batch_size : (step + 1) * batches.batch_size]
            index = batch_rows.to(processes.device)
            observed, labels = train_labels.batch(batch_rows, index, loss_fn.oracle)
            total += train_step(trainer, model, loss_fn, optimizer, images, batches.flips[rows], observed, labels,
                                index, setup.preprocess, processes)
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
               observed: torch.Tensor, labels: torch.Tensor, index: torch.Tensor, preprocess,
               processes: parallel.Processes) -> torch.Tensor:
    """One optimiser step on a global batch (`observed`, `labels`, `index` are the global batch's; `images` and
    `flips` this process's share): device-side preprocessing, bf16 autocast on GPU, the loss on the gathered
    logits, the head-only penalty. Returns the loss (detached)."""
    x = data.model_input(images, preprocess, processes.device, flips)
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
def _score(model: FineTuneModel, setup: Setup, split: str, batch_size: int | None = None) -> torch.Tensor:
    """Logits `[N_used, C]` of the split's used rows (eval mode, no flip), gathered from every process; with
    `batch_size`, all but the last `N_used mod batch_size` rows (what the authors' evaluation loaders score)."""
    processes, device = setup.processes, setup.processes.device
    shards = data.ShardBatches(_rows(setup, split, batch_size), processes.rank, processes.world)
    files = data.ImageFiles(setup.root, getattr(setup.features, split).ids, decode=device.type == "cpu")
    model.eval()
    outputs = [torch.zeros(0, model.head.out_features, device=device)]
    for _, images in data.loader(files, shards, setup.workers):
        batch = data.model_input(images, setup.preprocess, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(batch).float()
        if device.type == "cuda":
            # bf16 has given non-finite rows on a GPU (as fp16 extraction has): those rows again in fp32. The
            # check costs a host sync per scoring batch, never one per training step.
            bad = ~torch.isfinite(logits).all(dim=1)
            if bool(bad.any()):
                logits[bad] = model(batch[bad].float())
        outputs.append(logits)
    return parallel.gather_rows(torch.cat(outputs), shards.counts, processes)


def _rows(setup: Setup, split: str, batch_size: int | None) -> np.ndarray:
    rows = setup.rows[split]
    return rows if batch_size is None else rows[: len(rows) - len(rows) % batch_size]


def _scored_split(model, setup: Setup, split: str, batch_size: int | None = None) -> tuple[torch.Tensor, float]:
    """The split's per-class AP and its mAP (partial labels: over annotated entries, classes with a positive)."""
    return average_precision(torch.sigmoid(_score(model, setup, split, batch_size)), _labels(setup, split, batch_size),
                    _label_mask(setup, split, batch_size))


def _label_mask(setup: Setup, split: str, batch_size: int | None = None):
    """The split's label mask on its rows (partial labels: 1 where annotated; dense or sparse), None where every
    label is known."""
    mask = getattr(setup.features, split).label_mask
    return take(mask, _rows(setup, split, batch_size))


def _labels(setup: Setup, split: str, batch_size: int | None = None):
    """The split's full labels on its rows, dense or sparse (on the host)."""
    return take(getattr(setup.features, split).labels, _rows(setup, split, batch_size))
