"""Stage three: fine-tune the cache's backbone (any torchvision or timm trunk) end to end, from the best linear head
(LinearInit, Cole et al. 2021) or a fresh head.

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
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from spml_cache import losses, runs, trackers
from spml_cache.finetune import checkpoints, images as data, parallel
from spml_cache.finetune.labels import TrainLabels, loss_observed
from spml_cache.finetune.model import FineTuneModel, initial_model
from spml_cache.finetune.settings import Resumed, Setup, rerun_options, resolve
from spml_cache.finetune.start import role_theta_handover
from spml_cache.finetune.step import Training, make_optimizer, train_step
from spml_cache.labels import average_precision, take
from spml_cache.observation import DEFAULT_RULE
from spml_cache.options import FinetuneOptions, FinetunePlacement, from_keywords
from spml_cache.protocol import initial_head
from spml_cache.runtime import locks
from spml_cache.runtime.devices import default_workers
from spml_cache.runtime.errors import DiskFull, Interrupted, SpmlError, finished
from spml_cache.runtime.progress import progress_bar
from spml_cache.runs.results import FinetuneRun
from spml_cache.selection import HeadRecord, loss_results, select_config, stops_early


def run_finetune(options: FinetuneOptions, placement: FinetunePlacement = FinetunePlacement()) -> FinetuneRun | None:
    """Stage three's door (`spml-cache finetune`): fine-tune and write
    `placement.out/<dataset>/finetune-<backbone>-<loss>-<stamp>/`.

    Options left as None take the loss's recipe, the cache's or their declared default or, with
    `placement.resume`, the interrupted run's own (an option given that contradicts them is refused). The first
    line logged names the linear run and head the model starts from. Under torchrun rank 0 returns the run, the
    other processes None.
    """
    processes = parallel.start_processes(placement.device)
    say = placement.log if processes.main else (lambda line: None)
    if processes.device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # one input shape for training, one for scoring
    try:
        root = placement.root
        if placement.config is not None:  # a new run with a record's settings (refused beside --resume)
            options, recorded_root, line = rerun_options(placement.config, placement.resume, options)
            root = recorded_root if root is None else root
            say(line)
        resumed = Resumed.read(placement.resume) if placement.resume is not None else None
        workers = default_workers(processes.device) if placement.workers is None else placement.workers
        setup = resolve(options, resumed, root=root, out=placement.out, cache_dir=placement.cache_dir,
                        processes=processes, workers=workers)
        setup = replace(setup, initial=initial_model(setup))  # the trunk and head every config starts from
        for note in setup.notes + ([f"resuming {placement.resume}"] if resumed is not None else []):
            say(note)
        run_dir = placement.resume if resumed is not None else checkpoints.create_run_dir(placement.out, setup)
        if processes.main and placement.run_dir_made is not None:
            placement.run_dir_made(Path(run_dir))
        # one process at a time in a run directory (rank 0 speaks for a torchrun group, and logs to --log's trackers)
        with locks.held(run_dir, f"run directory {run_dir}") if processes.main else contextlib.nullcontext(), \
                trackers.watching(placement.trackers if processes.main else (), run_dir, say):
            results = _run_and_keep(setup, run_dir, resumed is not None, say)
        return FinetuneRun(Path(run_dir), results) if processes.main else None
    finally:
        parallel.stop_processes(processes)


def finetune(**keywords) -> dict:
    """`run_finetune` by keywords, for the Python API: each a field of `FinetuneOptions` (what the run trains) or of
    `FinetunePlacement` (where it runs), e.g. `finetune(init="best", dataset="voc", loss="role", root=...)`; the
    run's results with its `run_dir` (empty on torchrun's other processes)."""
    run = run_finetune(*from_keywords(keywords, FinetuneOptions, FinetunePlacement))
    return {} if run is None else {**run.results, "run_dir": str(run.run_dir)}


def _run_and_keep(setup: Setup, run_dir: Path, resumed: bool, say) -> dict:
    """The run's grid; a stop or a full disk keeps every finished epoch and says how to go on, an out-of-memory
    before any checkpoint leaves nothing."""
    processes, going_on = setup.processes, f"spml-cache finetune --resume {shlex.quote(str(run_dir))}"
    try:
        results = _run_grid(setup, run_dir, resumed=resumed, say=say)
        finished()  # the results are written: a stop now has nothing to stop
        return results
    except KeyboardInterrupt:
        if not processes.main:
            raise SystemExit(130) from None  # rank 0 says what was kept
        raise Interrupted(f"every finished epoch is kept in {run_dir / 'checkpoints'}", going_on) from None
    except DiskFull as full:  # every finished epoch is kept
        raise full.going_on(f"go on with: {going_on}") from None
    except torch.cuda.OutOfMemoryError:
        if not resumed and processes.main and not any(run_dir.glob("checkpoints/*.pt")):
            shutil.rmtree(run_dir, ignore_errors=True)  # nothing resumable in it yet
        raise SpmlError(
            f"CUDA out of memory on {processes.device} (resolution {setup.settings.options.resolution}, --batch-size"
            f" {setup.settings.options.batch_sizes}): pass a smaller --batch-size, or share each batch over more GPUs"
            " with torchrun --nproc-per-node N"
        ) from None


def _build_loss(setup: Setup, seed: int, device: torch.device) -> losses.Loss:
    features, settings = setup.features, setup.settings
    # no text side to pass: a loss that reads one needs a CLIP cache, whose tower is not fine-tuned (start.py)
    built = losses.build(settings.loss, num_classes=len(features.classes), num_train=len(features.train),
                         dataset=features.dataset, num_heads=1,
                         train_observed=loss_observed(settings.loss, features.train.observed), seed=seed,
                         fidelity=settings.options.fidelity, **settings.hparams)
    return built.to(device)


# --- training --------------------------------------------------------------------------------------------


def _run_grid(setup: Setup, run_dir: Path, resumed: bool, say) -> dict:
    settings, records, began = setup.settings, [], time.perf_counter()
    starts: dict = {}  # the starting models' scores, shared by the configs that start alike
    if setup.processes.main:
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        if resumed:
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # rebuilt from the checkpoints' histories
    for lr in settings.options.lrs:  # grid order as stage two's: lr, then batch size
        for batch_size in settings.options.batch_sizes:
            for seed in settings.seeds:
                record = HeadRecord(loss=settings.loss, lr=lr, batch_size=batch_size, seed=seed, rule=settings.rule)
                records.append(_train_config(setup, run_dir, record, starts, say))
    if setup.processes.world > 1:
        dist.barrier()  # rank 0 has written every best model
    selection = select_config(records)
    model = copy.deepcopy(setup.initial).to(setup.processes.device, memory_format=torch.channels_last)
    train_maps, saved, scores, tests = [], {}, {}, []
    for record in selection.records if selection else []:
        state = runs.load_checkpoint(checkpoints.checkpoint(run_dir, record, best=True))
        model.load_state_dict(state["model"])
        train = torch.sigmoid(_score(model, setup, "train"))
        train_maps.append(average_precision(train, _labels(setup, "train"))[1])
        tests.append(torch.sigmoid(_score(model, setup, "test")))  # every seed's: report's F1 family and intervals
        if record is selection.representative:
            saved = {"model": state["model"], "loss_state": state["loss_state"], "lr": record.lr,
                     "batch_size": record.batch_size, "seed": record.seed, "epoch": record.best_epoch,
                     "hparams": settings.hparams}
            scores = {"train": train, "val": torch.sigmoid(_score(model, setup, "val")), "test": tests[-1]}
    if not setup.processes.main:
        return {}
    entry = loss_results(records, selection, settings.hparams, train_maps, time.perf_counter() - began)
    if scores:
        per_seed = runs.SeedScores([r.seed for r in selection.records], torch.stack(tests), _labels(setup, "test"),
                                   _label_mask(setup, "test"))
        runs.write_scores(run_dir, settings.key, per_seed, **scores)
    features, rows = setup.features, setup.rows
    runs.write_labels(run_dir, train_labels=take(features.train.labels, rows["train"]),
                      train_observed=take(features.train.observed, rows["train"]),
                      val_labels=take(features.val.labels, rows["val"]), test_labels=_labels(setup, "test"),
                      test_mask=_label_mask(setup, "test"))
    if selection and all(record.start for record in selection.records):  # a run begun before epoch 0 had none
        entry.update(start_summary(selection.records, entry["test_map"]))
    if settings.rule != DEFAULT_RULE:
        entry = {"loss": settings.loss, "rule": settings.rule, **entry}
    results = runs.finish_run(run_dir, stage="finetune", features=features, losses={settings.key: entry},
                              checkpoints={settings.key: saved} if saved else {}, init=checkpoints.init_summary(setup),
                              fidelity=settings.options.fidelity)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return results


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
    training = _config_training(setup, record, checkpoint)
    if checkpoint is None:
        _score_start(setup, run_dir, record, training, starts, say)
    batches = data.EpochBatches(setup.rows["train"], len(features.train), record.batch_size, record.seed,
                                processes.rank, processes.world)
    files = data.ImageFiles(setup.root, features.train.ids, decode=settings.options.decode)
    train_loader = data.loader(files, batches, setup.workers)
    train_labels = TrainLabels(features.train.observed, features.train.labels, device)
    model, loss_fn = training.model, training.loss_fn
    epochs = settings.options.epochs
    for epoch in range(len(record.train_loss) + 1, epochs + 1):
        train_logits = None
        if loss_fn.needs_train_logits:
            train_logits = torch.zeros(1, len(features.train), len(features.classes), device=device)
            train_logits[0, torch.as_tensor(setup.rows["train"], device=device)] = _score(model, setup, "train")
        loss_fn.start_epoch(epoch, epochs, train_logits)
        batches.set_epoch(epoch)
        train_loss = _train_epoch(training, train_loader, batches, train_labels, _label(record, epoch, epochs))
        _evaluate(setup, run_dir, record, epoch, train_loss, training, say)
        done = epoch == epochs or record.diverged_epoch is not None or record.stopped_epoch is not None
        if processes.main:
            _save_config_epoch(run_dir, record, epoch, done, training)
        if done:
            break
    return record


def _config_training(setup: Setup, record: HeadRecord, checkpoint: dict | None) -> Training:
    """The config's model (LinearInit's head, or its seed's fresh one), loss and optimiser, on the device, in the
    state of its checkpoint when it has one; under torchrun the model steps through DistributedDataParallel."""
    processes, features, device = setup.processes, setup.features, setup.processes.device
    model = copy.deepcopy(setup.initial)
    if setup.start is None:
        model.head.weight.data, model.head.bias.data = initial_head(model.head.in_features, len(features.classes),
                                                                    record.seed)
    # channels_last as the inputs (and the extraction) are: also what keeps DDP's gradient buckets aligned.
    model = parallel.synchronise_batchnorm(model.to(device, memory_format=torch.channels_last), processes)
    loss_fn = _build_loss(setup, record.seed, device)
    if setup.start is not None and "theta" in setup.start.loss_state:
        loss_fn.theta.data.copy_(role_theta_handover(setup.start.loss_state["theta"]))
    optimizer = make_optimizer(model, loss_fn, record.lr, setup.settings.options.head_lr_mult)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        loss_fn.load_state_dict(checkpoint["loss_state"])
        torch.set_rng_state(checkpoint["rng"]["torch"])
        if checkpoint["rng"]["cuda"]:
            torch.cuda.set_rng_state_all(checkpoint["rng"]["cuda"])
    trainer = model if processes.world == 1 else DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
    return Training(model=model, trainer=trainer, loss_fn=loss_fn, optimizer=optimizer, preprocess=setup.preprocess,
                    processes=processes)


def _score_start(setup: Setup, run_dir: Path, record: HeadRecord, training: Training, starts: dict, say) -> None:
    """Epoch 0: val and test mAP of the model the config starts from, before any step. With LinearInit that is
    the linear run's head on the trunk that made the cache: the linear run's numbers again, on the same device."""
    kept = record.batch_size if training.loss_fn.drops_last else None  # as every epoch's evaluation
    key = (None if setup.start is not None else record.seed, kept)  # a fresh head is its seed's own
    if key not in starts:
        starts[key] = {f"{split}_map": _scored_split(training.model, setup, split, kept)[1]
                       for split in ("val", "test")}
    label = f"{_label(record, 0, setup.settings.options.epochs)} (the starting model, before any step)"
    scores = starts[key]
    if not all(math.isfinite(value) for value in scores.values()):  # never a NaN in the run's files
        say(f"{label}: its scores are not finite (val mAP {scores['val_map']}, test mAP {scores['test_map']})")
        return
    record.start = dict(scores)
    if setup.processes.main:
        runs.append_metrics(run_dir, record.metric_lines())
    say(f"{label}: val mAP {scores['val_map']:.2f}, test mAP {scores['test_map']:.2f}")


def _evaluate(setup: Setup, run_dir: Path, record: HeadRecord, epoch: int, train_loss: float, training: Training,
              say) -> None:
    """Score val and test after an epoch into `record` (and keep the model of a new best epoch), or mark the
    config diverged; stop it early where the fidelity's rule says so."""
    model, loss_fn, label = training.model, training.loss_fn, _label(record, epoch, setup.settings.options.epochs)
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
    say(f"{label}: train loss {train_loss:.4f}, val mAP {val_map:.2f}, test mAP {test_map:.2f}{best_note(record, epoch)}")
    rule = loss_fn.early_stop
    if rule and stops_early(record, *rule):
        record.stopped_epoch = epoch
        say(f"{label}: stopped early, as the paper's code does ({rule[0]} {rule[1]:g})")


