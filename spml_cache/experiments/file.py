"""An experiment file as written (docs/experiments.md): its keys and values with the line of each, in the tables
it has. Which stage takes which key is the plan's to say (`plan.py`): this file only reads the shape.

    weights = "none"                 # the top: a value for every stage that takes the key
    [experiment]                     # name (of its state file) and runs (the runs folder)
    [axes]                           # a key and its values: the stages run once per combination
    dataset = ["voc", { dataset = "nus", skip_missing = true }]
    [extract] / [import-features] / [linear] / [finetune] / [report]    # one table, or [[linear]] several

A mistake is one line naming the file, the line and the key (`Mistakes`): all of them are said before anything runs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spml_cache.experiments.positions import key_lines, line_of
from spml_cache.runtime.errors import SpmlError

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, from PyPI (pyproject's dependency on 3.10)
    import tomli as tomllib

EXPERIMENT_KEYS = {"name": "the experiment's name, which names its state file (default: the file's name)",
                   "runs": "the runs folder of its linear and finetune runs (default: runs)"}


@dataclass
class Mistakes:
    """Every mistake found in a file, one line each (`FILE:LINE: ...`), raised together (`raise_any`)."""

    path: Path
    found: list[tuple[int, str]] = field(default_factory=list)

    def add(self, line: int, text: str) -> None:
        if (line, text) not in self.found:
            self.found.append((line, text))

    def raise_any(self) -> None:
        if self.found:
            raise SpmlError("\n".join(f"{self.path}:{line}: {text}" if line else f"{self.path}: {text}"
                                      for line, text in sorted(self.found)))


@dataclass(frozen=True)
class Given:
    """A key and its value as written, with where: its line and its table (`""`: the top of the file)."""

    key: str
    value: Any
    line: int
    table: str

    def said(self, text: str) -> str:
        """`text` about this key, in its table: `[linear] epochs -1: ...`."""
        return f"[{self.table}] {text}" if self.table else text


@dataclass(frozen=True)
class Axis:
    """An axis: its key, its line, and each value as the keys it sets (`{key: Given}`: the axis's own, and any a
    value's table sets with it)."""

    key: str
    line: int
    values: list[dict[str, Given]]


@dataclass(frozen=True)
class Table:
    """One table of a stage (`[linear]`, or one of `[[linear]]`): its name as shown, its line and its keys."""

    stage: str
    name: str
    line: int
    values: dict[str, Given]


@dataclass(frozen=True, kw_only=True)
class ExperimentFile:
    path: Path
    name: str
    runs: Path | None
    common: dict[str, Given]  # the top of the file
    axes: list[Axis]
    tables: list[Table]
    lines: dict[tuple, int]
    mistakes: Mistakes


def read_file(path: Path | str, stages: tuple[str, ...]) -> ExperimentFile:
    """The file at `path`, its tables sorted out: `[experiment]`, `[axes]`, each of `stages`' tables; everything
    else at the top is a key for the stages (the plan checks that one takes it)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpmlError(f"{path} does not exist: give an experiment file (docs/experiments.md)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise SpmlError(f"{path}: cannot read it ({err})") from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise SpmlError(f"{path}: not valid TOML: {err}") from None
    lines, mistakes = key_lines(text), Mistakes(path)
    name, runs = _experiment(document.pop("experiment", {}), path, lines, mistakes)
    axes = _axes(document.pop("axes", {}), lines, mistakes)
    tables = [table for stage in stages if stage in document
              for table in _tables(stage, document.pop(stage), lines, mistakes)]
    common = {key: Given(key, value, line_of(lines, (key,)), "") for key, value in document.items()}
    return ExperimentFile(path=path, name=name, runs=runs, common=common, axes=axes, tables=tables, lines=lines,
                          mistakes=mistakes)


def _experiment(table, path: Path, lines, mistakes: Mistakes) -> tuple[str, Path | None]:
    if not isinstance(table, dict):
        mistakes.add(line_of(lines, ("experiment",)), "experiment: a table ([experiment]) of name and runs")
        return path.stem, None
    for key, value in table.items():
        line = line_of(lines, ("experiment", key))
        if key not in EXPERIMENT_KEYS:
            mistakes.add(line, f"[experiment] {key}: not a key of [experiment]; its keys: "
                         + "; ".join(f"{one} ({why})" for one, why in EXPERIMENT_KEYS.items()))
        elif not isinstance(value, str) or not value.strip():
            mistakes.add(line, f"[experiment] {key} {value!r}: give a text ({EXPERIMENT_KEYS[key]})")
    name, runs = table.get("name"), table.get("runs")
    name = name if isinstance(name, str) and name.strip() else path.stem
    return name, Path(runs).expanduser() if isinstance(runs, str) and runs.strip() else None


def _axes(table, lines, mistakes: Mistakes) -> list[Axis]:
    if not isinstance(table, dict):
        mistakes.add(line_of(lines, ("axes",)), "axes: a table ([axes]) of keys, each a list of values")
        return []
    axes = []
    for key, values in table.items():
        line = line_of(lines, ("axes", key))
        if not isinstance(values, list) or not values:
            mistakes.add(line, f"[axes] {key}: give a list of the values to run, e.g. {key} = [A, B]")
            continue
        chosen = []
        for index, value in enumerate(values):
            at = line_of(lines, ("axes", key, index))
            if not isinstance(value, dict):
                chosen.append({key: Given(key, value, at, "axes")})
            elif key not in value:
                mistakes.add(at, f"[axes] {key}: a table among its values needs {key} itself (e.g. {{ {key} = ..., ..."
                             " }), beside the keys set with it")
            else:
                chosen.append({one: Given(one, given, line_of(lines, ("axes", key, index, one)), "axes")
                               for one, given in value.items()})
        axes.append(Axis(key, line, chosen))
    return axes


def _tables(stage: str, value, lines, mistakes: Mistakes) -> list[Table]:
    """A stage's table, or each of its array of tables (`[[finetune]]`)."""
    if isinstance(value, dict):
        return [Table(stage, stage, line_of(lines, (stage,)),
                      {key: Given(key, one, line_of(lines, (stage, key)), stage) for key, one in value.items()})]
    if isinstance(value, list) and value and all(isinstance(one, dict) for one in value):
        return [Table(stage, f"{stage} {index + 1}", line_of(lines, (stage, index)),
                      {key: Given(key, one, line_of(lines, (stage, index, key)), f"{stage} {index + 1}")
                       for key, one in table.items()})
                for index, table in enumerate(value)]
    mistakes.add(line_of(lines, (stage,)), f"{stage}: a table ([{stage}]) or tables ([[{stage}]]) of its options")
    return []
