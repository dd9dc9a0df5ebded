"""Stage two (`spml-cache linear`): linear heads on cached features, the papers' linear-probe regime, fast.

Checks every input before anything is written (`settings.py`), then for each loss and seed trains all (lr, batch
size) configs at once (`engine.py`, in jobs: `jobs.py`), selects per docs/protocol.md (`selection.py`) and writes
the run directory (`runs/`). Every finished (loss, seed, batch size) is kept under the run's `jobs/` as it
finishes, so an interrupted run goes on with `--resume RUN` and trains only what is missing; the results are
those of an uninterrupted run.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

from spml_cache import losses as loss_registry, observation, runs, trackers
from spml_cache.cache import cache_id, find_cache, verify

from spml_cache.linear.data import LinearData
from spml_cache.linear.gather import Gathering
from spml_cache.linear.jobs import JobEvent, JobPlan, train_jobs
from spml_cache.losses.contract import LossFailed
from spml_cache.linear.live import LiveTable
from spml_cache.linear.out_of_core import load_within
from spml_cache.linear.parts import KeptParts, Part
from spml_cache.runtime import locks, memory
from spml_cache.runtime.devices import resolve_device
from spml_cache.runtime.errors import (
    DiskFull, Interrupted, SpmlError, check_stop, finished, stop_exit_code, stops_deferred,
)
from spml_cache.linear.settings import (
    LinearSettings, kept_hparams, rerun_options, resolved_hparams, start_heads, stored_options,
)
from spml_cache.metrics import mean_average_precision
from spml_cache.options import LinearOptions, LinearPlacement, from_keywords, refuse_differences
from spml_cache.protocol import check_train_test, check_val_split
from spml_cache.runtime.progress import console as progress_console
from spml_cache.runs.results import LinearRun
from spml_cache.runtime.ranks import PeerLost, Ranks, current as current_ranks

# --- the run ---------------------------------------------------------------------------------------------


def run_linear(options: LinearOptions | None = None, placement: LinearPlacement | None = None, /,
               **keywords) -> LinearRun | None:
    """Stage two's door (`spml-cache linear`): plan, start or resume, train, select, and write the run directory.

    Each option means what its declaration says (options/linear.py, each flag's help); the Python API may give the
    fields of both types as keywords instead: `run_linear(cache=..., losses=["an", "role"], device="cpu")`. Under
    torchrun the (loss, rule, seed, batch size) parts are shared between the processes, each training whole parts;
    rank 0 writes the run directory, gathers the others' parts, selects and returns the run (the others return
    None). A signal (the command line's Ctrl-C or SIGTERM) stops the training at its next step
    (`errors.check_stop`), every finished part kept for `--resume`.
    """
    if keywords:
        if options is not None or placement is not None:
            raise TypeError("run_linear takes a LinearOptions and a LinearPlacement, or their fields as keywords")
        options, placement = from_keywords(keywords, LinearOptions, LinearPlacement)
    return _run_linear(LinearOptions() if options is None else options,
                       LinearPlacement() if placement is None else placement)


def _run_linear(options: LinearOptions, placement: LinearPlacement) -> LinearRun | None:
    _refuse_other_out(placement.resume, placement.out)
    with stops_deferred():
        ranks = current_ranks()  # under torchrun: this process's share of the parts
        planned = _plan(options, placement, ranks)
        if ranks and not ranks.main:
            return _train_other_rank(ranks, planned.jobs)
        resume = placement.resume
        run_dir = Path(resume) if resume is not None else _start_run_dir(placement.out or "runs", planned)
        if placement.run_dir_made is not None:
            placement.run_dir_made(run_dir)
        budget = planned.jobs.settings.options.memory_budget
        binding = [memory.FLAG, memory.flag_text(budget)] if planned.budget_binds else []  # it shaped the run
        going_on = shlex.join(["spml-cache", "linear", "--resume", str(run_dir), *binding])
        say = lambda line: _print_notes(placement.console, [line])  # noqa: E731
        # one `linear` (or `--resume`) at a time; `--log`: its trackers see every epoch and the results
        with locks.held(run_dir, f"run directory {run_dir}"), trackers.watching(placement.trackers, run_dir, say):
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


@dataclass(frozen=True, kw_only=True)
class _Planned:
    """A run as planned, before its directory exists: its jobs (their settings: the run's options as it takes
    them, what config.json keeps; `budget_binds`: the memory budget shaped the run), and the data as loaded."""

    jobs: JobPlan
    budget_binds: bool
    whole: LinearData


def _part_count(plan: JobPlan) -> tuple[int, str]:
    """How many parts the run has, and what one is (a loss's, or a loss's under a rule, seed and batch size)."""
    settings = plan.settings
    parts = len(plan.units) * len(settings.seeds) * len(settings.options.batch_sizes)
    return parts, "(loss, rule, seed, batch size)" if _several(settings) else "(loss, seed, batch size)"


def _interrupted(run_dir: Path, plan: JobPlan, stop: BaseException, going_on: str) -> Interrupted:
    """What a stopped run says: the parts kept, and the command that goes on."""
    parts, what = _part_count(plan)
    lost = f"another process of this torchrun command ended ({stop}): " if isinstance(stop, PeerLost) else ""
    return Interrupted(f"{lost}{len(KeptParts(run_dir).read())} of {parts} {what} parts are kept in {run_dir}",
                       going_on)


def _loss_failed(run_dir: Path, plan: JobPlan, failed: LossFailed, going_on: str) -> SpmlError:
    """A loss failed while it trained: its line, what was kept, and how to go on once it is fixed: `--resume`, which
    takes a plugin's changed code only while none of its parts is kept (else a new run)."""
    kept, (parts, _) = KeptParts(run_dir).read(), _part_count(plan)
    own = [key for key in kept if plan.units[key[0]][0] in failed.names]
    where = f"{len(kept)} of {parts} parts are kept in {run_dir}"
    if own and any(loss_registry.plugins.origin(name) for name in failed.names):
        return SpmlError(f"{failed}; {where}, {len(own)} of them trained by this code of {','.join(failed.names)}:"
                         " once it is fixed, start a new run")
    return SpmlError(f"{failed}; {where}: once it is fixed, go on with: {going_on}")


def _given_settings(options: LinearOptions, placement: LinearPlacement):
    """`(config or None, settings)`: a resumed run's own options (any option given beside `--resume` that
    contradicts them refused), else those given (with `--config`, in place of a record's), resolved as far as they
    go before the cache is read (the grid, the losses, the cache found for `--dataset`)."""
    resume, config = placement.resume, None
    if placement.config is not None:  # a new run with a record's settings (refused beside --resume)
        options, line = rerun_options(placement.config, resume, options)
        _print_notes(placement.console, [line])
    if resume is not None:
        # a plugin that changed since the run began goes on only while none of its parts is kept (fixed after it
        # failed)
        config = runs.open_for_resume(resume, "linear", renewable=lambda name: name not in KeptParts(resume).losses())
        stored = stored_options(config, Path(resume) / "config.json")
        refuse_differences(resume, options.differences(stored))
        return config, LinearSettings.of(stored.filled_from(options))
    settings = LinearSettings.of(options)  # first: a misspelt loss is said before a missing cache
    return None, settings.planned(cache={"cache": find_cache(options.cache, options.dataset, placement.cache_dir)})


def _plan(options: LinearOptions, placement: LinearPlacement, ranks: Ranks | None) -> _Planned:
    """Plan, load and check what the run trains, before anything is written."""
    config, settings = _given_settings(options, placement)
    options = settings.options
    target = ranks.device(resolve_device(placement.device)) if ranks else resolve_device(placement.device)
    _refuse_compile_with_graphs(placement, target)
    budget = memory.budget(options.memory_budget, target)
    features, chunks, lrs_at_once = load_within(options.cache, budget, settings.heads_at_once(), target,
                                                options.chunk_rows, settings.heads_per_lr())
    check_stop()
    lrs_at_once = lrs_at_once and min(lrs_at_once, len(options.lrs))
    if chunks.streams or lrs_at_once:  # the budget binds: transient buffers must not stay with the allocator
        memory.keep_within()
    workers = placement.workers
    if not chunks.train_in_memory or lrs_at_once:
        workers = _streaming(settings, workers) if not chunks.train_in_memory else 1
    check_train_test(len(features.train), features.test.labels, features.test.label_mask, str(features.path))
    check_val_split(features.val.labels, str(features.path))
    unverified = _verified(features, config is not None or options.from_run is not None, chunks.streams)
    settings, text_notes = settings.for_cache(features)
    observed = observation.for_cache(features, options.observe)
    observation.refuse_unobserved(observed, features.path)
    units, notes = settings.units(observed, features.train.labels)
    used = resolved_hparams(settings, features)
    starts = start_heads(options.from_run, settings.options.losses, features)
    if config is not None and config["cache_id"] != cache_id(features.attrs):
        raise SpmlError(f"--resume {placement.resume}: {features.path} was rebuilt since that run began; start a new"
                        " run")
    if ranks is None or ranks.main:
        _print_notes(placement.console, [unverified, observation.drawn_note(observed, features.path), *text_notes,
                                         *notes, chunks.streams and chunks.describe(),
                                         _clamped_note(options.chunk_rows, chunks),
                                         lrs_at_once and _grouped_note(lrs_at_once),
                                         _compile_note(placement.compile_steps, settings, len(features.train))])
    whole = LinearData.from_features(features, target, options.val_labels, chunks)
    data = {rule: whole.under_rule(found.train, found.val, options.val_labels) for rule, found in observed.items()}
    settings = settings.planned(  # what config.json keeps: the run's every option as it takes it
        cache={"dataset": features.dataset},
        plan={"memory_budget": budget, "chunk_rows": None if chunks.train_in_memory else chunks.chunk_rows},
        losses={"hparams": kept_hparams(used)})
    jobs = JobPlan(settings=settings, units=units, used=used, starts=starts, features=features, data=data,
                   observed=observed, target=target, workers=workers, graphs=placement.graphs,
                   compile_steps=placement.compile_steps, lrs_at_once=lrs_at_once)
    return _Planned(jobs=jobs, budget_binds=bool(chunks.streams or lrs_at_once), whole=whole)


def _refuse_compile_with_graphs(placement: LinearPlacement, target) -> None:
    """`--compile` on a GPU beside its CUDA graphs: a graph replays a step's kernels without Python already, and
    torch.compile's guards and first-call compile cannot run inside a capture; one of the two."""
    if placement.compile_steps and placement.graphs and target.type == "cuda":
        raise SpmlError("--compile: on a GPU stage two replays each step as a CUDA graph, which a compiled step"
                        " cannot be captured into; leave out --compile, or add --no-graphs to compile eager steps")


def _compile_note(compile_steps: bool, settings: LinearSettings, num_train: int) -> str | None:
    """`--compile` where no stack's step takes enough steps to pay a compile back: said, not refused."""
    from spml_cache.linear.compiled import MIN_STEPS, full_steps, pays

    if not compile_steps:
        return None
    epochs, smallest = settings.options.epochs, min(settings.options.batch_sizes)
    steps = full_steps(epochs, num_train, smallest)
    if pays(steps):
        return None
    return (f"--compile: no step compiled: the most full steps a stack takes is {steps:,} ({epochs} epochs"
            f" of batch {smallest}), fewer than the {MIN_STEPS:,} that pay a compile back")


def _several(settings: LinearSettings) -> bool:
    """Whether the run trains under other observation rules than `single` alone."""
    return [rule.text for rule in settings.options.observe] != [observation.DEFAULT_RULE]


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
    """A new run's directory and config.json: its options as it takes them, each once (the memory budget and chunk
    plan included: what report reads, and what `--resume` reads back and compares)."""
    plan, whole = planned.jobs, planned.whole
    settings, starts, features = plan.settings, plan.starts, plan.features
    losses = settings.options.losses
    plugins = [name for name in losses if name not in loss_registry.names()]
    label = "+".join(["all", *plugins] if settings.every_loss else losses)
    return runs.start_run(
        out, stage="linear", label=label, features=features, device=plan.target,
        options=settings.options.stored(), losses=losses, workers=plan.workers, num_train=whole.num_train,
        num_val=whole.num_val, num_test=len(features.test), feature_dim=whole.train_features.shape[1],
        **{"from": {name: s.source for name, s in starts.items()} or None},
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
    if resuming:  # once, before any training: what the run before this one left, and what is left to train
        parts, what = _part_count(plan)
        (console or progress_console).print(f"resuming {run_dir}: {len(kept)} of {parts} {what} parts kept, training"
                                            f" {parts - len(kept)}", markup=False, highlight=False, soft_wrap=True)
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

    scoring = [name for name in settings.options.losses if registry.get(name).needs_train_logits]
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
    epochs = settings.options.epochs
    with LiveTable(list(units), len(settings.seeds), epochs, console or progress_console) as live:
        gathering = Gathering(run_dir, plan, kept, live)
        for event in chain(train_jobs(plan, jobs, workers), _from_other_ranks(ranks)):
            gathering.take(event)
    entries, checkpoints = gathering.entries, gathering.checkpoints
    return runs.finish_run(
        run_dir, stage="linear", features=plan.features, losses={key: entries[key] for key in units},
        checkpoints={key: checkpoints[key] for key in units if key in checkpoints},
        fidelity=settings.options.fidelity, **({"rules": rules} if rules else {}),
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
