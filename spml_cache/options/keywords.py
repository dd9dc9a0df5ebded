"""The Python face's keywords (`import spml_cache as sc`: `sc.linear(lr=1e-3, batch_size=8, ...)`), drawn from the
same declarations as the command line's flags: each keyword is its option's `Option.keyword` (the flag's name), takes
what the flag takes (the flag's text, or a Python value: a list, a number, a path), and is read and checked by the
option's declaration, a bad value's line naming the keyword; a keyword no option has is one line naming the door
and the closest keyword. Never a bare TypeError.

From the declarations too: each door's signature (`signature`, what `help()` and a notebook's completion show) and
the parameters of its docstring (`parameters_doc`), so that what a door takes is written once. `callable_stage`
makes a stage's package callable as its door (`sc.linear` is the package `spml_cache.linear`, which an import of it
puts on `spml_cache` in any case).
"""

from __future__ import annotations

import inspect
import os
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING
from pathlib import Path

from spml_cache.options.declared import Option, Options, _bad
from spml_cache.runtime.errors import SpmlError, closest

PROGRESS_HELP = ("Show the progress bars and the notes the command line prints (rich: a terminal's bars, or a"
                 " notebook's); default: quiet.")


def keyword_options(*types: type[Options]) -> dict[str, tuple[type[Options], Option]]:
    """`{keyword: (its type, its option)}` of every declared option of `types`, in the order declared."""
    found = {}
    for kind in types:
        for option in kind.declared().values():
            if option.keyword in found:
                raise ValueError(f"two options share the keyword {option.keyword} ({found[option.keyword][0]}, {kind})")
            found[option.keyword] = (kind, option)
    return found


def from_flag_keywords(door: str, keywords: Mapping, *types: type[Options], also: Sequence[str] = ()) -> list:
    """One object of each of `types` from keywords named as the command line's flags (`Option.keyword`: `lr`,
    `batch_size`, `hp`, `from_run`), each value what the flag takes (a list, or the flag's comma text), read and
    checked by its declaration with a bad value's line naming the keyword; a keyword no option has is one line
    naming `door` and the keyword meant: the one of an option's field name (`lrs`, `trackers`: `lr`, `log`), else
    the closest (of the options', and of `also`: the door's own, e.g. `progress`)."""
    by_keyword = keyword_options(*types)
    by_field = {option.name: keyword for keyword, (_, option) in by_keyword.items()}  # `trackers` is `log`
    values: dict[type, dict] = {kind: {} for kind in types}
    for keyword, value in keywords.items():
        if keyword not in by_keyword:
            known = [*by_keyword, *also]
            near = by_field.get(keyword) or closest(keyword, known)
            raise SpmlError(f"{door}: no keyword {keyword!r}" + (f"; did you mean {near}?" if near else "")
                            + f" (its keywords: {', '.join(known)})")
        kind, option = by_keyword[keyword]
        if value is not None:
            values[kind][option.name] = read_keyword(option, value, keyword)
    for keyword, (kind, option) in by_keyword.items():
        if option.name not in values[kind] and kind.__dataclass_fields__[option.name].default is MISSING:
            raise SpmlError(f"{door}: {keyword} is missing: {option.help}")
    return [kind(**values[kind]) for kind in types]


def read_keyword(option: Option, value, keyword: str):
    """`value` as `option` holds it, given to the Python face as `keyword`: the flag's text read as the flag reads
    it (`epochs="3"`, `lr="1e-3,1e-4"`), or a Python value of the option's kind; anything else one line naming the
    keyword and what it takes."""
    if isinstance(value, str) and option.read is None and not option.many and option.kind in (int, float):
        try:
            value = option.kind(value.strip())
        except ValueError:
            raise SpmlError(f"{keyword} {value!r}: {takes(option)}") from None
    try:
        return option.checked(value, keyword)
    except SpmlError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError):  # a value of no kind the option reads
        raise SpmlError(f"{keyword} {_shown(value)}: {takes(option)}") from None


def _shown(value) -> str:
    try:
        return _bad(value)
    except (TypeError, ValueError):
        return repr(value)


def takes(option: Option) -> str:
    """What an option takes in Python, as a bad value's fix says it: the flag's text or the Python values it reads."""
    flag = option.cli_flag if option.flag != "" else None
    text = f", or {flag}'s text" if flag and not option.switch else ""
    if option.repeat:
        return f"give KEY=VALUE text, a list of them, or a {{key: value}} mapping (what {flag} takes)"
    if option.read is not None:
        return f"give what {flag or option.keyword} takes: {option.help}"
    if option.switch or option.kind is bool:
        return "give True or False"
    what = {int: "a whole number", float: "a number", Path: "a path (a str or pathlib.Path)", str: "a str"}.get(
        option.kind, f"a {option.kind.__name__}")
    if option.many:
        return f"give {what}, a list of them{text}"
    return f"give {what}" + (text if option.kind in (int, float) else "")


