"""The loss hyperparameters a run is given, one type from the command line to config.json and back: per loss,
`{key: value}`, a list of values to sweep (every combination of the swept keys is trained)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from spml_cache.losses import plugins
from spml_cache.runtime.errors import SpmlError


@dataclass(frozen=True)
class Overrides:
    """`per_loss`: `{loss: {key: value or [values]}}`, a key for every loss asked for (maybe none)."""

    per_loss: dict[str, dict]

    @classmethod
    def given(cls, losses: Sequence[str], given: Mapping[str, float | Sequence[float]]) -> "Overrides":
        """What `--hp` gives: `{key: value}` (every selected loss that has `key`; with one loss, that loss, which
        then names an unknown key itself) or `{"loss.key": value}` (that loss only); a list sweeps the values."""
        per_loss: dict[str, dict] = {name: {} for name in losses}
        for key, value in given.items():
            values = list(value) if isinstance(value, (list, tuple)) else [value]
            if not values:
                raise SpmlError(f"--hp {key}=: the list is empty; give at least one value, e.g. --hp {key}=0.1")
            if not all(math.isfinite(one) for one in values):
                raise SpmlError(f"--hp {key}={','.join(f'{one:g}' for one in values)}: every value must be a finite"
                                " number")
            value = list(dict.fromkeys(values)) if isinstance(value, (list, tuple)) else value
            loss, dot, name = key.rpartition(".")
            loss = _loss_class(loss).name if ":" in loss else loss  # `--hp file.py:Class.key`: the plugin's name
            if dot:
                if loss not in per_loss:
                    raise SpmlError(f"--hp {key}={value}: loss '{loss}' is not among --loss ({', '.join(losses)})")
                targets = [loss]
            elif len(losses) == 1:
                targets = list(losses)
            else:
                targets = [n for n in losses if name in _loss_class(n).defaults]
                if not targets:
                    raise SpmlError(f"--hp {key}={value}: none of the selected losses has a hyperparameter '{name}'")
            for target in targets:
                per_loss[target][name] = value
        return cls(per_loss)

    @classmethod
    def stored(cls, hparams: Mapping[str, Mapping]) -> "Overrides":
        """A run's `hparams` as config.json keeps them (the resolved values, a swept key's as its list): resolving
        them again gives the same values. A None is a value derived at build time: left to derive again."""
        return cls({loss: {key: value for key, value in values.items() if value is not None}
                    for loss, values in hparams.items()})

    def __getitem__(self, loss: str) -> dict:
        """`overrides["ll_r"]`: the `{key: value or [values]}` given for `loss`."""
        return self.per_loss[loss]

    def with_paper_grids(self) -> "Overrides":
        """Every loss's own search space where its paper states one; the values given win."""
        return Overrides({loss: {**given, **{key: list(values) for key, values in _loss_class(loss).paper_grid.items()
                                             if key not in given}}
                          for loss, given in self.per_loss.items()})

    def combinations(self, loss: str) -> list[dict]:
        """One `{key: value}` per combination of `loss`'s swept values (their product, in the order given)."""
        return combinations(self.per_loss[loss])


def _loss_class(name: str):
    """A built-in or plugin loss class by name (the names reach here checked: `losses.get`)."""
    found = plugins.lookup(name)
    if found is None:
        raise SpmlError(f"unknown loss '{name}'")
    return found


def combinations(hparams: Mapping) -> list[dict]:
    """One dict of single values per combination of the values given as lists (their product, in the order
    given); `[hparams]` when none is a list."""
    swept = [key for key, value in hparams.items() if isinstance(value, list)]
    fixed = {key: value for key, value in hparams.items() if key not in swept}
    return [{**fixed, **dict(zip(swept, values))} for values in itertools.product(*(hparams[k] for k in swept))]


@dataclass(frozen=True)
class Combination:
    """One combination of a loss's resolved hyperparameters, known (hashed, compared) by its values of the keys
    swept over the grid: what a head record names (`HeadRecord.hparams`) and selection finds it by."""

    swept: tuple[tuple[str, object], ...]  # (key, value) of each swept key, in the loss's key order
    values: dict = field(compare=False)  # every hyperparameter, as the loss is built with

    @classmethod
    def of(cls, resolved: Sequence[Mapping]) -> list["Combination"]:
        """Each of a loss's resolved combinations, its swept keys (those whose values differ) found once."""
        swept = varying_keys(list(resolved))
        return [cls(tuple((key, values[key]) for key in swept), dict(values)) for values in resolved]

    @property
    def swept_values(self) -> dict:
        """`{key: value}` of the swept keys: what records, metrics.jsonl and results.json name."""
        return dict(self.swept)


def varying_keys(combos: list[dict]) -> list[str]:
    """The keys whose values differ between the dicts of `combos` (all sharing the first one's keys); compared by
    `repr`, as a key the grid does not sweep may hold an unhashable value."""
    return [key for key in combos[0] if len({repr(combo[key]) for combo in combos}) > 1]


def merged(combos: list[dict] | list[Combination]) -> dict:
    """`combos` (combinations) as one dict, the inverse of `combinations`: a varying key's values as a list, in
    order."""
    combos = [combo.values if isinstance(combo, Combination) else combo for combo in combos]
    varying = varying_keys(combos)
    return {key: list(dict.fromkeys(c[key] for c in combos)) if key in varying else combos[0][key] for key in combos[0]}
