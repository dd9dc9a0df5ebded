"""The stages an experiment file runs, each by its command's declared options (options/): the keys a stage's table
takes (each option's flag name, `Option.keyword`), the keys the experiment sets itself, and a step's command line as
a user types it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from spml_cache.options import (
    ExtractOptions, ExtractPlacement, FinetuneOptions, FinetunePlacement, LinearOptions, LinearPlacement, Option,
    Options,
)
from spml_cache.options.extract import ImportOptions
from spml_cache.options.report import ReportOptions

RUNS_KEY = "the runs folder is [experiment] runs"


@dataclass(frozen=True)
class Stage:
    """One stage an experiment runs: its command, its options' types, what it makes (a `cache` a later stage reads,
    a `run` directory, or nothing) and the keys its table may not set, with the reason."""

    command: str
    types: tuple[type[Options], ...]
    makes: str
    reserved: dict[str, str]

    def options(self) -> dict[str, Option]:
        """`{keyword: option}` of every option its command line takes."""
        return {option.keyword: option for kind in self.types for option in kind.declared().values()
                if option.flag != ""}

    def key(self, written: str) -> tuple[str, bool] | None:
        """The keyword a key written in a file names, and whether it negates (`no_graphs = true` is `graphs =
        false`): the keyword itself, or the flag's name without its dashes (`batch-size`, `from`, `no-graphs`)."""
        written = written.replace("-", "_")
        for keyword, option in self.options().items():
            flag = option.cli_flag.removeprefix("--").replace("-", "_")
            if written == keyword:
                return keyword, False
            if written == flag and not option.argument:
                return keyword, flag != keyword.replace("-", "_") and option.switch
        return None


STAGES = {stage.command: stage for stage in (
    Stage("extract", (ExtractOptions, ExtractPlacement), "cache",
          {"dry_run": "spml-cache run --dry-run prints the plan"}),
    Stage("import-features", (ImportOptions,), "cache", {}),
    Stage("linear", (LinearOptions, LinearPlacement), "run", {
        "resume": "an experiment goes on with its own runs (run it again)",
        "config": "an experiment file holds the settings itself", "out": RUNS_KEY}),
    Stage("finetune", (FinetuneOptions, FinetunePlacement), "run", {
        "resume": "an experiment goes on with its own runs (run it again)",
        "config": "an experiment file holds the settings itself", "out": RUNS_KEY}),
    Stage("report", (ReportOptions,), "", {
        "run_dirs": "the report covers the experiment's own runs", "runs": "the report covers the experiment's own"
        " runs"}),
)}


@dataclass(frozen=True)
class Pending:
    """What an earlier step makes, before it has run (a dry run shows it so)."""

    step: int
    what: str  # "cache" or "run"

    def __str__(self) -> str:
        return f"<{self.what} of step {self.step}>"


def text(value) -> str:
    """A value as a command line gives it: a list as a comma list, a float as Python writes it (read back exactly),
    a path as a string."""
    if isinstance(value, (list, tuple)):
        return ",".join(text(one) for one in value)
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, float) else str(value)


def flags(option: Option, value) -> list[str]:
    """`option` given `value` on the command line: nothing where it is its default, a switch alone, `--hp` once per
    item, a positional argument as itself."""
    if value is None:
        return []
    if option.switch:
        return [option.cli_flag] if value != option.default else []
    if option.repeat:
        items = [f"{key}={text(one)}" for key, one in value.items()] if isinstance(value, dict) else (
            [value] if isinstance(value, str) else list(value))
        return [word for item in items for word in (option.cli_flag, item)]
    if option.argument:
        return [text(one) for one in value] if option.many and isinstance(value, (list, tuple)) else [text(value)]
    return [option.cli_flag, text(value)]


def command_line(stage: Stage, values: dict, results_only: bool = False) -> list[str]:
    """`["spml-cache", STAGE, ...]`: the command that runs `values` (`{keyword: value}` as the file gives them), its
    arguments first, then each flag in the order its options are declared (`results_only`: only the options that
    change results, what an experiment knows a step's run by)."""
    words, arguments = [], []
    for kind in stage.types:
        if results_only and not kind.results:
            continue
        for option in kind.declared().values():
            if option.flag != "" and option.keyword in values:
                (arguments if option.argument else words).extend(flags(option, values[option.keyword]))
    return ["spml-cache", stage.command, *arguments, *words]


def shown(words: list[str]) -> str:
    """A command line as a shell takes it."""
    return shlex.join(str(word) if isinstance(word, Path) else word for word in words)
