"""Options declared once, in the style of scikit-learn's declared parameter constraints: each option of a stage is
one field of a frozen dataclass whose `Option` (a `runtime.registry.Param`: its name, type, default and constraint)
adds its help text, its flag and whether it changes what a run computes.

From the declarations come the command line (`cli/declared.py` builds each command and its help: the stages',
report's, the demo's), the checks (when the object is built: one line naming the flag and the fix, or the file and
key a stored value was read from), how a run resolves each option (`resolved`: given, else the source its
declaration names, else its default), what a run directory's config.json keeps (`stored`, `from_stored`: the
options that change results, as resolved) and what `--resume` refuses (`differences`: each option given beside
it against the run's own, by one rule for every stage).

A stage's `Options` hold what changes its results; its `Placement` where and how this process runs it (device,
folders, processes), which never changes them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from spml_cache.options.text import either, parse_list
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.registry import Param

Declared = TypeVar("Declared", bound="Options")


@dataclass(frozen=True)
class Check:
    """A constraint: `valid(value)`, and `must`, what a bad value is told (the fix); `said(value, name)`, where a
    bad value's line is not `NAME VALUE: FIX` (a list's: `--lr is empty: ...`)."""

    valid: Callable[[Any], bool]
    must: str
    said: Callable[[Any, str], str] | None = None


def at_least(low: float, why: str = "", fix: str | None = None) -> Check:
    """A number of `low` or more (`why`: said after the fix, in brackets)."""
    return Check(lambda value: value >= low, fix or f"use at least {low:g}" + (f" ({why})" if why else ""))


def above(low: float, fix: str | None = None) -> Check:
    return Check(lambda value: value > low and math.isfinite(value), fix or f"use a number above {low:g}")


def between(low: float, high: float, fix: str) -> Check:
    return Check(lambda value: low <= value <= high, fix)


def one_of(*choices: str, fix: str | None = None) -> Check:
    return Check(lambda value: value in choices, fix or f"use {either(list(choices))}")


def listed(valid_one: Callable[[Any], bool], must: str, example: str) -> Check:
    """A list of at least one value, each `valid_one` (a grid's lrs, batch sizes, weight decays); `example`, what
    an empty one is told to give."""

    def said(values, name: str) -> str:
        if not values:
            return f"{name} is empty: give at least one value, e.g. {name} {example}"
        return f"{name} {','.join(f'{value:g}' for value in values)}: {must}"

    return Check(lambda values: len(values) > 0 and all(valid_one(value) for value in values), must, said)


ANY = Check(lambda value: True, "")


@dataclass(frozen=True, kw_only=True)
class Option(Param):
    """One declared option: a `Param` (name, `kind`, the constraint `valid`/`must`, `default`: what a run takes
    when it is not given) and what the command line and the run directory need of it.

    `read(value, flag)` turns what was given (the command line's text, or a Python value) into the option's value
    (default: by `kind`, a comma list of it when `many`); `compare(given, stored options)` yields the (given, stored)
    texts of a contradiction (default: the values differ); `dump`/`load`: the value in config.json and back.

    How a run resolves it (`Options.resolved`): as given, else what the source named `fallback` holds of it (a
    mapping its stage resolves with: the loss's "recipe", the "cache", the "start" head, the memory "plan", what
    the "losses" resolved), else `default`; a `derived` option takes its source's value whenever there is one (the
    stage made it from the given value: `--loss all` as the losses it names, `--hp` as the values resolved)."""

    help: str
    results: bool = True  # changes what a run computes: stored in config.json, compared by --resume
    flag: str | None = None  # None: --name-with-dashes; "": none (Python only)
    argument: bool = False  # the command line's positional argument
    many: bool = False  # a list of `kind`, a comma list on the command line
    repeat: bool = False  # a repeatable flag (`--hp a=1 --hp b=2`), read as a list of texts
    switch: bool = False  # a flag without a value: given, the option is the opposite of its default
    read: Callable[[Any, str], Any] | None = None
    said: Callable[[Any, str], str] | None = None  # a bad value's line, where it is not `FLAG VALUE: FIX` (`Check`)
    compare: Callable[[Any, Any], Iterable[tuple[str, str]]] | None = None
    dump: Callable[[Any], Any] | None = None
    load: Callable[[Any], Any] | None = None
    fallback: str = ""
    derived: bool = False
    hidden: bool = False  # a flag --help leaves out (the demo's sizes, for the tests)

    @property
    def cli_flag(self) -> str:
        return self.flag if self.flag is not None else "--" + self.name.replace("_", "-")

    @property
    def keyword(self) -> str:
        """The option's name in Python (`sc.linear(lr=...)`): its flag's, dashes as underscores (`--batch-size`:
        `batch_size`), `from_run` for `--from` (a Python keyword), `X` for a `--no-X` switch (then `X=False` is the
        flag); an option without a flag (or the positional argument) by its field's name."""
        if not self.flag and self.flag is not None or self.argument:
            return self.name
        name = self.cli_flag.removeprefix("--")
        if self.switch and name.startswith("no-") and self.default is True:
            name = name.removeprefix("no-")
        return "from_run" if name == "from" else name.replace("-", "_")

    def checked(self, value, name: str | None = None):
        """`value` as the option holds it, or one line naming the flag (or `name`: where a stored value was read)
        and the fix. A list keeps each value once, in the order given (a duplicate lr would train twice)."""
        name = name or self.cli_flag
        value = self.read(value, name) if self.read is not None else self._as_kind(value, name)
        if self.many and isinstance(value, list):
            value = list(dict.fromkeys(value))
        if value is not None and not self.valid(value):
            raise SpmlError(self.said(value, name) if self.said else f"{name} {_bad(value)}: {self.must}")
        return value

    def _as_kind(self, value, name: str):
        if self.many:
            if isinstance(value, str):
                return parse_list(value, name, self.kind)
            return [self._one(one, name) for one in (value if isinstance(value, (list, tuple)) else [value])]
        return self._one(value, name)

    def _one(self, value, name: str):
        if self.kind in (int, float):  # a number (a whole one for int), never a bool
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not number or (self.kind is int and value != int(value)):
                whole = "a whole number" if self.kind is int else "a number"  # unless the fix says it already
                fix = self.must if "number" in self.must else f"use {whole}"
                raise SpmlError(f"{name} {_bad(value)}: {fix}")
        elif not isinstance(value, KINDS.get(self.kind, self.kind)):  # a Python caller's value of another type
            raise SpmlError(f"{name} {_bad(value)}: use {KIND_WORDS.get(self.kind, f'a {self.kind.__name__}')}")
        return value if self.kind is bool or type(value) is self.kind else self.kind(value)

    def contradictions(self, given, stored: "Options") -> list[tuple[str, str]]:
        """(given, stored) texts where `given` says otherwise than the `stored` options (a run's own)."""
        if self.compare is not None:
            return list(self.compare(given, stored))
        theirs = getattr(stored, self.name)
        same = (theirs is not None and Path(given).resolve() == Path(theirs).resolve() if self.kind is Path
                else given == theirs)
        return [] if same else [(text(given), text(theirs))]

    def stored_form(self, value):
        """`value` as config.json keeps it: plain JSON; a path absolute (a resumed run finds it from any folder)."""
        if value is None:
            return None
        if self.dump is not None:
            return self.dump(value)
        if isinstance(value, Mapping):
            return dict(value)
        return [self._plain(one) for one in value] if isinstance(value, (list, tuple)) else self._plain(value)

    def _plain(self, value):
        if self.kind is Path:
            return str(Path(value).resolve())
        return value if isinstance(value, (bool, int, float, str)) else str(value)


KINDS = {Path: (str, os.PathLike), str: (str, os.PathLike)}  # what an option of a kind takes beside itself
KIND_WORDS = {str: "text", bool: "True or False", Path: "a path (a str or pathlib.Path)"}


def _bad(value) -> str:
    """A refused value as its one line shows it: text quoted (it may be empty, or spaced), the rest as written."""
    return repr(value) if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else str(value)


def text(value) -> str:
    """A value as a contradiction shows it: a list as `a,b`, a float as `%g`, None as `none`."""
    if isinstance(value, (list, tuple)):
        return ",".join(text(one) for one in value) or "none"
    if isinstance(value, float):
        return f"{value:g}"
    return "none" if value is None else str(value)


def option(default: Any = MISSING, help: str = "", *, kind: type | None = None, check: Check = ANY, **declared):
    """A field that holds the value given, else `default` (a required field without one)."""
    return field(default=default, metadata={"option": _declare(default, help, kind, check, declared)})


def given(default: Any, help: str, *, kind: type | None = None, check: Check = ANY, **declared):
    """A field that holds the value given, None where none was: `Options.value` gives `default` then (or, for a
    resumed run, the run's own)."""
    return field(default=None, metadata={"option": _declare(default, help, kind, check, declared)})


def _declare(default, help: str, kind: type | None, check: Check, declared: dict) -> Option:
    default = None if default is MISSING else default
    kind = kind or (type(default) if default is not None and not isinstance(default, (list, tuple, dict)) else str)
    kind = Path if issubclass(kind, Path) else kind  # PosixPath("runs")'s kind: a path
    return Option(name="", kind=kind, valid=check.valid, must=check.must, said=check.said, default=default,
                  help=help, **declared)


_DECLARED: dict[type, dict[str, Option]] = {}
DAMAGED = " (the run's record was edited or damaged: start a new run)"  # said of a value a config.json holds


class Options:
    """A stage's options: a frozen dataclass of declared fields (`option`, `given`), each read and checked as the
    object is built, by the command line and the Python API alike."""

    results: ClassVar[bool] = True  # whether these options change what a run computes (a `Placement`'s do not)

    def __post_init__(self) -> None:
        for option in self.declared().values():
            value = getattr(self, option.name)
            if value is not None:
                object.__setattr__(self, option.name, option.checked(value))

    @classmethod
    def declared(cls) -> dict[str, Option]:
        """`{name: Option}` of every declared field, in the order declared."""
        found = _DECLARED.get(cls)
        if found is None:
            found = _DECLARED[cls] = {
                each.name: replace(each.metadata["option"], name=each.name, results=cls.results)
                for each in fields(cls) if "option" in each.metadata}
        return found

    def given(self) -> dict:
        """`{name: value or None}` of every declared option."""
        return {name: getattr(self, name) for name in self.declared()}

    def value(self, name: str):
        """The option `name` as a new run takes it: as given, else its declared default."""
        given_value = getattr(self, name)
        return self.declared()[name].default if given_value is None else given_value

    def stored(self) -> dict:
        """What config.json keeps of these options, each under its own name: every one that changes results."""
        return {name: option.stored_form(getattr(self, name)) for name, option in self.declared().items()
                if option.results}

    @classmethod
    def from_stored(cls: type[Declared], stored: Mapping, file: Path | str | None = None,
                    keys: str = "") -> Declared:
        """The options a config.json keeps (an option it lacks: not given; keys that name no option: the run's
        other facts). `file` (and `keys`, `options.` in an older run's config) names a value its declaration
        refuses as that file's key, not as a flag that was never given: `RUN/config.json: epochs -1: ...`."""
        if not isinstance(stored, Mapping):  # an older config's `options`, edited
            raise SpmlError(f"{file}: {keys.rstrip('.') or 'the options'} is a JSON {type(stored).__name__}, not the"
                            f" options spml-cache writes there{DAMAGED}")
        values = {}
        for name, option in cls.declared().items():
            value, said = stored.get(name), f"{file}: {keys}{name}" if file else option.cli_flag
            if value is None:
                continue
            try:
                values[name] = option.checked(value if option.load is None else option.load(value), said)
            except SpmlError as refused:
                raise SpmlError(f"{refused}{DAMAGED}" if file else str(refused)) from None
            except (TypeError, ValueError, AttributeError):  # not a form spml-cache writes there
                raise SpmlError(f"{said} {value!r}: not what spml-cache writes there"
                                + (DAMAGED if file else "")) from None
        return cls(**values)

    def resolved(self: Declared, **sources: Mapping) -> Declared:
        """Every option as a run takes it, each a value: as given; else what the source its declaration names
        (`fallback`) holds of it (`sources[fallback][name]`, None: nothing); else its declared default. A `derived`
        option takes its source's value whenever there is one."""
        declared = self.declared()
        for source, found in sources.items():  # a source's every value is for an option that falls back on it
            strays = [name for name in found if name not in declared or declared[name].fallback != source]
            if strays:
                raise ValueError(f"{type(self).__name__}: no option falls back on {source} for {strays}")
        values = {}
        for name, option in declared.items():
            value, found = getattr(self, name), sources.get(option.fallback, {}).get(name)
            if found is not None and (value is None or option.derived):
                value = found
            values[name] = option.default if value is None else value
        return replace(self, **values)

    def filled_from(self: Declared, given: "Options") -> Declared:
        """These options (a run's own), each one they lack (None: a run from before it was kept) taken from `given`."""
        return replace(self, **{name: value for name, value in given.given().items()
                                if value is not None and getattr(self, name) is None})

    def differences(self, stored: "Options") -> list[tuple[str, str, str]]:
        """(flag, given, stored) for each option given here (not None) that says otherwise than `stored`, a run's
        own options: what `--resume` refuses, in every stage."""
        return [(option.cli_flag, mine, theirs) for name, option in self.declared().items()
                if option.results and getattr(self, name) is not None
                for mine, theirs in option.contradictions(getattr(self, name), stored)]


class Placement(Options):
    """Where and how this process runs a stage: declared like its options, none of it changing the results."""

    results: ClassVar[bool] = False


def refuse_differences(run_dir: Path | str, differences: list[tuple[str, str, str]]) -> None:
    """`--resume RUN` keeps the run's own settings: the options given beside it that contradict them, in one
    line naming each flag."""
    if not differences:
        return
    said = "; ".join(f"{flag} {mine} contradicts the run's {theirs}" for flag, mine, theirs in differences)
    flags = list(dict.fromkeys(flag for flag, _, _ in differences))
    raise SpmlError(f"--resume {run_dir}: {said} (a resumed run keeps its own settings): leave out"
                    f" {either(flags, 'and')}, or start a new run with {'it' if len(flags) == 1 else 'them'}")


def from_keywords(keywords: Mapping, *types: type) -> list:
    """One object of each of `types` from keywords naming their fields (the Python API's keyword doors); a keyword
    no type has is refused as Python refuses one."""
    left, built = dict(keywords), []
    for kind in types:
        names = {each.name for each in fields(kind)}
        built.append(kind(**{name: left.pop(name) for name in list(left) if name in names}))
    if left:
        raise TypeError(f"unexpected keyword argument{'s' * (len(left) > 1)} {', '.join(map(repr, left))}")
    return built
