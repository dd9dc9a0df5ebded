"""`sc.run(file, ...)`: an experiment file from Python, its keywords named as `spml-cache run`'s flags (`dry_run`,
`log`) and read and checked by their declarations (options/keywords.py); quiet unless `progress=True`."""

from __future__ import annotations

from spml_cache.experiments.run import ExperimentRun, run_experiment
from spml_cache.options.experiments import RunOptions
from spml_cache.options.keywords import documented, from_flag_keywords, no_positional
from spml_cache.runtime.progress import door_console, reporting_to


def run(file=None, *args, progress: bool = False, **keywords) -> ExperimentRun:
    """`spml-cache run` from Python: the experiment file's stages over its axes, each step the command a user would
    type (a run again reuses every cache and finished run and goes on with an interrupted one), or with
    `dry_run=True` its plan printed and nothing run.

    Returns the `ExperimentRun`: `plan` (its `steps`), `made` (each step's cache or run directory by step number)
    and `ran` (the steps that ran now; the others were done before)."""
    no_positional("sc.run", args, progress)
    given = {"file": file, **keywords} if file is not None else keywords
    (options,) = from_flag_keywords("sc.run", given, RunOptions, also=["progress"])
    shown = door_console(progress)
    with reporting_to(shown):
        return run_experiment(options.file, dry_run=options.dry_run, trackers=options.trackers, console=shown)


documented(run, RunOptions, positional=["file"])
