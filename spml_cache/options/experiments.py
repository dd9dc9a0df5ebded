"""`spml-cache run`'s options (`experiments.run_experiment`): the experiment file, whether to run it or print its
plan, and the trackers its linear and finetune steps log to, declared like the stages' so that the command line is
built from them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spml_cache.options.declared import Options, option
from spml_cache.options.trackers import TRACKERS_HELP, read_trackers


@dataclass(frozen=True, kw_only=True)
class RunOptions(Options):
    """The flags of `spml-cache run`."""

    file: Path = option(help="The experiment file (TOML, docs/experiments.md).", argument=True, kind=Path)
    dry_run: bool = option(False, "Print the plan as the commands it runs, each step's with what is done of it; run"
                           " nothing.", switch=True)
    trackers: tuple[str, ...] | None = option(None, TRACKERS_HELP + " For the file's linear and finetune steps: the"
                                              " file's own log key in its place.", flag="--log", read=read_trackers)
