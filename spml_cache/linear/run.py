"""Stage two (`spml-cache linear`): linear heads on cached features, the papers' linear-probe regime, fast.

Checks every input before anything is written (`settings.py`), then for each loss and seed trains all (lr, batch
size) configs at once (`engine.py`, in jobs: `jobs.py`), selects per docs/protocol.md (`selection.py`) and writes
the run directory (`runs.py`). Every finished (loss, seed, batch size) is kept under the run's `jobs/` as it
finishes, so an interrupted run goes on with `--resume RUN` and trains only what is missing; the results are
those of an uninterrupted run.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, fields
from itertools import chain
from pathlib import Path

from rich.console import Console

from spml_cache import losses as loss_registry, observation, runs
from spml_cache.cache import cache_id, find_cache, verify

from spml_cache.linear.data import LinearData
from spml_cache.linear.gather import Gathering
from spml_cache.linear.jobs import JobEvent, JobPlan, train_jobs
from spml_cache.losses.contract import LossFailed
from spml_cache.linear.live import LiveTable
from spml_cache.linear.out_of_core import load_within
from spml_cache.linear.options import LinearOptions, LinearPlacement
from spml_cache.linear.parts import KeptParts, Part
from spml_cache.runtime import locks, memory
from spml_cache.runtime.devices import resolve_device
from spml_cache.runtime.errors import (
    DiskFull, Interrupted, SpmlError, check_stop, finished, stop_exit_code, stops_deferred,
)
from spml_cache.linear.settings import (LinearSettings, refuse_contradictions, resolved_hparams, start_heads,
                                       stored_settings)
from spml_cache.metrics import mean_average_precision
from spml_cache.protocol import check_train_test, check_val_split
from spml_cache.runtime.progress import console as progress_console
from spml_cache.runtime.ranks import PeerLost, Ranks, current as current_ranks

# --- the run ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearRun:
    run_dir: Path
    results: dict


def run_linear(*, console: Console | None = None, **keywords) -> LinearRun | None:
    """`run_linear_options` by keywords, for the Python API: each keyword a field of `LinearOptions` (what the run
    trains) or of `LinearPlacement` (where it runs), e.g. `run_linear(cache=..., losses=["an", "role"])`."""
    placement = {name: keywords.pop(name) for name in PLACEMENT_FIELDS if name in keywords}
    return run_linear_options(LinearOptions(**keywords), LinearPlacement(console=console, **placement))


PLACEMENT_FIELDS = tuple(option.name for option in fields(LinearPlacement) if option.name != "console")


def run_linear_options(options: LinearOptions, placement: LinearPlacement = LinearPlacement()) -> LinearRun | None:
    """`spml-cache linear`: train the (loss x lr x batch size x seed) grid, select, write a run directory.

    A job trains every lr of one (loss, seed) and its batch sizes; with `workers` > 1 each batch size is its
    own job, so that even one loss's grid spreads over the cores (same results either way). `losses`: "all" (the
    default) or names; the grid's defaults are the protocol's (`GRID_LRS`, `GRID_BATCH_SIZES`, `LINEAR_EPOCHS`,
    one seed, clean val labels). `from_run`: every head starts from that linear run's head (`start_heads`)
    instead of its seed's initialisation. `resume`: an interrupted run directory, whose settings are used: a
    setting given beside it that differs is refused (`refuse_contradictions`). `fidelity`: exact (the papers'
    math, stably; the default) or authors (their code's numerics and rules, docs/fidelity.md).
    A hyperparameter given as a list is swept: every combination of the values is trained beside every (lr,
    batch size), heads that differ only in a hyperparameter the loss takes per head in the same stack, and
    selection runs over the whole grid; `hp_grid="paper"` sweeps each loss's own search space where its paper
    states one. `graphs`: on a GPU, train every stack at once as replayed CUDA graphs (graphs.py); False trains
    them one by one, eagerly (for debugging; the same results up to float rounding). `observe`: the observation
    rules (observation.py; None: `single`): every loss trains under each, on masks the cache stores or, for a
    rule it lacks, drawn from its full labels; the results of loss L under rule R are keyed `L@R` (`L` under
    `single`). Under torchrun the (loss, rule, seed, batch size) parts are shared between the processes, each
    training whole parts; rank 0 writes the run directory, gathers the others' parts, selects and returns the run
    (the others return None). `memory_budget` (bytes, or "1GB"; None: most of the device's free memory): train
    and val/test features that do not fit it stream from the cache (out_of_core.py), in chunks of `chunk_rows`
    rows when given (the train features then always stream), else of a size planned from the budget and the
    cache's shapes alone; the budget and the chunk size are kept in config.json, and a resumed run keeps both.
    A signal (the command line's Ctrl-C or SIGTERM) stops the training at its next step (`errors.check_stop`).
    `wds`: the probe's L2 weight decays (None: 0 alone, the papers' grid), a grid axis beside the lrs: one head
    per (lr, weight decay) in the same stacks, selected on val like the rest.
    """
    _refuse_other_out(options.resume, placement.out)
    with stops_deferred():
        ranks = current_ranks()  # under torchrun: this process's share of the parts
        planned = _plan(options, placement, ranks)
        if ranks and not ranks.main:
            return _train_other_rank(ranks, planned.jobs)
        resume = options.resume
        run_dir = Path(resume) if resume is not None else _start_run_dir(placement.out or "runs", planned)
        binding = [memory.FLAG, memory.flag_text(planned.budget)] if planned.budget_binds else []  # it shaped the run
        going_on = shlex.join(["spml-cache", "linear", "--resume", str(run_dir), *binding])
        with locks.held(run_dir, f"run directory {run_dir}"):  # one `linear` (or `--resume`) at a time
            try:
                results = _train_in(run_dir, resume is not None, ranks, placement.console, planned.jobs)
            except (KeyboardInterrupt, PeerLost) as stop:
                raise _interrupted(run_dir, planned.jobs, stop, going_on) from None
            except DiskFull as full:  # what was kept before is kept
                raise full.going_on(f"go on with: {going_on}") from None
            except LossFailed as failed:  # so are the parts trained before
                raise _loss_failed(run_dir, planned.jobs, failed, going_on) from failed
            KeptParts(run_dir).remove()
            finished()  # the results are written: a stop now has nothing to stop
        if ranks:
            ranks.leave()
        return LinearRun(run_dir, results)


def _verified(features, carried_on: bool, streamed: bool) -> str | None:
    """The cache's content against its checksum (`cache.verify`). What goes on (`--resume`) or starts from a head
    and its state (`--from`) must read the very same arrays; a new run checks them too when they are in memory
    (one pass over what is loaded, ~2 s per GB on two EPYC cores), so that the cache id its config.json records is
    its content's. Streamed, that would be one more read of a cache larger than memory: left to --resume. The note
    on a cache too old to have a checksum is for --resume and --from."""
    if not carried_on and streamed:
        return None
    note = verify(features)
    return note if carried_on else None


def _refuse_other_out(resume, out) -> None:
    """`--out` beside `--resume RUN`: a resumed run goes on in its own directory, so a runs folder other than the
    one holding it is refused rather than left unused without a word."""
    if resume is None or out is None:
        return
    own = Path(resume).resolve().parent.parent  # <runs folder>/<dataset>/<run>
    if Path(out).resolve() != own:
        raise SpmlError(f"--out {out}: --resume {resume} goes on in its own run directory, under {own}; leave out"
                        " --out (a new run in another folder: leave out --resume)")


@dataclass(frozen=True)
class _Planned:
    """A run as planned, before its directory exists: its jobs, its memory budget and the chunk plan it streams
    under (`budget_binds`: the budget shaped the run), and the data as loaded."""

    jobs: JobPlan
    budget: int
    chunks: object  # out_of_core's plan
    budget_binds: bool
    whole: LinearData


def _interrupted(run_dir: Path, plan: JobPlan, stop: BaseException, going_on: str) -> Interrupted:
    """What a stopped run says: the parts kept, and the command that goes on."""
    settings = plan.settings
    parts = len(plan.units) * len(settings.seeds) * len(settings.batch_sizes)
    what = "(loss, rule, seed, batch size)" if _several(settings) else "(loss, seed, batch size)"
    lost = f"another process of this torchrun command ended ({stop}): " if isinstance(stop, PeerLost) else ""
    return Interrupted(f"{lost}{len(KeptParts(run_dir).read())} of {parts} {what} parts are kept in {run_dir}",
                       going_on)


def _loss_failed(run_dir: Path, plan: JobPlan, failed: LossFailed, going_on: str) -> SpmlError:
    """A loss failed while it trained: its line, what was kept, and how to go on once it is fixed: `--resume`, which
    takes a plugin's changed code only while none of its parts is kept (else a new run)."""
    settings, kept = plan.settings, KeptParts(run_dir).read()
    parts = len(plan.units) * len(settings.seeds) * len(settings.batch_sizes)
    own = [key for key in kept if plan.units[key[0]][0] in failed.names]
    where = f"{len(kept)} of {parts} parts are kept in {run_dir}"
    if own and any(loss_registry.plugins.origin(name) for name in failed.names):
        return SpmlError(f"{failed}; {where}, {len(own)} of them trained by this code of {','.join(failed.names)}:"
                         " once it is fixed, start a new run")
    return SpmlError(f"{failed}; {where}: once it is fixed, go on with: {going_on}")


def _given_settings(options: LinearOptions, cache_dir):
    """The run's settings, `(config or None, settings, from_run, cache path, budget or None, chunk_rows or None)`:
    a resumed run's own (a flag that contradicts them refused), else those given (the protocol's defaults where
    not given)."""
    resume = options.resume
    if resume is not None:
        config, settings, from_run = stored_settings(Path(resume))
        refuse_contradictions(Path(resume), config, settings, options.given())
        if options.cache is not None or options.dataset is not None:
            named = find_cache(options.cache, options.dataset, cache_dir).resolve()
            if named != Path(config["cache"]).resolve():
                flag = "--cache" if options.cache is not None else "--dataset"
                raise SpmlError(f"--resume {resume}: {flag} names {named}, but the run trains on {config['cache']}:"
                                f" leave out {flag}, or start a new run with it")
        budget = config.get("memory_budget", options.memory_budget)
        return config, settings, from_run, config["cache"], budget, (config.get("out_of_core") or {}).get("chunk_rows")
    settings = LinearSettings.of(options)
    path = find_cache(options.cache, options.dataset, cache_dir)
    return None, settings, options.from_run, path, options.memory_budget, options.chunk_rows


def _plan(options: LinearOptions, placement: LinearPlacement, ranks: Ranks | None) -> _Planned:
    """Plan, load and check what the run trains, before anything is written."""
    config, settings, from_run, cache_path, budget, chunk_rows = _given_settings(options, placement.cache_dir)
    target = ranks.device(resolve_device(placement.device)) if ranks else resolve_device(placement.device)
    budget = memory.budget(budget, target)
    features, chunks, lrs_at_once = load_within(cache_path, budget, settings.heads_at_once(), target, chunk_rows,
                                                settings.heads_per_lr())
    check_stop()
    lrs_at_once = lrs_at_once and min(lrs_at_once, len(settings.lrs))
    if chunks.streams or lrs_at_once:  # the budget binds: transient buffers must not stay with the allocator
        memory.keep_within()
    workers = placement.workers
    if not chunks.train_in_memory or lrs_at_once:
        workers = _streaming(settings, workers) if not chunks.train_in_memory else 1
    check_train_test(len(features.train), features.test.labels, features.test.label_mask, str(features.path))
    check_val_split(features.val.labels, str(features.path))
    unverified = _verified(features, options.resume is not None or from_run is not None, chunks.streams)
    settings, text_notes = settings.for_cache(features)
    observed = observation.for_cache(features, settings.rules)
    observation.refuse_unobserved(observed, features.path)
    units, notes = settings.units(observed, features.train.labels)
    used = resolved_hparams(settings, features)
    starts = start_heads(from_run, settings.losses, features)
    if options.resume is not None and config["cache_id"] != cache_id(features.attrs):
        raise SpmlError(f"--resume {options.resume}: {features.path} was rebuilt since that run began; start a new run")
    if ranks is None or ranks.main:
        _print_notes(placement.console, [unverified, observation.drawn_note(observed, features.path), *text_notes,
                                         *notes, chunks.streams and chunks.describe(),
                                         _clamped_note(chunk_rows, chunks),
                                         lrs_at_once and _grouped_note(lrs_at_once)])
    whole = LinearData.from_features(features, target, settings.val_labels, chunks)
    data = {rule: whole.under_rule(found.train, found.val, settings.val_labels) for rule, found in observed.items()}
    jobs = JobPlan(settings, units, used, starts, features, data, observed, target, workers, placement.graphs,
                   lrs_at_once)
    return _Planned(jobs, budget, chunks, bool(chunks.streams or lrs_at_once), whole)


def _several(settings: LinearSettings) -> bool:
    """Whether the run trains under other observation rules than `single` alone."""
    return [rule.text for rule in settings.rules] != [observation.DEFAULT_RULE]


def _clamped_note(chunk_rows: int | None, chunks) -> str | None:
    if not chunk_rows or chunk_rows <= chunks.chunk_rows:
        return None
    return (f"--chunk-rows {chunk_rows:,} is more than the {chunks.chunk_rows:,} training rows: one chunk of them all,"
            " in the order an in-memory run takes")


def _grouped_note(lrs_at_once: int) -> str:
    return (f"memory budget: the grid's heads do not fit at once; trained {lrs_at_once} lr{'s' * (lrs_at_once > 1)}"
            " of one batch size at a time (the same heads, in turn)")


def _print_notes(console, notes: list) -> None:
    for note in notes:
        if note:
            (console or progress_console).print(note, markup=False, highlight=False, soft_wrap=True)


def _start_run_dir(out, planned: _Planned) -> Path:
    """A new run's directory and config.json: the grid, and the memory budget and chunk plan it trains under
    (what `--resume` reads back)."""
    plan, whole = planned.jobs, planned.whole
    settings, used, starts, features = plan.settings, plan.used, plan.starts, plan.features
    plugins = [name for name in settings.losses if name not in loss_registry.names()]
    label = "+".join(["all", *plugins] if settings.every_loss else settings.losses)
    grid = runs.Grid(settings.losses, settings.lrs, settings.batch_sizes, settings.epochs, settings.seeds,
                     {name: loss_registry.merged(combos) for name, combos in used.items()}, settings.val_labels,
                     settings.fidelity)
    return runs.start_run(
        out, stage="linear", label=label, features=features, device=plan.target, grid=grid, workers=plan.workers,
        num_train=whole.num_train, num_val=whole.num_val, num_test=len(features.test),
        feature_dim=whole.train_features.shape[1],
        **{"from": {name: s.source for name, s in starts.items()} or None},
        **({"observe": [rule.text for rule in settings.rules]} if _several(settings) else {}),
        **({"wds": settings.wd_axis} if settings.wd_axis else {}),
        memory_budget=planned.budget,
        **({"out_of_core": {"chunk_rows": planned.chunks.chunk_rows}} if not planned.chunks.train_in_memory else {}),
    )


def _train_other_rank(ranks: Ranks, plan: JobPlan) -> None:
    """Under torchrun, a process other than rank 0: its share of the parts, handed to rank 0 at the end. Stopped,
    it leaves the word to rank 0, which says what was kept."""
    try:
        jobs, workers = plan.jobs(ranks.broadcast(None), ranks)
        ranks.gather([JobEvent(event.job, lines=event.lines, done=event.done) for event in
                      train_jobs(plan, jobs, workers) if event.lines or event.done])
    except (KeyboardInterrupt, PeerLost):
        raise SystemExit(stop_exit_code()) from None
    finished()  # its parts are with rank 0
    ranks.leave()
    return None


def _train_in(run_dir: Path, resuming: bool, ranks, console, plan: JobPlan) -> dict:
    """Train what `run_dir` has not kept, select, and write its results."""
    features, observed = plan.features, plan.observed
    several = _several(plan.settings)
    # first: report's figures need it, whatever happens next (dense label matrices only)
    if not (run_dir / runs.TEST_LABELS).exists():
        runs.write_labels(run_dir, train_labels=features.train.labels, train_observed=features.train.observed,
                          val_labels=features.val.labels, test_labels=features.test.labels,
                          test_mask=features.test.label_mask,
                          rules={rule: found.train for rule, found in observed.items() if several})
    kept = KeptParts(run_dir).read() if resuming else {}
    if ranks:
        ranks.broadcast(set(kept))  # every process plans the same missing parts
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # rebuilt: the kept parts' lines, then the new ones
    runs.append_metrics(run_dir, [line for part in kept.values() for r in part.records for line in r.metric_lines()])
    rules = {text: found.summary(features.train.labels) for text, found in observed.items()} if several else None
    return _train_and_select(run_dir, plan, kept, console, ranks, rules, zero_shot(features))


def _streaming(settings: LinearSettings, workers: int) -> int:
    """The train features stream from the cache: losses that score every training row each epoch are refused,
    and one process trains (the chunks are read in order)."""
    from spml_cache import losses as registry

    scoring = [name for name in settings.losses if registry.get(name).needs_train_logits]
    if scoring:
        raise SpmlError(f"{', '.join(scoring)} score every training row each epoch, which needs the train features in"
                        " memory: raise --memory-budget, or leave them out of --loss")
    return 1


def _from_other_ranks(ranks: Ranks | None):
    """On rank 0, once its own jobs are done: the other processes' finished jobs."""
    for events in (ranks.gather([]) or [])[1:] if ranks else []:
        yield from events


def _train_and_select(run_dir, plan: JobPlan, kept: dict[tuple, Part], console, ranks: Ranks | None,
                      rules: dict | None, reference: dict | None) -> dict:
    """Train what is not in `kept` ({(result key, seed, batch size): Part}) of every unit ({result key: (loss,
    rule)}), select each once its every part is done, write the results (`rules`: results.json's summary of
    each rule, when the run has others than `single`; `reference`: the zero-shot scores). Under torchrun this is
    rank 0, and the other processes' parts arrive at the end."""
    settings, units = plan.settings, plan.units
    jobs, workers = plan.jobs(kept, ranks)
    with LiveTable(list(units), len(settings.seeds), settings.epochs, console or progress_console) as live:
        gathering = Gathering(run_dir, plan, kept, live)
        for event in chain(train_jobs(plan, jobs, workers), _from_other_ranks(ranks)):
            gathering.take(event)
    entries, checkpoints = gathering.entries, gathering.checkpoints
    return runs.finish_run(
        run_dir, stage="linear", features=plan.features, losses={key: entries[key] for key in units},
        checkpoints={key: checkpoints[key] for key in units if key in checkpoints},
        fidelity=settings.fidelity, **({"rules": rules} if rules else {}),
        **_partial_test_labels(plan.data), **({"reference": reference} if reference else {}),
    )


def _partial_test_labels(data: dict) -> dict:
    """results.json's word on a partially labelled test split (every rule's data shares it), else nothing."""
    partial = next(iter(data.values())).partial_test_labels
    return {"partial_test_labels": partial} if partial else {}


def zero_shot(features) -> dict | None:
    """A cache with a text side: the reference scores of its image-text similarity alone, no training
    (`{"zero_shot": {"val_map", "test_map", "backbone"}}`, mAP against the full labels, over the annotated ones
    where they are partial); None without one."""
    if not features.has_text_side:
        return None
    maps = {f"{split}_map": mean_average_precision(features.similarity(split), getattr(features, split).labels,
                                                   getattr(features, split).label_mask)
            for split in ("val", "test")}
    return {"zero_shot": {**maps, "backbone": features.attrs.get("backbone")}}
