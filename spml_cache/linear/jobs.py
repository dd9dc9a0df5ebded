"""Stage two's jobs: every lr of one (loss, seed) and one or all of its batch sizes, trained in this process or in
worker processes (one per core), with the same results either way (tested).

Workers are forked on Linux's CPU (they inherit the features already in memory) and spawned elsewhere: CUDA
cannot be forked (nor can autograd once CUDA has run in this process), and macOS's system libraries are not
fork-safe.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import KW_ONLY, dataclass, field, replace

import torch

from spml_cache import cache as cache_file
from spml_cache.linear.compiled import CompileTime
from spml_cache.linear.data import LinearData
from spml_cache.linear.engine import Job, SeedRun
from spml_cache.linear.graphs import Lockstep, graphs_available
from spml_cache.linear.parts import Part
from spml_cache.linear.settings import LinearSettings, StartHead
from spml_cache.losses import plugins
from spml_cache.losses.contract import loss_faults
from spml_cache.losses.overrides import Combination
from spml_cache.runtime.children import die_with_parent, ignore_interrupts, interrupts_held_back
from spml_cache.runtime.errors import SpmlError, check_stop
from spml_cache.runtime.memory import give_back_freed
from spml_cache.selection import best_so_far

# Below this much work (training rows x epochs x (loss, seed) pairs) starting worker processes costs more than it
# saves; above it, each core trains its own jobs.
PARALLEL_MIN_WORK = 50_000


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


@dataclass(frozen=True)
class JobEvent:
    """What training a job reports: after each epoch its progress, `(epoch, best so far)`; when it is done, its
    heads (`done`). In-process the metrics lines come with each epoch; from a worker process, with `done`.
    `compiled`: after the first epoch whose steps compiled (`linear --compile`), the compiles' time so far."""

    job: Job
    progress: tuple[int, dict | None] | None = None
    lines: list[dict] = field(default_factory=list)
    done: Part | None = None
    _: KW_ONLY
    compiled: CompileTime | None = None


def merged_progress(parts) -> tuple[int, dict | None]:
    """(epoch, best so far) of one (loss, seed) from its jobs' latest `(epoch, best_so_far)`."""
    parts = list(parts)
    bests = [best for _, best in parts if best is not None]
    return min(epoch for epoch, _ in parts), max(bests, key=lambda best: best["val_map"], default=None)


@dataclass(frozen=True, kw_only=True)
class JobPlan:
    """What a run's jobs train and on what: its units (`{result key: (loss, rule text)}`), each loss's
    hyperparameter combinations (`used`) and starting head (`starts`), each rule's training data (`data`) and
    `observation.Observed` (`observed`, for spawned workers), the device and workers, whether stacks may train
    in lockstep as CUDA graphs (`graphs`), whether each stack's step is compiled where it pays (`compile_steps`,
    compiled.py), and `lrs_at_once` (a count when the memory budget splits the lrs into groups trained in turn)."""

    settings: LinearSettings
    units: dict[str, tuple[str, str]]
    used: dict[str, list[Combination]]
    starts: dict[str, StartHead]
    features: cache_file.FeatureSet
    data: dict[str, LinearData]
    observed: dict
    target: torch.device
    workers: int = 1
    graphs: bool = True
    compile_steps: bool = False
    lrs_at_once: int | None = None

    def jobs(self, kept, ranks=None) -> tuple[list[Job], int]:
        """The jobs this process trains (what `kept`, the keys of the kept parts, lacks) and its worker processes:
        a job per (loss, rule, seed) with all its batch sizes, or one per batch size when processes share them
        (`ranks`: torchrun's), or one per batch size and group of `lrs_at_once` lrs when the grid's heads do not
        fit the memory budget at once."""
        settings, grid = self.settings, self.settings.options
        whole = [Job(loss=name, seed_index=index, seed=seed, rule=rule,
                     batch_sizes=tuple(size for size in grid.batch_sizes if (key, seed, size) not in kept))
                 for key, (name, rule) in self.units.items() for index, seed in enumerate(settings.seeds)]
        whole = [job for job in whole if job.batch_sizes]
        split = [replace(job, batch_sizes=(size,)) for job in whole for size in job.batch_sizes]
        if ranks:  # every lr group of a part on the same process
            split = ranks.share(split)
        if self.lrs_at_once:
            at_once = self.lrs_at_once
            groups = [tuple(grid.lrs[i : i + at_once]) for i in range(0, len(grid.lrs), at_once)]
            return [replace(job, lrs=group) for job in split for group in groups], 1
        work = len(self.features.train) * grid.epochs * len(whole)
        workers = resolve_workers(self.workers, self.target, len(split), work)
        return (split if workers > 1 or ranks else whole), workers