# --- signatures and docstrings -----------------------------------------------------------------------------


def signature(*types: type[Options], positional: Sequence[str] = (), varargs: str | None = None,
              extra: Sequence[inspect.Parameter] = (), returns=inspect.Signature.empty) -> inspect.Signature:
    """A door's signature from its declarations: the `positional` keywords (an argument, `extract`'s dataset)
    first, then `varargs` (`report`'s run directories), then every other keyword, each with its default as given
    (None: not given, the default its help names applies), then `extra` (the door's own, `progress`)."""
    by_keyword = keyword_options(*types)
    parameters = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in positional]
    if varargs:
        parameters.append(inspect.Parameter(varargs, inspect.Parameter.VAR_POSITIONAL))
    for keyword, (kind, option) in by_keyword.items():
        if keyword in positional or keyword == varargs:
            continue
        default = kind.__dataclass_fields__[option.name].default
        parameters.append(inspect.Parameter(keyword, inspect.Parameter.KEYWORD_ONLY,
                                            default=inspect.Parameter.empty if default is MISSING else default))
    return inspect.Signature([*parameters, *extra], return_annotation=returns)


def parameters_doc(*types: type[Options], extra: Mapping[str, str] | None = None) -> str:
    """The "Parameters" section of a door's docstring: each keyword, its flag, what it takes and its help, from
    the declarations (and `extra`: the door's own keywords and their help)."""
    lines = ["Parameters", "----------"]
    for keyword, (_, option) in keyword_options(*types).items():
        flag = "argument" if option.argument else option.cli_flag if option.flag != "" else "Python only"
        lines += [f"{keyword} : {flag}", f"    {option.help} ({kind_text(option)})"]
    for keyword, text in (extra or {}).items():
        lines += [f"{keyword} : Python only", f"    {text}"]
    return "\n".join(lines)


def kind_text(option: Option) -> str:
    """What an option's keyword takes, in a few words (python-api.md's "takes" column)."""
    if option.repeat:
        return "KEY=VALUE text, a list of them, or a mapping"
    if option.switch or option.kind is bool:
        return "True or False"
    what = {int: "whole number", float: "number", Path: "path"}.get(option.kind, "text")
    if option.many:
        return f"{what}s: a list, one, or comma text" if option.kind in (int, float) else f"{what}s: a list"
    return what


def documented(door: Callable, *types: type[Options], positional: Sequence[str] = (), varargs: str | None = None,
               progress: bool = True) -> Callable:
    """`door` with its signature and the parameters of its docstring drawn from `types`' declarations (its own
    docstring first: what it does and returns), and its own keyword `progress` (a door that shows any)."""
    extra = {"progress": PROGRESS_HELP} if progress else {}
    door.__signature__ = signature(*types, positional=positional, varargs=varargs,
                                   extra=[inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=False)
                                          for name in extra],
                                   returns=inspect.signature(door).return_annotation)
    door.__doc__ = inspect.cleandoc(door.__doc__ or "") + "\n\n" + parameters_doc(*types, extra=extra)
    door.declared = types  # what docs/python-api.md's reference is drawn from (scripts/python_api.py)
    door.own_keywords = extra
    return door


def no_positional(door: str, args: tuple, progress) -> None:
    """A door's positional arguments (it takes keywords alone, or beside its one argument) and its `progress`: one
    line naming the door."""
    if args:
        raise SpmlError(f"{door}: {len(args)} positional argument{'s' * (len(args) > 1)} too many ({_shown(args[0])}"
                        f"{', ...' * (len(args) > 1)}): give every option by its keyword, named as its flag")
    if not isinstance(progress, bool):
        raise SpmlError(f"progress {_shown(progress)}: give True or False")


def callable_stage(name: str, door: Callable) -> None:
    """Make the package `name` (a stage's, `spml_cache.linear`) callable as `door`: `sc.linear(...)` is
    `spml_cache.linear`, which Python puts on `spml_cache` as soon as anything imports it, so the face's
    function and the stage's package must be one object. Its attributes stay the package's; its docstring (what
    `help(sc.linear)` shows first) is the door's, then the package's own."""
    module = sys.modules[name]
    module.__doc__ = f"{door.__doc__}\n\nThe package {name}: {module.__doc__}"

    def __call__(self, *args, **keywords):
        return door(*args, **keywords)

    __call__.__doc__ = door.__doc__
    module.__class__ = type(f"{door.__name__}_door", (types.ModuleType,), {"__call__": __call__})
    module.__signature__ = inspect.signature(door)


# --- what a door resolves as the command line does ---------------------------------------------------------


def default_data_root() -> Path | None:
    """`SPML_DATA`, the default data root (`--root`, `root=`)."""
    value = os.environ.get("SPML_DATA")
    return Path(value) if value else None
