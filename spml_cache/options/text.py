"""Options given as text (the command line's, or a Python caller's): comma lists, names, `--hp` items. Each reader
names its flag in the one line a bad text gets; the stages check the values themselves."""

from __future__ import annotations

from typing import Iterable, Mapping

from spml_cache import datasets, observation  # registries the help texts list (no torch)
from spml_cache.runtime.errors import SpmlError


def parse_list(text: str, flag: str, kind: type) -> list:
    """A comma list of numbers (`--lr 1e-3,1e-4`): a clear error naming the flag otherwise."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    try:
        return [kind(item) for item in items]
    except ValueError:
        what = "numbers" if kind is float else "whole numbers"
        raise SpmlError(f"{flag} {text!r}: expected a comma list of {what}") from None


def parse_names(text: str) -> list[str]:
    """A comma list of names (`--loss an,role`)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def parse_hparams(items: Iterable[str], flag: str = "--hp") -> dict:
    """`--hp key=value` or `--hp loss.key=value` (repeatable) as `{key: value}`; `key=v1,v2,...` as a list of
    values to sweep (several swept keys give their product). The losses check the values (`losses.Overrides`)."""
    given = {}
    for item in items:
        if not isinstance(item, str):
            raise SpmlError(f"{flag} {item!r}: expected key=value text, e.g. {flag} alpha=0.1")
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise SpmlError(f"{flag} {item!r}: expected key=value or loss.key=value, e.g. {flag} alpha=0.1")
        if not text.strip(","  " ").strip():
            raise SpmlError(f"{flag} {item!r}: no value; give one, or a comma list to sweep, e.g. {flag}"
                            f" {key.strip()}=0.1,0.2")
        values = []
        for part in text.split(","):
            try:
                values.append(int(part) if part.strip().lstrip("-").isdigit() else float(part))
            except ValueError:
                raise SpmlError(f"{flag} {item!r}: {part.strip()!r} is not a number (a comma list sweeps values)") from None
        given[key.strip()] = values if "," in text else values[0]
    return given


def read_hparams(value, flag: str) -> dict:
    """`--hp`'s items as `{key: value}`: the flag's text (one item, or a list of them), or a Python mapping whose
    values are numbers, lists of numbers, or the flag's text of one (`{"ll_r.delta": "0.001,0.002"}`)."""
    if isinstance(value, str):
        return parse_hparams([value], flag)
    if not isinstance(value, Mapping):
        return parse_hparams(list(value), flag)
    read = {}
    for key, one in value.items():
        if isinstance(one, str):
            read.update(parse_hparams([f"{key}={one}"], flag))
        elif _numbers(one):
            read[key] = list(one) if isinstance(one, (list, tuple)) else one
        else:
            raise SpmlError(f"{flag} {key}={one!r}: give a number, a list of numbers to sweep, or their text"
                            f" ({flag} {key}=0.1,0.2)")
    return read


def _numbers(value) -> bool:
    """A number, or a list of them (never a bool)."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return all(isinstance(one, (int, float)) and not isinstance(one, bool) for one in values)


def read_rules(value, flag):
    """`--observe`'s rules from text (`single,entry:0.1`), texts, or `Rule`s: a list of checked rules."""
    if isinstance(value, str) or any(isinstance(one, str) for one in value):
        return observation.parse_rules(value, flag)
    return list(value)


def either(names: list[str], last: str = "or") -> str:
    """`a, b or c` (`last`: "and", `a, b and c`): names as a help text or a fix lists them."""
    return ", ".join(names[:-1]) + f" {last} {names[-1]}" if len(names) > 1 else names[0]


# Help texts list what the registries hold, so that a new dataset or rule appears in --help by itself.
DATASETS_HELP = either(datasets.names())
RULES_HELP = ", ".join(rule.example for rule in observation.RULES.values())
PUBLISHED_HELP = either(list(datasets.values_of("PUBLISHED_ID_PREFIX")))  # the datasets import-features knows