def train_jobs(plan: JobPlan, jobs: list[Job], workers: int):
    """Train every job of `plan`; yields `JobEvent`s. On a GPU (unless not `plan.graphs`) every job trains at
    once, in lockstep."""
    settings, used, data, starts = plan.settings, plan.used, plan.data, plan.starts
    first = next(iter(data.values()))
    device = first.device
    grouped = any(job.lrs for job in jobs)  # the heads do not fit the memory budget at once: one job at a time
    if workers == 1 and plan.graphs and graphs_available(device) and first.dense_in_memory and not grouped:
        with loss_faults(list(dict.fromkeys(job.loss for job in jobs))):
            yield from _in_lockstep(jobs, used, settings, data, starts)
        return
    if workers == 1:
        for job in jobs:
            with loss_faults([job.loss]):
                yield from _in_process(job, plan, used, data, starts)
        return
    yield from _in_workers(plan, jobs, workers)


def _in_process(job: Job, plan: JobPlan, used, data, starts):
    start, settings, epochs = time.perf_counter(), plan.settings, plan.settings.options.epochs
    run = SeedRun.for_job(job, settings, used[job.loss], data[job.rule], starts.get(job.loss))
    compiles = CompileNotes(run, plan.compile_steps)
    for epoch in range(1, epochs):
        lines = run.run_epoch(epoch)
        yield JobEvent(job, (epoch, best_so_far(run.records)), lines, compiled=compiles.news())
    lines = run.run_epoch(epochs)
    records = run.host_records()
    # The job's heads and optimiser state go before its part is kept and selected from, and before the next job's
    # are made (lr groups: the memory budget); the allocator hands their memory back.
    del run
    give_back_freed()
    yield JobEvent(job, (epochs, best_so_far(records)), lines, Part(records, time.perf_counter() - start),
                   compiled=compiles.news())


class CompileNotes:
    """`linear --compile` in one job: its stacks compiled where it pays (`SeedRun.compile_steps`); `news`, the
    compiles' time once, after the first epoch that compiled (None before, after, and without --compile)."""

    def __init__(self, run: SeedRun, compile_steps: bool) -> None:
        self.spent = run.compile_steps() if compile_steps else None
        self.told = False

    def news(self) -> CompileTime | None:
        if self.spent is None or self.told or not self.spent.graphs:
            return None
        self.told = True
        return self.spent


def _in_workers(plan: JobPlan, jobs: list[Job], workers: int):
    """Every job in `workers` worker processes, forked or spawned."""
    settings, used, data, starts, observed = plan.settings, plan.used, plan.data, plan.starts, plan.observed
    device = next(iter(data.values())).device
    # A fork is unsafe once CUDA is initialised (autograd's device threads, the CUDA context): spawn then.
    forking = device.type == "cpu" and sys.platform.startswith("linux") and not torch.cuda.is_initialized()
    context = multiprocessing.get_context("fork" if forking else "spawn")
    progress = context.Queue()
    source = data if forking else (str(plan.features.path),
                                   {rule: (o.train, o.val) for rule, o in (observed or {}).items()})
    sys.stdout.flush()  # a forked worker flushes what it inherited when it exits
    sys.stderr.flush()
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                               initargs=(source, str(device), settings.options.val_labels, progress,
                                         os.getpid(), plugins.loaded()))
    try:
        with interrupts_held_back():  # the first submit starts the workers
            pending = {pool.submit(_run_job, job, settings, used[job.loss], starts.get(job.loss),
                                   plan.compile_steps): job for job in jobs}
        while pending:
            done, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            check_stop()  # the workers ignore signals: this process stops them
            while not progress.empty():
                yield progress.get()
            for future in done:
                job = pending.pop(future)
                with loss_faults([job.loss]):  # what the job raised in its worker
                    part, lines = future.result()
                yield JobEvent(job, lines=lines, done=part)
    except BaseException:  # Ctrl-C, an error, or the caller stopping early: the running jobs are not waited for
        _stop_workers(pool, progress)
        raise
    pool.shutdown(wait=True)


