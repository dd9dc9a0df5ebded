"""Observation rules (docs/protocol.md, "Observation rules"): which of the full labels a learner is shown.

A rule turns the full 0/1 labels of the training and validation rows into an observed matrix (int8: 1 observed
positive, 0 unknown, -1 observed negative); the test split always keeps its full labels. Each rule is a class
registered by name (`@register`, the way losses are): its source, its parameters (parsed and checked once from
text such as `entry:0.1` or `uniform:pos=1,neg=-1`), its dense draw and, where one exists, its sparse draw (the
CSR form of the dense draw, entry for entry). A `Rule` is one rule with its values and seed, what `--observe`
names. A rule's masks depend only on the rows' full labels (and, for `largest` and `size`, their instance areas),
so stage one can store them and stage two can draw a missing one from the cache's labels with the same result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from spml_cache.labels import is_sparse
from spml_cache.observation.keys import DEFAULT_RULE, FLAG
from spml_cache.protocol import OBSERVE_SEED
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.registry import Param, Registry


@dataclass(frozen=True)
class Areas:
    """Instance areas of the rows' classes (0 where the class has no instance), from a dataset's boxes or masks."""

    largest: np.ndarray  # float [N, C]: the area of the class's largest instance in each image
    total: np.ndarray  # float [N, C]: the summed area of the class's instances in each image


# numpy seeds are 32-bit, and a per-split rule draws val with seed + 1
MAX_SEED = 2**32 - 2
SEED = Param("seed", int, lambda v: 0 <= v <= MAX_SEED, f"a whole number from 0 to {MAX_SEED}", default=OBSERVE_SEED)


class ObservationRule:
    """One kind of rule. A subclass sets the class attributes and writes `draw_dense`; one that can draw on
    sparse labels without an [N, C] matrix writes `draw_sparse` too (the same seed, the same random stream, so
    the result is the dense draw's CSR form); one that cannot is refused on a sparse cache by the default."""

    name: ClassVar[str]
    source: ClassVar[str]
    summary: ClassVar[str]
    params: ClassVar[tuple[Param, ...]] = ()
    needs_areas: ClassVar[bool] = False
    per_split: ClassVar[bool] = False  # drawn over each split's rows on its own (train with the seed, val seed + 1)
    example: ClassVar[str] = ""  # how the rule is written, e.g. "entry:P" (its name when empty)
    # how the rule is written when it observes a positive of every image that has one ("keep-pos:F"); empty: it may
    # observe none (a loss that learns only from observed positives is refused under it)
    keeps_a_positive: ClassVar[str] = ""
    why_not_sparse: ClassVar[str] = ""  # what a sparse cache is told when the rule has no sparse draw

    @classmethod
    def draw_dense(cls, labels: np.ndarray, areas: Areas | None, seed: int, **values) -> np.ndarray:
        raise NotImplementedError

    @classmethod
    def draw_sparse(cls, labels, seed: int, **values):
        raise SpmlError(cls.refusal_on_sparse())

    @classmethod
    def observes_nothing(cls, **values) -> bool:
        """Whether these parameter values show no label at all (refused when parsed: every loss would train on
        nothing)."""
        return False

    @classmethod
    def has_sparse_draw(cls) -> bool:
        own = getattr(cls.draw_sparse, "__func__", cls.draw_sparse)  # a subclass writes it as a staticmethod
        return own is not ObservationRule.draw_sparse.__func__

    @classmethod
    def refusal_on_sparse(cls) -> str:
        drawn = [rule.name for rule in RULES.values() if rule.has_sparse_draw()]
        return (f"this cache stores its labels sparse (many classes), and {cls.name} {cls.why_not_sparse}: use"
                f" {FLAG} {', '.join(drawn[:-1])} or {drawn[-1]} (or given with a label mask)")


# Every rule, listed (in refusals, --help, docs/protocol.md's table) as it is written, in registration order.
RULES: Registry[type[ObservationRule]] = Registry("rule", listing="use one of", shown=lambda _, rule: rule.example)


def register(cls: type[ObservationRule]) -> type[ObservationRule]:
    """Class decorator: add a rule to the registry under its `name` (the order of registration is the order
    rules are listed in)."""
    cls.example = cls.example or cls.name
    return RULES.register(cls)


def keeping_a_positive() -> str:
    """The rules that observe a positive of every image that has one, as written (`single, uniform:pos=K,
    keep-pos:F`): what a loss that learns only from observed positives is pointed to."""
    return ", ".join(rule.keeps_a_positive for rule in RULES.values() if rule.keeps_a_positive)


@dataclass(frozen=True)
class Rule:
    """One rule with its parameters: what `--observe` names, and the key of its results."""

    name: str
    values: tuple[tuple[str, float], ...] = ()  # (param, value), in the entry's order
    seed: int = OBSERVE_SEED

    @property
    def entry(self) -> type[ObservationRule]:
        return RULES.get(self.name)

    @property
    def text(self) -> str:
        """The canonical text: `entry:0.1`, `uniform:pos=1,neg=all`, `per-class:5,seed=3`."""
        parts = []
        for i, (key, value) in enumerate(self.values):
            param = self.entry.params[i]
            shown = "all" if param.all_is is not None and value == param.all_is else f"{value:.15g}"  # exact
            parts.append(shown if i == 0 and len(self.entry.params) == 1 else f"{key}={shown}")
        parts += [f"seed={self.seed}"] if self.seed != OBSERVE_SEED else []
        return self.name + (":" + ",".join(parts) if parts else "")

    def __str__(self) -> str:
        return self.text

    def param(self, key: str) -> float:
        return dict(self.values)[key]

    def check_form(self, labels) -> bool:
        """Whether `labels` are sparse; a rule with no sparse draw refuses them in one line."""
        if not is_sparse(labels):
            return False
        if not self.entry.has_sparse_draw():
            raise SpmlError(f"{FLAG} {self}: {self.entry.refusal_on_sparse()}")
        return True

    def draw(self, labels: np.ndarray, areas: Areas | None = None, seed: int | None = None) -> np.ndarray:
        """The observed matrix (int8 [N, C]) of full labels `labels` (uint8 [N, C]; sparse: sparse), deterministic."""
        seed = self.seed if seed is None else seed
        if self.check_form(labels):
            return self.entry.draw_sparse(labels, seed, **dict(self.values))
        labels = np.asarray(labels, dtype=np.uint8)
        if self.entry.needs_areas and areas is None:
            raise SpmlError(f"{FLAG} {self}: needs instance areas, which this dataset does not have")
        return np.asarray(self.entry.draw_dense(labels, areas, seed, **dict(self.values)), dtype=np.int8)


def parse_rule(text: str, flag: str = FLAG) -> Rule:
    """One rule from its text (`name` or `name:args`, args `value` and/or `key=value`), checked."""
    name, _, arg_text = text.strip().partition(":")
    name = name.strip()
    entry = RULES.get(name, where=f"{flag} {text}: ", hint=' (docs/protocol.md, "Observation rules")')
    params = {param.name: param for param in (*entry.params, SEED)}
    given: dict[str, str] = {}
    for i, arg in enumerate(a.strip() for a in arg_text.split(",") if arg_text.strip()):
        key, equals, value = (part.strip() for part in arg.partition("="))
        if not equals and i == 0 and entry.params:  # the first parameter may go without its name: entry:0.1
            key, value = entry.params[0].name, arg
        elif not equals or key not in params or key in given:
            raise SpmlError(f"{flag} {text}: '{arg}' is not a parameter of {name}; write it as {entry.example}")
        given[key] = value
    values = {}
    for key, param in params.items():
        if key not in given:
            if param.default is None:
                raise SpmlError(f"{flag} {text}: {name} needs its {key}, e.g. {entry.example}")
            values[key] = param.default
            continue
        values[key] = _number(given[key], param, f"{flag} {text}: {key}")
    seed = int(values.pop("seed"))
    if entry.observes_nothing(**values):
        raise SpmlError(f"{flag} {text}: observes no label at all, so every loss would train on nothing; observe at"
                        f" least one, e.g. {entry.example}")
    return Rule(name, tuple((param.name, values[param.name]) for param in entry.params), seed)


def _number(text: str, param: Param, where: str) -> float:
    if param.all_is is not None and text == "all":
        return param.all_is
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isfinite(value) and param.kind is int and value == int(value):
        value = int(value)
    if not math.isfinite(value) or (param.kind is int and not isinstance(value, int)) or not param.valid(value):
        raise SpmlError(f"{where} must be {param.must}, got {text}")
    return value


def parse_rules(text: str | list[str] | tuple[str, ...] | None, flag: str = FLAG) -> list[Rule]:
    """`--observe R1,R2,...` as checked rules, each once, in the order given; None: `single` alone.

    A `key=value` item continues the rule before it: `single,uniform:pos=2,neg=1` is two rules."""
    if text is None:
        return [parse_rule(DEFAULT_RULE)]
    items = text.split(",") if isinstance(text, str) else [part for item in text for part in item.split(",")]
    groups: list[str] = []
    for item in (item.strip() for item in items):
        if "=" in item and ":" not in item and groups:
            groups[-1] += "," + item
        elif item:
            groups.append(item)
    if not groups:
        raise SpmlError(f"{flag} is empty: name a rule, e.g. {flag} single,entry:0.1")
    rules = {}
    for group in groups:
        rule = parse_rule(group, flag)
        rules.setdefault(rule.text, rule)
    return list(rules.values())