def best_note(record: HeadRecord, epoch: int) -> str:
    """What an epoch's line says of `epoch` when it is the selected one so far: the best so far, or, below the
    starting model (epoch 0, which selection never takes), the best of the trained epochs, and below what."""
    if record.best_epoch != epoch:
        return ""
    start = (record.start or {}).get("val_map")
    if start is not None and record.best_val_map < start:
        return f" (the best trained epoch so far; below the starting model's val mAP {start:.2f})"
    return " (best so far)"


def _save_config_epoch(run_dir: Path, record: HeadRecord, epoch: int, done: bool, training: Training) -> None:
    """The config's checkpoint after an epoch (a finished config keeps only its record and its best model)."""
    path, on_cuda = checkpoints.checkpoint(run_dir, record), training.processes.device.type == "cuda"
    state = {"record": record.to_state(), "done": done}
    if not done:
        state.update(model=training.model.state_dict(), optimizer=training.optimizer.state_dict(),
                     loss_state=training.loss_fn.state_dict(),
                     rng={"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if on_cuda else []})
    runs.save_checkpoint(path, state)
    for stale in path.parent.glob(f"{path.stem}.best-*.pt"):
        if stale != checkpoints.checkpoint(run_dir, record, best=True):
            stale.unlink()
    runs.append_metrics(run_dir, record.metric_lines(epoch))


def _train_epoch(training: Training, train_loader, batches: data.EpochBatches, train_labels: TrainLabels,
                 label: str) -> float:
    """One epoch of steps over the config's batches; returns the mean training loss."""
    processes = training.processes
    training.trainer.train()
    total, steps = torch.zeros((), device=processes.device), 0
    with progress_bar(label, total=len(batches) * batches.batch_size, unit="img") as bar:
        for step, (rows, images) in enumerate(train_loader):
            batch_rows = batches.order[step * batches.batch_size : (step + 1) * batches.batch_size]
            index = batch_rows.to(processes.device)
            observed, labels = train_labels.batch(batch_rows, index, training.loss_fn.oracle)
            total += train_step(training, images, batches.flips[rows], observed, labels, index)
            steps += 1
            if processes.main:
                bar.advance(batches.batch_size)
    return total.item() / max(steps, 1)


@torch.no_grad()
def _score(model: FineTuneModel, setup: Setup, split: str, batch_size: int | None = None) -> torch.Tensor:
    """Logits `[N_used, C]` of the split's used rows (eval mode, no flip), gathered from every process; with
    `batch_size`, all but the last `N_used mod batch_size` rows (what the authors' evaluation loaders score)."""
    processes, device = setup.processes, setup.processes.device
    shards = data.ShardBatches(_rows(setup, split, batch_size), processes.rank, processes.world)
    files = data.ImageFiles(setup.root, getattr(setup.features, split).ids, decode=setup.settings.options.decode)
    model.eval()
    outputs = [torch.zeros(0, model.head.out_features, device=device)]
    for _, images in data.loader(files, shards, setup.workers):
        batch = data.model_input(images, setup.preprocess, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            pooled = model.trunk(batch)
        # The head in float32 on the trunk's output, as stage two applies it to the cache's features: in bf16 it
        # would round logits of 4 to 8 to steps of 1/32 (and tie the scores that rank the images).
        logits = model.head(pooled.float())
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
