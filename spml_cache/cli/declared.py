"""A command built from its declared options (options/: a stage's, the report's, the demo's): a flag per option,
with its help, its type and its default, what changes results first and where it runs in a panel of its own; the
command's function gets the options objects, built and checked from the flags as given (a flag left out: the
field's own default).
"""

from __future__ import annotations

import inspect
from dataclasses import MISSING, fields
from typing import Callable, List, Optional

import typer

from spml_cache.options import Option, Options

PLACEMENT_PANEL = "Where and how it runs (the results stay the same)"


def stage_command(app: typer.Typer, name: str, *types: type[Options]) -> Callable:
    """Register the decorated function as command `name`, its flags those of `types`' declared options (a stage's,
    `report`'s, the demo's); it is called with one object of each type (its docstring is the command's help)."""

    def register(body: Callable) -> Callable:
        parameters = [_parameter(option, default, kind.results) for kind in types
                      for option, default in _flagged(kind)]
        names = [parameter.name for parameter in parameters]
        if len(set(names)) != len(names):
            raise ValueError(f"{name}: two options share a name ({names})")

        def command(**given) -> None:
            return body(*(_built(kind, given) for kind in types))

        command.__signature__ = inspect.Signature(parameters)
        command.__doc__, command.__name__ = body.__doc__, body.__name__
        app.command(name)(command)
        return body

    return register


def _flagged(kind: type[Options]):
    """(option, the field's default) of each option of `kind` the command line gives (a flag, or the argument)."""
    defaults = {each.name: each.default for each in fields(kind)}
    return [(option, defaults[option.name]) for option in kind.declared().values() if option.flag != ""]


def _parameter(option: Option, default, results: bool) -> inspect.Parameter:
    panel = None if results else PLACEMENT_PANEL
    if option.many:  # a list: typer gives nothing when it is left out, and the field keeps its own default
        default = None
    if option.argument:
        annotation = Optional[List[option.kind]] if option.many else option.kind
        info = typer.Argument(... if default is MISSING else default, help=option.help, show_default=False)
        return inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)
    if option.switch:  # a flag without a value
        annotation, default = bool, False
    elif option.repeat:
        annotation = Optional[List[str]]
    else:
        annotation = Optional[str if option.many or option.read is not None else option.kind]
    info = typer.Option(default, option.cli_flag, help=option.help, rich_help_panel=panel, hidden=option.hidden)
    return inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)


def _built(kind: type[Options], given: dict) -> Options:
    """An object of `kind` from the flags: a switch given is the opposite of its option's default; a flag left out
    (a switch not given, nothing) leaves the field's own default."""
    values = {}
    for option, _ in _flagged(kind):
        value = given[option.name]
        if option.switch:
            if not value:
                continue
            value = not option.default
        if value is not None:
            values[option.name] = value
    return kind(**values)

