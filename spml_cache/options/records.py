"""`--config RUN/config.json` (linear and finetune): a new run from a run's record, with that run's settings exactly
or with each option given beside it in its place. Declared once here for both stages (`config_option`); the record
is read by `runs.open_record`, its options by each stage's own reader of config.json (the shapes it has had).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path

from spml_cache.options.declared import Declared, option


def config_option(stage: str):
    """`--config`, a placement option of `stage` (it says where a run's settings come from, not what they are)."""
    return option(None, f"Run again from the record of a {stage} run, RUN/config.json (or RUN): its settings exactly"
                  " (the same results on the same machine and versions); an option given beside it changes that one,"
                  " said in one line. Not with --resume.", kind=Path)


def rerun(stored: Declared, given: Declared, file: Path | str, *, clears: Mapping[str, Iterable[str]] = {},
          derived: Iterable[str] = ()) -> tuple[Declared, str]:
    """The options of a record (`stored`, read from `file`) with each option `given` in its place, and the line
    that says so. An option given that changes the record's also clears those the record derived from it
    (`clears`: linear's `--cache` its dataset); `derived`: options the record keeps beside the one they come from,
    dropped unless given (a run takes one of `--cache` and `--dataset`)."""
    values = {name: value for name, value in given.given().items() if value is not None}
    changes = given.differences(stored)
    changed = {option.name for option in stored.declared().values() for flag, _, _ in changes
               if option.cli_flag == flag}
    cleared = {name for one in changed for name in clears.get(one, ())} | set(derived)
    merged = replace(stored, **{name: None for name in cleared - set(values)})
    return replace(merged, **values), said(file, changes)


def said(file: Path | str, changes: list[tuple[str, str, str]]) -> str:
    """`--config FILE: ...`, naming each option given that changes the record's."""
    if not changes:
        return f"--config {file}: a new run with that run's settings exactly"
    flags = " ".join(f"{flag} {mine}" for flag, mine, _ in changes)
    return (f"--config {file} with {flags}: that run's settings but "
            + "; ".join(f"{flag} {mine} in place of {theirs}" for flag, mine, theirs in changes))
