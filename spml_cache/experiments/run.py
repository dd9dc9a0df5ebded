"""`spml-cache run EXPERIMENT.toml`: an experiment's plan (`plan.py`), run step by step through each stage's door
with the objects its command line would build, so that each step is the command a user would type (a dry run
prints them); what each step made is kept as it is made (`state.py`), so that a run again reuses every cache and
finished run, goes on with an interrupted one (`--resume`'s way) and trains only what is missing. Ctrl-C stops the
step that runs, as that stage stops, and says `spml-cache run FILE` goes on.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Sequence

import torch
from rich.console import Console
from rich.markup import escape

from spml_cache.cli.text import default_data_root, extract_report, finetune_summary, require_root
from spml_cache.experiments.checks import step_objects
from spml_cache.experiments.plan import Plan, Step, make_plan
from spml_cache.experiments.state import State
from spml_cache.experiments.stages import command_line, shown, text
from spml_cache.runs import is_complete
from spml_cache.runtime.errors import Interrupted, SpmlError, finished, more_work


@dataclass(frozen=True)
class ExperimentRun:
    """What an experiment made: each step's cache or run directory (`{step number: path}`), and the steps that
    ran now (the others were done before)."""

    plan: Plan
    made: dict[int, Path]
    ran: list[int]


def run_experiment(path: Path | str, *, dry_run: bool = False, trackers: str | Sequence[str] | None = None,
                   console: Console | None = None) -> ExperimentRun:
    """Run the experiment file at `path`, or, with `dry_run`, print its plan as commands and run nothing; every
    mistake in the file is said before anything runs. `trackers` (`--log`): those of its linear and finetune steps,
    in the place of the file's top `log` key (`()` or "none": none)."""
    console = console or Console()
    given = {} if trackers is None else {"log": (trackers if isinstance(trackers, str) else list(trackers)) or "none"}
    plan = make_plan(path, given)
    state = State.read(plan.state, plan.file.path)
    if dry_run:
        print_plan(plan, state, console)
        return ExperimentRun(plan, {}, [])
    going_on = shlex.join(["spml-cache", "run", str(path), *(
        word for key, value in given.items() for word in (f"--{key.replace('_', '-')}", text(value)))])
    seed, made, ran = torch.initial_seed(), {}, []
    for step in plan.steps:
        more_work()  # the step before said its work was written: this one's begins (a stop that came meanwhile, here)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)  # each step from the random state a new process starts in
                made[step.number], now = _run_step(step, plan, state, made, console)
        except Interrupted as stop:
            raise Interrupted(f"step {step.number} of {len(plan.steps)}: {stop.kept}", going_on) from None
        except KeyboardInterrupt:
            raise Interrupted(f"step {step.number} of {len(plan.steps)} stopped; the steps before it are done",
                              going_on) from None
        except SpmlError as err:
            raise SpmlError(f"{plan.file.path}: step {step.number} ({step.command(made)}): {err}") from None
        ran += [step.number] if now else []
    finished()
    reused = len(plan.steps) - len(ran)
    console.print(f"{escape(str(plan.file.path))}: {len(plan.steps)} steps done" + (f", {reused} of them before"
                  if reused else "") + f"; its state: {escape(str(plan.state))}", soft_wrap=True)
    return ExperimentRun(plan, made, ran)


def print_plan(plan: Plan, state: State, console: Console) -> None:
    """Each step's command as a user types it, with what the state says of it: done (what it made), goes on (its
    run, `--resume`), or to run; what a step reads from one not run yet is named by that step's number."""
    console.print(f"# {plan.file.path}: {len(plan.steps)} steps ({plan.count()}); its state: {plan.state}",
                  markup=False, highlight=False, soft_wrap=True)
    made: dict[int, Path] = {}
    for step in plan.steps:
        found = _found(step, state, made)
        done = found is not None and (step.stage.makes == "cache" or is_complete(found))
        values = step.resolved(made)
        if found is not None and not done:
            values["resume"] = found
        said = f"step {step.number}" + (f": done, {found}" if done else f": goes on with {found}" if found else "")
        console.print(f"{shown(command_line(step.stage, values))}  # {said}", markup=False, highlight=False,
                      soft_wrap=True)
        if step.cache is not None or found is not None:
            made[step.number] = step.cache or found


def _found(step: Step, state: State, made: Mapping[int, Path]) -> Path | None:
    """What the state says step `step` made (a run or an imported cache that is still there), else None."""
    if step.stage.command not in ("linear", "finetune", "import-features"):
        return None
    found = state.found(_key(step, made))
    return found if found is not None and found.exists() else None


def _key(step: Step, made: Mapping[int, Path]) -> str:
    """What the state knows a step by: its command's options that change results (an import: its whole command)."""
    return step.command(made, results_only=step.stage.command != "import-features")


def _run_step(step: Step, plan: Plan, state: State, made: dict[int, Path], console: Console) -> tuple[Path | None, bool]:
    """Run one step (or find it done): what it made, and whether it ran now."""
    heading = f"step {step.number}/{len(plan.steps)}"
    found = _found(step, state, made)
    if found is not None and (step.stage.makes == "cache" or is_complete(found)):
        console.print(f"[bold]{heading}[/bold]: done, {escape(str(found))} ({escape(step.command(made))})",
                      soft_wrap=True)
        return found, False
    console.print(f"[bold]{heading}[/bold]: {escape(step.command(made))}", soft_wrap=True)
    objects = step_objects(step, made)
    door = {"extract": _extract, "import-features": _import, "linear": _linear, "finetune": _finetune,
            "report": _report}[step.stage.command]
    return door(step, objects, found, lambda run: state.keep(_key(step, made), run), console), True


def _extract(step: Step, objects, found, keep, console: Console) -> Path:
    from spml_cache.extract import run_extract

    options, placement = objects
    report = run_extract(options, replace(placement, root=require_root(placement.root)))
    extract_report(report, console)
    if Path(report.path) != step.cache:
        raise SpmlError(f"its cache is {report.path}, not {step.cache} as planned")
    return Path(report.path)


def _import(step: Step, objects, found, keep, console: Console) -> Path:
    from spml_cache.extract import import_features

    options, placement = objects
    report = import_features(options.folder, dataset=options.dataset, root=placement.root or default_data_root(),
                             out=placement.out, classes_file=options.classes, force=placement.force)
    console.print(f"wrote {escape(str(report.path))}")
    keep(Path(report.path))
    return Path(report.path)


def _linear(step: Step, objects, found, keep, console: Console) -> Path:
    from spml_cache import linear

    options, placement = objects
    run = linear.run_linear(options, replace(placement, resume=found, run_dir_made=keep))
    console.print(linear.summary_table(run.results))
    console.print(f"run directory: {escape(str(run.run_dir))}")
    return run.run_dir


def _finetune(step: Step, objects, found, keep, console: Console) -> Path:
    from spml_cache.finetune import run_finetune

    options, placement = objects
    root = placement.root if placement.root is not None or found is not None else default_data_root()
    run = run_finetune(options, replace(placement, root=root, resume=found, run_dir_made=keep, log=lambda line:
                                        console.print(line, markup=False, highlight=False, soft_wrap=True)))
    for line in finetune_summary({**run.results, "run_dir": str(run.run_dir)}):
        console.print(line, soft_wrap=True)
    return run.run_dir


def _report(step: Step, objects, found, keep, console: Console) -> None:
    from spml_cache import report

    (options,) = objects
    report.report_command(options, console)
    return None
