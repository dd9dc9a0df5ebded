"""`spml-cache run`'s options (`experiments.run_experiment`): the experiment file and whether to run it or print its
plan, declared like the stages' so that the command line is built from them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spml_cache.options.declared import Options, option


@dataclass(frozen=True, kw_only=True)
class RunOptions(Options):
    """The flags of `spml-cache run`."""

    file: Path = option(help="The experiment file (TOML, docs/experiments.md).", argument=True, kind=Path)
    dry_run: bool = option(False, "Print the plan as the commands it runs, each step's with what is done of it; run"
                           " nothing.", switch=True)
