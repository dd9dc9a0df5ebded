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
from spml_cache.runs import append_metrics, env_info, make_run_dir, save_checkpoint, write_json, write_npz
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


# --- the run ---------------------------------------------------------------------------------------------

# Below this much work (training rows x epochs x (loss, seed) jobs) starting worker processes costs more than
# it saves; above it, each core trains its own (loss, seed) jobs.
PARALLEL_MIN_WORK = 100_000


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
    console: Console | None = None,
) -> LinearRun:
    """`spml-cache linear`: train the (loss x lr x batch size x seed) grid, select, write a run directory.

    Each (loss, seed) is one job; `workers` > 1 trains jobs in parallel processes (same results).
    """
    settings = resolve_settings(losses, lrs, batch_sizes, epochs, seeds, hparams, val_labels)
    target = resolve_device(device)
    features = cache_file.load(find_cache(cache, dataset, cache_dir))
    used = resolved_hparams(settings, features)
    jobs = [(name, index, seed) for name in settings.losses for index, seed in enumerate(settings.seeds)]
    workers = resolve_workers(workers, target, len(jobs), len(features.train) * settings.epochs * len(jobs))
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
    })
    write_json(run_dir / "env.json", env_info(target))
    write_npz(run_dir / "labels.npz", train_labels=features.train.labels, train_observed=features.train.observed,
              val_labels=features.val.labels, test_labels=features.test.labels)

    entries, checkpoint = {}, {}
    finished: dict[str, dict[int, tuple]] = {name: {} for name in settings.losses}
    with LiveTable(settings.losses, len(settings.seeds), settings.epochs, console or progress_console) as live:
        for (name, index), progress, lines, job in _train_jobs(jobs, used, settings, data, features, workers):
            append_metrics(run_dir, lines)
            if progress is not None and name in finished:  # an epoch of a job of an unfinished loss
                live.epoch(name, index, *progress)
            if job is None:
                continue
            records, seconds = job
            finished[name][index] = (records, seconds)
            if len(finished[name]) == len(settings.seeds):  # every seed of this loss is done
                done = finished.pop(name)
                seed_records = [record for i in sorted(done) for record in done[i][0]]
                seconds = sum(seconds for _, seconds in done.values())  # training time, summed over seeds
                entry, best = finish_loss(run_dir, name, seed_records, used[name], data, seconds)
                entries[name] = entry
                if best is not None:
                    checkpoint[name] = best
                live.loss_done(name, entry)
    results = {"stage": "linear", "dataset": features.dataset, "cache_id": cache_file.cache_id(features.attrs),
               "complete": True, "losses": {name: entries[name] for name in settings.losses}}
    save_checkpoint(run_dir / "best.pt", {name: checkpoint[name] for name in settings.losses if name in checkpoint})
    write_json(run_dir / "results.json", results)  # last: its presence marks a finished run
    return LinearRun(run_dir, results)


def _train_jobs(jobs, used, settings, data, features, workers):
    """Train every (loss, seed) job; yields `((loss, seed index), progress, metrics lines, job)` events:
    `progress = (epoch, best_so_far)` after each epoch of a job, `job = (records, seconds)` when it is done.
    In-process the metrics lines come with each epoch; from worker processes, with the finished job."""
    if workers == 1:
        for name, index, seed in jobs:
            start = time.perf_counter()
            run = SeedRun(name, used[name], seed, settings.lrs, settings.batch_sizes, settings.epochs, data)
            for epoch in range(1, settings.epochs + 1):
                lines = run.run_epoch(epoch)
                done = (run.records, time.perf_counter() - start) if epoch == settings.epochs else None
                yield (name, index), (epoch, best_so_far(run.records)), lines, done
        return
    context = multiprocessing.get_context("spawn")  # fork is unsafe once torch has started its threads
    progress = context.Queue()
    device = str(data.train_features.device)
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                               initargs=(str(features.path), device, settings.val_labels, progress))
    try:
        pending = {
            pool.submit(_run_job, (name, index), name, used[name], seed, settings.lrs, settings.batch_sizes,
                        settings.epochs): (name, index)
            for name, index, seed in jobs
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


def _start_worker(cache_path: str, device: str, val_labels: str, progress) -> None:
    _worker["data"] = LinearData.from_features(cache_file.load(cache_path), torch.device(device), val_labels)
    _worker["progress"] = progress


def _run_job(key, name, hparams, seed, lrs, batch_sizes, epochs):
    """One (loss, seed) in a worker process: the same training as in-process, progress through the queue."""
    start = time.perf_counter()
    run = SeedRun(name, hparams, seed, lrs, batch_sizes, epochs, _worker["data"])
    lines = []
    for epoch in range(1, epochs + 1):
        lines += run.run_epoch(epoch)
        _worker["progress"].put((key, (epoch, best_so_far(run.records))))
    return run.records, lines, time.perf_counter() - start
