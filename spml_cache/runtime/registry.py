"""The one registry idiom: losses, observation rules, datasets and backbone families are each a `Registry` of
entries known by name.

Names are listed in the order they were registered (that order is every listing's: `spml-cache losses`, the
CLI's help, the docs' tables). An entry is registered as it is (a class, with `register` as a decorator) or
lazily (`register_lazy`: a loader called when the entry is asked for, so a backbone family's module and the
package it needs are imported only when that family is used). An unknown name is refused in one line by
`errors.unknown_name`'s wording, with the closest name and the valid list.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass
from typing import Generic, TypeVar

from spml_cache.runtime.errors import SpmlError, unknown_name

Entry = TypeVar("Entry")


@dataclass(frozen=True)
class Param:
    """One parameter of a registry's entry (an observation rule's, a loss's hyperparameter): its name, its type,
    what it must satisfy (`valid`, and `must`, what a bad value is told), its default (None: required or derived)."""

    name: str
    kind: type  # int or float (an option's: its type, options/declared.py)
    valid: Callable[[float], bool]
    must: str  # e.g. "in (0, 1]"
    _: KW_ONLY
    default: float | None = None
    all_is: int | None = None  # the number that "all" stands for (uniform's -1)
    low: float = -math.inf  # the interval `valid` checks, where it is one (`between`)
    high: float = math.inf

    @classmethod
    def between(cls, name: str, low: float, high: float, brackets: str = "[]", kind: type = float) -> "Param":
        """A parameter in an interval, each end closed `[` `]` or open `(` `)`: `between("rho", 0, 1, "[)")`."""
        if len(brackets) != 2 or brackets[0] not in "[(" or brackets[1] not in "])":
            raise ValueError(f"parameter {name}: brackets {brackets!r} must be two of [ ( and ] )")

        def valid(value: float) -> bool:
            above = value >= low if brackets[0] == "[" else value > low
            return above and (value <= high if brackets[1] == "]" else value < high)

        return cls(name, kind, valid, f"in {brackets[0]}{low:g}, {high:g}{brackets[1]}", low=low, high=high)


class Registry(Generic[Entry]):
    """Entries by name. `kind` names them in refusals (`unknown loss 'x'`); `listing` introduces the valid
    names after a refusal (`valid:`, `choose one of`), each shown by `shown` (its name by default)."""

    def __init__(self, kind: str, listing: str = "choose one of",
                 shown: Callable[[str, Entry], str] | None = None) -> None:
        self.kind = kind
        self.listing = listing
        self._shown = shown
        self._entries: dict[str, Entry] = {}
        self._loaders: dict[str, Callable[[], Entry]] = {}
        self._order: list[str] = []

    def register(self, entry: Entry, name: str | None = None) -> Entry:
        """Add `entry` under `name` (default: its `name` attribute); returns it, so that it decorates a class."""
        name = entry.name if name is None else name
        self._claim(name)
        self._entries[name] = entry
        return entry

    def register_lazy(self, name: str, load: Callable[[], Entry]) -> None:
        """Add the entry `load()` gives, called each time `name` is asked for: a module import is cached by Python,
        and the checks around it (is the family's package installed?) stay as live as a plain import."""
        self._claim(name)
        self._loaders[name] = load

    def _claim(self, name: str) -> None:
        if name in self._order:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._order.append(name)

    def names(self) -> list[str]:
        """Every name, in the order of registration."""
        return list(self._order)

    def __contains__(self, name: object) -> bool:
        return name in self._order

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)

    def find(self, name: str) -> Entry | None:
        """The entry registered as `name` (loaded now if it is lazy), or None."""
        if name in self._loaders:
            return self._loaders[name]()
        return self._entries.get(name)

    def items(self) -> list[tuple[str, Entry]]:
        """(name, entry) in order, every lazy entry loaded."""
        return [(name, self.find(name)) for name in self._order]

    def values(self) -> list[Entry]:
        return [entry for _, entry in self.items()]

    def unknown(self, name: str) -> str:
        """`unknown <kind> '<name>'`, with the closest registered name as "did you mean"."""
        return unknown_name(self.kind, name, self._order)

    def valid(self) -> str:
        """The valid names as a refusal lists them, after `listing`."""
        shown = self._order if self._shown is None else [self._shown(n, self.find(n)) for n in self._order]
        return f"{self.listing} {', '.join(shown)}"

    def get(self, name: str, where: str = "", hint: str = "") -> Entry:
        """The entry registered as `name`; else one line: `where`, the refusal, the valid names, `hint`."""
        found = self.find(name)
        if found is None:
            raise SpmlError(f"{where}{self.unknown(name)}; {self.valid()}{hint}")
        return found
