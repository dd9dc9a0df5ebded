"""Stage two (`spml-cache linear`): linear heads on cached features, the papers' linear-probe regime, fast.

Checks every input before anything is written, then for each loss and seed trains all (lr, batch size)
configs at once (`stacks.py`), selects per spec/protocol.md (`selection.py`) and writes the run directory
(docs/internals.md, "run directories"; `runs.py`).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from spml_cache import cache as cache_file
from spml_cache import losses as loss_registry
from spml_cache.cache import FeatureSet
from spml_cache.devices import resolve_device
from spml_cache.errors import SpmlError
from spml_cache.progress import console as progress_console
from spml_cache.protocol import EXPECTED_POSITIVES
from spml_cache.runs import (
    append_metrics, env_info, load_results, make_run_dir, read_linear_head, save_checkpoint, write_json, write_npz,
)
from spml_cache.selection import LiveTable, best_so_far, finish_loss
from spml_cache.stacks import LinearData, SeedRun

DEFAULT_LRS = (1e-2, 1e-3, 1e-4, 1e-5)
DEFAULT_BATCH_SIZES = (8, 16)
DEFAULT_EPOCHS = 25


# --- inputs: everything is checked before the run directory exists -----------------------------------------


@dataclass(frozen=True)
class LinearSettings:
    """The resolved grid of one `linear` run."""

    losses: list[str]
    lrs: list[float]
    batch_sizes: list[int]
    epochs: int
    seeds: list[int]
    overrides: dict  # per loss: the hyperparameters given (the built losses hold the resolved values)
    val_labels: str


def find_cache(cache: Path | str | None, dataset: str | None, cache_dir: Path | str) -> Path:
    """`--cache PATH`, or the one cache of `--dataset NAME` in the cache folder."""
    if cache is not None and dataset is not None:
        raise SpmlError("pass either --cache PATH or --dataset NAME, not both")
    if cache is not None:
        return Path(cache)
    if dataset is None:
        raise SpmlError("say which features to train on: --cache PATH or --dataset NAME")
    folder = Path(cache_dir)
    pattern = re.compile(rf"{re.escape(dataset)}-[^-]+-\d+\.h5")
    found = sorted(p for p in folder.glob(f"{dataset}-*.h5") if pattern.fullmatch(p.name))
    if len(found) == 1:
        return found[0]
    if found:
        names = ", ".join(p.name for p in found)
        raise SpmlError(f"several caches for '{dataset}' in {folder}/ ({names}): pick one with --cache PATH")
    partial = sorted(p.name for p in folder.glob(f"{dataset}-*.h5.partial"))
    if partial:
        raise SpmlError(f"{folder / partial[0]} is an unfinished extraction: resume it with "
                        f"`spml-cache extract {dataset} --root DIR`")
    raise SpmlError(f"no cache for dataset '{dataset}' in {folder}/ (set SPML_CACHE or pass --cache PATH); "
                    f"create one with `spml-cache extract {dataset} --root DIR`")


def parse_list(values, flag: str, kind: type) -> list:
    """A comma list (or a sequence) of positive numbers; a clear error naming the flag otherwise."""
    items = [v.strip() for v in values.split(",")] if isinstance(values, str) else list(values)
    items = [v for v in items if v != ""]
    if not items:
        raise SpmlError(f"{flag} is empty: give at least one value, e.g. {flag} {'1e-3' if kind is float else '8'}")
    try:
        parsed = [kind(v) for v in items]
    except (TypeError, ValueError):
        raise SpmlError(f"{flag} {values!r}: expected a comma list of {'numbers' if kind is float else 'integers'}") from None
    if any(not (v > 0) or (kind is float and not math.isfinite(v)) for v in parsed):
        raise SpmlError(f"{flag} {values!r}: every value must be positive")
    return list(dict.fromkeys(parsed))  # duplicates would train the same head twice


def resolve_losses(spec) -> list[str]:
    """`all`, one name, or a comma list (of names); each checked against the registry."""
    names = [n.strip() for n in spec.split(",")] if isinstance(spec, str) else list(spec)
    names = [n for n in names if n]
    if names == ["all"]:
        return loss_registry.names()
    if not names:
        raise SpmlError(f"--loss is empty: give a loss name, a comma list, or all ({', '.join(loss_registry.names())})")
    for name in names:
        loss_registry.get(name)  # raises with the valid names
    return list(dict.fromkeys(names))


def parse_hparams(items, losses: list[str]) -> dict[str, dict]:
    """`key=value` (every selected loss that has `key`) or `loss.key=value` (that loss only), per loss."""
    overrides: dict[str, dict] = {name: {} for name in losses}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SpmlError(f"--hp {item!r}: expected key=value or loss.key=value, e.g. --hp alpha=0.1")
        try:
            value = int(text) if text.strip().lstrip("-").isdigit() else float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise SpmlError(f"--hp {item!r}: the value must be a finite number")
        loss, dot, name = key.rpartition(".")
        if dot:
            if loss not in overrides:
                raise SpmlError(f"--hp {item!r}: loss '{loss}' is not among --loss ({', '.join(losses)})")
            targets = [loss]
        elif len(losses) == 1:
            targets = losses  # the loss itself reports an unknown name
        else:
            targets = [n for n in losses if name in loss_registry.get(n).defaults]
            if not targets:
                raise SpmlError(f"--hp {item!r}: none of the selected losses has a hyperparameter '{name}'")
        for target in targets:
            overrides[target][name] = value
    return overrides


def resolve_settings(losses, lrs, batch_sizes, epochs: int, seeds: int, hparams, val_labels: str) -> LinearSettings:
    names = resolve_losses(losses)
    if epochs < 1:
        raise SpmlError(f"--epochs {epochs}: must be at least 1")
    if seeds < 1:
        raise SpmlError(f"--seeds {seeds}: must be at least 1 (seeds 0..N-1 are run)")
    if val_labels not in ("clean", "observed"):
        raise SpmlError(f"--val-labels {val_labels!r}: use clean (full val labels) or observed")
    return LinearSettings(
        names, parse_list(lrs, "--lr", float), parse_list(batch_sizes, "--batch-size", int), epochs,
        list(range(seeds)), parse_hparams(hparams, names), val_labels,
    )


def resolved_hparams(settings: LinearSettings, features: FeatureSet) -> dict[str, dict]:
    """Build each loss once (one head) to check its hyperparameters; the values in use, per loss.

    A dataset without a published `k` (expected positives) takes the cache's own `expected_positives`.
    """
    resolved = {}
    for name in settings.losses:
        overrides = dict(settings.overrides[name])
        if "k" in loss_registry.get(name).defaults and "k" not in overrides and features.dataset not in EXPECTED_POSITIVES:
            overrides["k"] = float(features.attrs["expected_positives"])
        loss = loss_registry.build(
            name, num_classes=len(features.classes), dataset=features.dataset, num_heads=1,
            train_observed=torch.from_numpy(features.train.observed), seed=0, **overrides,
        )
        resolved[name] = dict(loss.hparams)
    return resolved


def start_heads(from_run: Path | str | None, losses: list[str], features: FeatureSet) -> dict[str, dict]:
    """`--from RUN`: per loss, the head its heads start from: RUN's selected head of the same loss, else RUN's
    best single-positive head (highest val mAP; never an oracle's, which saw the full labels). The loss's own
    state (ROLE's theta) comes along when it is the same loss on the same cache.
    `{loss: {"weight", "bias", "loss_state", "from"}}`; empty without `--from`."""
    if from_run is None:
        return {}
    trained = load_results(from_run).get("losses", {})
    fair = [name for name in trained if trained[name].get("val_map") is not None
            and name in loss_registry.names() and not loss_registry.get(name).oracle]
    fallback = max(fair, key=lambda name: trained[name]["val_map"], default=None)
    sources = {name: name if name in trained else fallback for name in losses}
    if None in sources.values():
        missing = [name for name, source in sources.items() if source is None]
        raise SpmlError(f"--from {from_run} has no head for {', '.join(missing)} and no single-positive head to"
                        " start from: pass a run that trained those losses")
    read = {source: read_linear_head(Path(from_run), source) for source in dict.fromkeys(sources.values())}
    num_classes, dim = len(features.classes), features.train.features.shape[1]
    same_cache = cache_file.cache_id(features.attrs)
    starts = {}
    for name in losses:
        head = read[sources[name]]
        if tuple(head.weight.shape) != (num_classes, dim) or (head.classes and list(head.classes) != features.classes):
            theirs = head.classes or [f"{head.weight.shape[0]} classes"]
            raise SpmlError(
                f"--from {from_run}: its heads predict {len(theirs)} classes ({', '.join(map(str, theirs[:3]))}, ...)"
                f" from {head.weight.shape[1]}-d features, but {features.path} has {num_classes} classes"
                f" ({', '.join(features.classes[:3])}, ...) of {dim}-d features: train on the cache that run used,"
                " or leave out --from"
            )
        keep_state = head.loss == name and head.cache_id == same_cache
        starts[name] = {"weight": head.weight, "bias": head.bias, "loss_state": head.loss_state if keep_state else {},
                        "from": {"run": str(head.run), "loss": head.loss, **head.settings}}
    return starts


# --- the run ---------------------------------------------------------------------------------------------

# Below this much work (training rows x epochs x (loss, seed) pairs) starting worker processes costs more than it
# saves; above it, each core trains its own jobs.
PARALLEL_MIN_WORK = 50_000


@dataclass(frozen=True)
class LinearRun:
    run_dir: Path
    results: dict


def resolve_workers(workers: int, device: torch.device, num_jobs: int, work: int) -> int:
    """`--workers`: a count, or 0 for auto (one per usable core on the CPU when there is enough work)."""
    if workers < 0:
        raise SpmlError(f"--workers {workers}: use a positive count, or 0 for automatic")
    if workers == 0:
        if device.type != "cpu" or work < PARALLEL_MIN_WORK:
            return 1
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        workers = cores
    return max(1, min(workers, num_jobs))


def run_linear(
    *, cache: Path | str | None = None, dataset: str | None = None, cache_dir: Path | str = "cache",
    losses="all", lrs=DEFAULT_LRS, batch_sizes=DEFAULT_BATCH_SIZES, epochs: int = DEFAULT_EPOCHS, seeds: int = 1,
    hparams=(), device: str = "auto", out: Path | str = "runs", val_labels: str = "clean", workers: int = 0,
    from_run: Path | str | None = None, console: Console | None = None,
) -> LinearRun:
    """`spml-cache linear`: train the (loss x lr x batch size x seed) grid, select, write a run directory.

    A job trains every lr of one (loss, seed) and its batch sizes; with `workers` > 1 each batch size is its
    own job, so that even one loss's grid spreads over the cores (same results either way). `from_run`: every
    head starts from that linear run's head (`start_heads`) instead of its seed's initialisation.
    """
    settings = resolve_settings(losses, lrs, batch_sizes, epochs, seeds, hparams, val_labels)
    target = resolve_device(device)
    features = cache_file.load(find_cache(cache, dataset, cache_dir))
    used = resolved_hparams(settings, features)
    starts = start_heads(from_run, settings.losses, features)
    pairs = [(name, index, seed) for name in settings.losses for index, seed in enumerate(settings.seeds)]
    split = [(name, index, seed, (size,)) for name, index, seed in pairs for size in settings.batch_sizes]
    workers = resolve_workers(workers, target, len(split), len(features.train) * settings.epochs * len(pairs))
    jobs = split if workers > 1 else [(name, index, seed, tuple(settings.batch_sizes)) for name, index, seed in pairs]
    data = LinearData.from_features(features, target, settings.val_labels)

    label = "all" if settings.losses == loss_registry.names() else "+".join(settings.losses)
    run_dir = make_run_dir("linear", features.dataset, label, root=out)
    write_json(run_dir / "config.json", {
        "stage": "linear", "dataset": features.dataset, "cache": str(features.path),
        "cache_id": cache_file.cache_id(features.attrs), "cache_attrs": features.attrs, "classes": features.classes,
        "losses": settings.losses, "lrs": settings.lrs, "batch_sizes": settings.batch_sizes,
        "epochs": settings.epochs, "seeds": settings.seeds, "hparams": used, "val_labels": settings.val_labels,
        "device": str(target), "workers": workers, "num_train": data.num_train, "num_val": data.num_val,
        "num_test": len(features.test), "feature_dim": data.train_features.shape[1],
        "from": {name: start["from"] for name, start in starts.items()} or None,
    })
    write_json(run_dir / "env.json", env_info(target))
    write_npz(run_dir / "labels.npz", train_labels=features.train.labels, train_observed=features.train.observed,
              val_labels=features.val.labels, test_labels=features.test.labels)

    def grid_order(record) -> tuple:  # seed, then lr, then batch size: selection breaks ties in this order
        return record.seed, settings.lrs.index(record.lr), settings.batch_sizes.index(record.batch_size)

    entries, checkpoint = {}, {}
    expected = {name: sum(1 for job in jobs if job[0] == name) for name in settings.losses}
    finished: dict[str, list] = {name: [] for name in settings.losses}
    progress: dict[tuple, dict] = {}
    with LiveTable(settings.losses, len(settings.seeds), settings.epochs, console or progress_console) as live:
        for (name, index, part), epoch_best, lines, job in _train_jobs(jobs, used, settings, data, features, workers, starts):
            append_metrics(run_dir, lines)
            if epoch_best is not None and name in finished:  # an epoch of a job of an unfinished loss
                progress.setdefault((name, index), {})[part] = epoch_best
                live.epoch(name, index, *merged_progress(progress[(name, index)].values()))
            if job is None:
                continue
            finished[name].append(job)
            if len(finished[name]) == expected[name]:  # every job of this loss is done
                done = finished.pop(name)
                records = sorted((record for records, _ in done for record in records), key=grid_order)
                seconds = sum(seconds for _, seconds in done)  # training time, summed over the loss's jobs
                entry, best = finish_loss(run_dir, name, records, used[name], data, seconds)
                entries[name] = entry
                if best is not None:
                    checkpoint[name] = best
                live.loss_done(name, entry)
    results = {"stage": "linear", "dataset": features.dataset, "cache_id": cache_file.cache_id(features.attrs),
               "complete": True, "losses": {name: entries[name] for name in settings.losses}}
    save_checkpoint(run_dir / "best.pt", {name: checkpoint[name] for name in settings.losses if name in checkpoint})
    write_json(run_dir / "results.json", results)  # last: its presence marks a finished run
    return LinearRun(run_dir, results)


def merged_progress(parts) -> tuple[int, dict | None]:
    """(epoch, best so far) of one (loss, seed) from its jobs' latest `(epoch, best_so_far)`."""
    parts = list(parts)
    bests = [best for _, best in parts if best is not None]
    return min(epoch for epoch, _ in parts), max(bests, key=lambda best: best["val_map"], default=None)


def _train_jobs(jobs, used, settings, data, features, workers, starts):
    """Train every job `(loss, seed index, seed, batch sizes)`; yields `((loss, seed index, batch sizes),
    progress, metrics lines, job)` events: `progress = (epoch, best_so_far)` after each epoch of a job,
    `job = (records, seconds)` when it is done. In-process the metrics lines come with each epoch; from worker
    processes, with the finished job."""
    if workers == 1:
        for name, index, seed, sizes in jobs:
            start = time.perf_counter()
            run = SeedRun(name, used[name], seed, settings.lrs, list(sizes), settings.epochs, data, starts.get(name))
            for epoch in range(1, settings.epochs + 1):
                lines = run.run_epoch(epoch)
                done = (run.records, time.perf_counter() - start) if epoch == settings.epochs else None
                yield (name, index, sizes), (epoch, best_so_far(run.records)), lines, done
        return
    # fork on Linux's CPU: the workers inherit the features already in memory, no second import or read. Spawn
    # elsewhere: CUDA cannot be forked, and macOS's system libraries are not fork-safe.
    forking = data.train_features.device.type == "cpu" and sys.platform.startswith("linux")
    context = multiprocessing.get_context("fork" if forking else "spawn")
    progress = context.Queue()
    source = data if forking else str(features.path)
    sys.stdout.flush()  # a forked worker flushes what it inherited when it exits
    sys.stderr.flush()
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                               initargs=(source, str(data.train_features.device), settings.val_labels, progress))
    try:
        pending = {
            pool.submit(_run_job, (name, index, sizes), name, used[name], seed, settings.lrs, list(sizes),
                        settings.epochs, starts.get(name)): (name, index, sizes)
            for name, index, seed, sizes in jobs
        }
        while pending:
            done, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            while not progress.empty():
                key, epoch_progress = progress.get()
                yield key, epoch_progress, [], None
            for future in done:
                records, lines, seconds = future.result()
                yield pending.pop(future), None, lines, (records, seconds)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_worker: dict = {}  # in a worker process: the training data and the progress queue


def _start_worker(source, device: str, val_labels: str, progress) -> None:
    """The training data: inherited (fork), or read from the cache file (spawn)."""
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP thread pool
    if not isinstance(source, LinearData):
        source = LinearData.from_features(cache_file.load(source), torch.device(device), val_labels)
    _worker.update(data=source, progress=progress)


def _run_job(key, name, hparams, seed, lrs, batch_sizes, epochs, start):
    """One job in a worker process: the same training as in-process, progress through the queue."""
    begin = time.perf_counter()
    run = SeedRun(name, hparams, seed, lrs, batch_sizes, epochs, _worker["data"], start)
    lines = []
    for epoch in range(1, epochs + 1):
        lines += run.run_epoch(epoch)
        _worker["progress"].put((key, (epoch, best_so_far(run.records))))
    return run.records, lines, time.perf_counter() - begin