def _in_lockstep(jobs, used, settings, data, starts):
    """Every job's stacks advance together, an epoch at a time, as captured CUDA graphs (graphs.py). Each job is
    credited an equal share of the wall time, so that the parts' seconds add up to it."""
    begin = time.perf_counter()
    runs = {job: SeedRun.for_job(job, settings, used[job.loss], data[job.rule], starts.get(job.loss)) for job in jobs}
    together = Lockstep(list(runs.values()))
    for epoch in range(1, settings.options.epochs + 1):
        together.train_epoch(epoch)
        last = epoch == settings.options.epochs
        for job, run in runs.items():
            lines = run.score(epoch)
            done = Part(run.host_records(), (time.perf_counter() - begin) / len(runs)) if last else None
            yield JobEvent(job, (epoch, best_so_far(run.records)), lines, done)


def _stop_workers(pool: ProcessPoolExecutor, progress) -> None:
    """End every worker now and reap it. The handles are taken first: `shutdown` forgets them (Python 3.11-3.13
    set `_processes` to None), after which nothing could stop a worker still training its queued jobs."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)  # forgotten by `shutdown` too
    for process in processes:
        process.terminate()
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.join(timeout=1.0)
        if process.is_alive():  # SIGTERM is handled only between bytecodes: a long native call may hold it off
            process.kill()
            process.join()
    if manager is not None:
        # The pool's manager thread closes its wake-up pipe as it ends; if the interpreter exits while it is still
        # alive, concurrent.futures' exit hook writes to that closed pipe ("Exception ignored ... Bad file
        # descriptor" after the stop line, Python 3.11). Its workers are gone, so it ends at once.
        manager.join(timeout=2.0)
    progress.cancel_join_thread()  # what a worker left in the queue is not worth waiting for
    progress.close()


_worker: dict = {}  # in a worker process: the training data of each rule and the progress queue


def _start_worker(source, device: str, val_labels: str, progress, parent_pid: int, loaded: dict) -> None:
    """The training data of each rule: inherited (fork), or read from the cache file and given each rule's
    observed rows (spawn); the plugin losses the parent loaded (`loaded`: their origins), loaded again."""
    die_with_parent(parent_pid)
    plugins.load_recorded(loaded, run_dir="(a worker)", strict=False)  # a spawned worker starts without them
    ignore_interrupts()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's handler (a SIGTERM to the group) is not a worker's
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP thread pool
    if isinstance(source, tuple):
        path, observed = source
        data = LinearData.from_features(cache_file.load(path), torch.device(device), val_labels)
        source = {rule: data.under_rule(train, val, val_labels) for rule, (train, val) in observed.items()}
    _worker.update(data=source, progress=progress)


def _run_job(job: Job, settings: LinearSettings, hparams: list[Combination], start: StartHead | None,
             compile_steps: bool = False) -> tuple[Part, list[dict]]:
    """One job in a worker process: the same training as in-process, progress through the queue."""
    begin = time.perf_counter()
    run = SeedRun.for_job(job, settings, hparams, _worker["data"][job.rule], start)
    compiles = CompileNotes(run, compile_steps)
    lines = []
    for epoch in range(1, settings.options.epochs + 1):
        lines += run.run_epoch(epoch)
        _worker["progress"].put(JobEvent(job, (epoch, best_so_far(run.records)), compiled=compiles.news()))
    return Part(run.host_records(), time.perf_counter() - begin), lines
