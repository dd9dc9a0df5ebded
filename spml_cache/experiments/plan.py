"""An experiment's plan: its steps, each one stage's command, from the file's keys (`file.py`) over every combination
of its axes, every key checked by its option's declaration before anything runs.

A step's values are the keys the file gives for its stage (the top's, its combination's, its table's: the most
particular wins, but an axis is set in one place), and what it reads from an earlier step of its combination: a
linear step the cache its extract (or import-features) step makes, `--cache`; a fine-tuning the linear run that
trained its loss (`--from`, for `--init best`) or the cache (`--init imagenet`); the report every run of the
experiment. A table that names `cache` or `from` itself reads that instead. Steps with the same command are one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from spml_cache.experiments.file import ExperimentFile, Given, Mistakes, Table, read_file
from spml_cache.experiments.checks import check_step, planned_cache, trains
from spml_cache.experiments.stages import STAGES, Pending, Stage, command_line, shown
from spml_cache.runs.layout import safe_name
from spml_cache.runtime.errors import closest


@dataclass(kw_only=True)
class Step:
    """One command of the plan: its stage, the table it comes from, its values (`{keyword: value}`, as the file
    gives them, and the `Pending` products of earlier steps) and where each was given."""

    number: int
    stage: Stage
    table: Table
    values: dict[str, Any]
    given: dict[str, Given]
    cache: Path | None = None  # extract: the cache it writes, known before it runs

    def resolved(self, products: Mapping[int, Path]) -> dict[str, Any]:
        """Its values, each `Pending` one the product its step made."""
        def product(value):
            if isinstance(value, list):
                return [product(one) for one in value]
            return products.get(value.step, value) if isinstance(value, Pending) else value

        return {keyword: product(value) for keyword, value in self.values.items()}

    def command(self, products: Mapping[int, Path] = {}, results_only: bool = False) -> str:
        return shown(command_line(self.stage, self.resolved(products), results_only))


@dataclass(frozen=True)
class Plan:
    file: ExperimentFile
    steps: list[Step]
    state: Path  # the experiment's state file: the run of each step (`state.py`)

    def count(self) -> str:
        """`2 extract, 2 linear, 1 report`."""
        counts = {stage: sum(step.stage.command == stage for step in self.steps) for stage in STAGES}
        return ", ".join(f"{count} {stage}" for stage, count in counts.items() if count)


def make_plan(path: Path | str, given: Mapping[str, Any] = {}) -> Plan:
    """The plan of the experiment file at `path` (`given`: keys for the top of the file from the command line,
    in their place), or every mistake in it, one line each (`SpmlError`)."""
    experiment = read_file(path, tuple(STAGES))
    experiment.common.update({key: Given(key, value, 0, "") for key, value in given.items()})
    mistakes = experiment.mistakes
    present = [stage for name, stage in STAGES.items() if any(table.stage == name for table in experiment.tables)]
    if not present and not mistakes.found:
        mistakes.add(0, f"no stage to run: give at least one of {', '.join(f'[{name}]' for name in STAGES)}")
    if {"extract", "import-features"} <= {stage.command for stage in present}:
        mistakes.add(0, "[extract] and [import-features]: a file makes its caches one way (two files for both)")
    _check_keys(experiment, present, mistakes)
    steps = _Steps(experiment, mistakes).made(present, _combinations(experiment, mistakes))
    for step in steps:
        check_step(step, mistakes)
    mistakes.raise_any()
    state = (experiment.runs or Path("runs")) / "experiments" / f"{safe_name(experiment.name)}.json"
    return Plan(experiment, steps, state)


def _check_keys(experiment: ExperimentFile, present: list[Stage], mistakes: Mistakes) -> None:
    """Each key a stage of the file takes (the top's and the axes': at least one; a table's: its own stage), none
    the experiment sets itself, and none both an axis and set elsewhere."""
    known = sorted({key for stage in present for key in stage.options()} | {"experiment", "axes", *STAGES})
    axis_keys = {given.key: given for axis in experiment.axes for value in axis.values for given in value.values()}
    for given in [*experiment.common.values(), *axis_keys.values()]:
        taking = [stage for stage in present if stage.key(given.key)]
        if not taking:
            near = closest(given.key, known)
            mistakes.add(given.line, given.said(f"{given.key}: no stage of this file takes it"
                                                + (f"; did you mean {near}?" if near else "")))
        for stage in taking:
            _refuse_reserved(stage, given, mistakes)
    for key, given in experiment.common.items():
        if key in axis_keys:
            mistakes.add(given.line, f"{key}: also an axis (line {axis_keys[key].line}): set it in one place")
    for table in experiment.tables:
        stage = STAGES[table.stage]
        for key, given in table.values.items():
            if stage.key(key) is None:
                near = closest(key.replace("-", "_"), stage.options())
                mistakes.add(given.line, given.said(f"{key}: not an option of spml-cache {stage.command}"
                                                    + (f"; did you mean {near}?" if near else "")))
                continue
            _refuse_reserved(stage, given, mistakes)
            if any(stage.key(axis) == stage.key(key) for axis in axis_keys):
                mistakes.add(given.line, given.said(f"{key}: also an axis: set it in one place"))


def _refuse_reserved(stage: Stage, given: Given, mistakes: Mistakes) -> None:
    keyword, _ = stage.key(given.key)
    if keyword in stage.reserved:
        mistakes.add(given.line, given.said(f"{given.key}: not in an experiment file ({stage.reserved[keyword]})"))


def _combinations(experiment: ExperimentFile, mistakes: Mistakes) -> list[dict[str, Given]]:
    """Every combination of the axes' values (their product, in the order written), as the keys each sets."""
    combinations = []
    for chosen in itertools.product(*(axis.values for axis in experiment.axes)):
        keys: dict[str, Given] = {}
        for value in chosen:
            for key, given in value.items():
                if key in keys:
                    mistakes.add(given.line, f"[axes] {key}: set by two axes (line {keys[key].line} too)")
                keys[key] = given
        combinations.append(keys)
    return combinations


@dataclass
class _Steps:
    """The plan's steps as they are made, each command once."""

    experiment: ExperimentFile
    mistakes: Mistakes
    steps: list[Step] = field(default_factory=list)
    known: dict[str, Step] = field(default_factory=dict)

    def made(self, present: list[Stage], combinations: list[dict[str, Given]]) -> list[Step]:
        tables = {stage.command: [t for t in self.experiment.tables if t.stage == stage.command] for stage in present}
        for combination in combinations:
            made: dict[str, list[Step]] = {"cache": [], "run": []}  # what later stages of this combination read
            for stage in present:
                if stage.command == "report":
                    continue
                for table in tables[stage.command]:
                    values, given = self.values(stage, table, combination)
                    for parent in self.parents(stage, values, given, made):
                        step = self.add(stage, table, values, given, parent)
                        if stage.command != "finetune" and step not in made[stage.makes]:
                            made[stage.makes].append(step)
        runs = [Pending(step.number, "run") for step in self.steps if step.stage.makes == "run"]
        for table in tables.get("report", []):
            for combination in combinations:
                values, given = self.values(STAGES["report"], table, combination)
                self.add(STAGES["report"], table, {**values, "run_dirs": runs}, given, None)
        return self.steps

    def values(self, stage: Stage, table: Table, combination: dict[str, Given]) -> tuple[dict, dict[str, Given]]:
        """`{keyword: value}` and `{keyword: Given}` of one step: the top's keys, the combination's, the table's."""
        values, given = {}, {}
        for one in [*self.experiment.common.values(), *combination.values(), *table.values.values()]:
            found = stage.key(one.key)
            if found is not None:
                keyword, negated = found
                values[keyword], given[keyword] = (not one.value) if negated else one.value, one
        if stage.makes == "run" and self.experiment.runs is not None:
            values["out"] = self.experiment.runs
        return values, given

    def parents(self, stage: Stage, values: dict, given: dict[str, Given], made: dict) -> list[Step | None]:
        """The earlier steps of the combination whose products this step reads (`[None]`: none)."""
        if stage.command == "linear" and "cache" not in values and made["cache"]:
            return made["cache"]
        if stage.command != "finetune" or "cache" in values or "from_run" in values:
            return [None]
        if values.get("init", "best") == "best" and made["run"]:
            return self.training(values.get("loss"), given, made["run"])
        return made["cache"] or [None]

    def training(self, loss: str | None, given: dict[str, Given], linear: list[Step]) -> list[Step]:
        """The linear steps a fine-tuning of `loss` starts from (each that trains it; without a loss, the one)."""
        if loss is None:
            if len(linear) > 1:
                table = given.get("init") or next(iter(given.values()), None)
                self.mistakes.add(table.line if table else 0, "[finetune]: several linear steps to start from: give"
                                  " loss = NAME (or from = RUN)")
            return linear[:1]
        found = [step for step in linear if trains(step, loss)]
        if not found:
            self.mistakes.add(given["loss"].line, given["loss"].said(
                f"loss {loss}: no linear step of this file trains it (add it to [linear] loss), or set init ="
                " \"imagenet\" or from = RUN"))
        return found

    def add(self, stage: Stage, table: Table, values: dict, given: dict[str, Given], parent: Step | None) -> Step:
        values = dict(values)
        if parent is not None:  # what the parent makes; the dataset is then the cache's
            values.pop("dataset", None)
            made = parent.cache or Pending(parent.number, parent.stage.makes)
            values["from_run" if parent.stage.makes == "run" else "cache"] = made
        step = Step(number=len(self.steps) + 1, stage=stage, table=table, values=values, given=given)
        command = step.command()
        if command in self.known:
            return self.known[command]
        if stage.command == "extract":
            step.cache = planned_cache(step, self.mistakes)
        self.known[command] = step
        self.steps.append(step)
        return step
