"""Observation rules (docs/protocol.md, "Observation rules"): which of the full labels a learner is shown.

A rule turns the full 0/1 labels of the training and validation rows into an observed matrix (int8: 1 observed
positive, 0 unknown, -1 observed negative); the test split always keeps its full labels. Each rule is a
registered entry (`@register`, the way timm registers models): its name, its source, its parameters (parsed and
checked once from text such as `entry:0.1` or `uniform:pos=1,neg=-1`) and its seed. A rule's masks depend only on
the rows' full labels (and, for `largest` and `size`, their instance areas), so stage one can store them in the
cache and stage two can draw any missing one from the cache's labels, with the same result (`for_cache`).

Row-wise rules draw over the official training rows in their order, before the train/val split, as Cole et al.'s
`generate_observed_labels` does: `single` is today's draw, `uniform:pos=K,neg=M` its generalisation. A cache
whose train and val rows are the whole official training set gets them back in that order from the protocol's
split (`official_positions`); a cut one (`--limit`, images left out) draws over its own rows, train then val.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from spml_cache import observation_sparse as on_sparse
from spml_cache.cache import sparse
from spml_cache.errors import SpmlError, unknown_name
from spml_cache.protocol import OBSERVE_SEED, hide_unannotated, observe_labels, split_train_val

DEFAULT_RULE = "single"
FLAG = "--observe"


@dataclass(frozen=True)
class Areas:
    """Instance areas of the rows' classes (0 where the class has no instance), from a dataset's boxes or masks."""

    largest: np.ndarray  # float [N, C]: the area of the class's largest instance in each image
    total: np.ndarray  # float [N, C]: the summed area of the class's instances in each image


@dataclass(frozen=True)
class Param:
    """One parameter of a rule: its name, its type, what it must satisfy, its default (None: required)."""

    name: str
    kind: type  # int or float
    valid: Callable[[float], bool]
    must: str  # what a bad value is told, e.g. "in (0, 1]"
    default: float | None = None
    all_is: int | None = None  # the number that "all" stands for (uniform's -1)


@dataclass(frozen=True)
class RuleEntry:
    """A registered rule: `draw(labels, areas, rng, **params)` gives the observed matrix of `labels`."""

    name: str
    source: str
    summary: str
    params: tuple[Param, ...]
    draw: Callable
    needs_areas: bool = False
    per_split: bool = False  # drawn over each split's rows on its own (train with the seed, val with seed + 1)
    example: str = ""
    sparse_draw: Callable | None = None  # `(labels, seed, **params)` on SparseLabels (observation_sparse.py)
    observes_nothing: Callable[..., bool] | None = None  # `(**params)`: True where the rule shows no label at all


RULES: dict[str, RuleEntry] = {}


def register(name: str, *, source: str, summary: str, params: tuple[Param, ...] = (), needs_areas: bool = False,
             per_split: bool = False, example: str = "", sparse_draw: Callable | None = None,
             observes_nothing: Callable[..., bool] | None = None):
    def add(draw: Callable) -> Callable:
        RULES[name] = RuleEntry(name, source, summary, params, draw, needs_areas, per_split, example or name,
                                sparse_draw, observes_nothing)
        return draw

    return add


# numpy seeds are 32-bit, and a per-split rule draws val with seed + 1
MAX_SEED = 2**32 - 2
SEED = Param("seed", int, lambda v: 0 <= v <= MAX_SEED, f"a whole number from 0 to {MAX_SEED}", OBSERVE_SEED)


@dataclass(frozen=True)
class Rule:
    """One rule with its parameters: what `--observe` names, and the key of its results."""

    name: str
    values: tuple[tuple[str, float], ...] = ()  # (param, value), in the entry's order
    seed: int = OBSERVE_SEED

    @property
    def entry(self) -> RuleEntry:
        return RULES[self.name]

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

    def draw(self, labels: np.ndarray, areas: Areas | None = None, seed: int | None = None) -> np.ndarray:
        """The observed matrix (int8 [N, C]) of full labels `labels` (uint8 [N, C]; sparse: sparse), deterministic."""
        seed = self.seed if seed is None else seed
        if sparse.is_sparse(labels):
            on_sparse.check(self, FLAG)
            return self.entry.sparse_draw(labels, seed, **dict(self.values))
        labels = np.asarray(labels, dtype=np.uint8)
        if self.entry.needs_areas and areas is None:
            raise SpmlError(f"{FLAG} {self}: needs instance areas, which this dataset does not have")
        observed = self.entry.draw(labels, areas, seed, **dict(self.values))
        return np.asarray(observed, dtype=np.int8)


def parse_rule(text: str, flag: str = FLAG) -> Rule:
    """One rule from its text (`name` or `name:args`, args `value` and/or `key=value`), checked."""
    name, _, arg_text = text.strip().partition(":")
    name = name.strip()
    if name not in RULES:
        known = ", ".join(entry.example for entry in RULES.values())
        raise SpmlError(f"{flag} {text}: {unknown_name('rule', name, RULES)}; use one of {known} (docs/protocol.md, \"Observation"
                        " rules\")")
    entry = RULES[name]
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
    if entry.observes_nothing is not None and entry.observes_nothing(**values):
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


# --- the rules --------------------------------------------------------------------------------------------

def _fraction(name: str, letter: str) -> Param:
    return Param(name, float, lambda v: 0 < v <= 1, f"in (0, 1] (the fraction {letter})")


COUNT = "a whole number >= 0, or all (-1)"


@register("single", source="Cole et al., CVPR 2021 (generate_observed_labels.py, num_pos=1, num_neg=0)",
          summary="one positive per image, drawn uniformly; no negatives (the SPML setting, the default)",
          sparse_draw=on_sparse.single)
def _single(labels, areas, seed):
    return observe_labels(labels, num_pos=1, num_neg=0, seed=seed)


@register("uniform", source="Cole et al., CVPR 2021 (generate_observed_labels.py: num_pos, num_neg; -1 = all)",
          summary="K positives and M negatives per image, drawn uniformly (all of them when fewer, or K/M = all)",
          params=(Param("pos", int, lambda v: v >= -1, COUNT, 1, all_is=-1),
                  Param("neg", int, lambda v: v >= -1, COUNT, 0, all_is=-1)),
          example="uniform:pos=K,neg=M", sparse_draw=on_sparse.uniform,
          observes_nothing=lambda pos, neg: pos == 0 and neg == 0)
def _uniform(labels, areas, seed, pos, neg):
    return observe_labels(labels, num_pos=pos, num_neg=neg, seed=seed)


@register("entry", source="the partial-label papers' known label proportion (SST, Chen et al. AAAI 2022; SARB,"
          " Pu et al. AAAI 2022; DualCoOp, Sun et al. NeurIPS 2022)",
          summary="every entry, positive or negative, observed with probability P", params=(_fraction("p", "P"),),
          example="entry:P", sparse_draw=on_sparse.entry)
def _entry(labels, areas, seed, p):
    shown = np.random.RandomState(seed).random_sample(labels.shape) < p
    return np.where(shown, np.where(labels == 1, 1, -1), 0)


@register("keep-pos", source="positives dropped at random (a partial-positive setting; no negatives observed)",
          summary="each positive kept with probability F, at least one per image that has one; no negatives",
          params=(_fraction("f", "F"),), example="keep-pos:F", sparse_draw=on_sparse.keep_positives)
def _keep_positives(labels, areas, seed, f):
    rng = np.random.RandomState(seed)
    positive = labels == 1
    kept = positive & (rng.random_sample(labels.shape) < f)
    for row in np.flatnonzero(positive.any(axis=1) & ~kept.any(axis=1)):  # in row order: deterministic
        kept[row, rng.choice(np.flatnonzero(positive[row]))] = True
    return kept.astype(np.int8)


@register("per-class", source="a per-class annotation budget (N labelled images per class and side)",
          summary="per class, N of its positive and N of its negative images observed (all when fewer)",
          params=(Param("n", int, lambda v: v >= 0, "a whole number >= 0"),), per_split=True, example="per-class:N",
          sparse_draw=on_sparse.per_class, observes_nothing=lambda n: n == 0)
def _per_class(labels, areas, seed, n):
    rng = np.random.RandomState(seed)
    observed = np.zeros(labels.shape, dtype=np.int8)
    for column in range(labels.shape[1]):
        for value, mark in ((1, 1), (0, -1)):
            rows = np.flatnonzero(labels[:, column] == value)
            rng.shuffle(rows)
            observed[rows[:n], column] = mark
    return observed


@register("largest", source="the deterministic extreme of the size bias of Cole, Arroyo and Perona, arXiv 2305.15584"
          " (2023)", summary="the class of the image's largest instance; no negatives",
          needs_areas=True)
def _largest(labels, areas, seed):
    largest = np.where(labels == 1, areas.largest, 0)
    observed = np.zeros(labels.shape, dtype=np.int8)
    rows = np.flatnonzero(largest.max(axis=1) > 0)
    observed[rows, largest[rows].argmax(axis=1)] = 1  # a tie goes to the first class
    return observed


@register("size", source="Cole, Arroyo and Perona, arXiv 2305.15584 (2023), P_size; Cole et al.'s biased_labels.py",
          summary="one positive drawn in proportion to its instances' total area; no negatives", needs_areas=True)
def _size(labels, areas, seed):
    rng = np.random.RandomState(seed)
    weights = np.where(labels == 1, areas.total, 0).astype(np.float64)
    observed = np.zeros(labels.shape, dtype=np.int8)
    for row in np.flatnonzero(weights.sum(axis=1) > 0):
        observed[row, rng.choice(labels.shape[1], p=weights[row] / weights[row].sum())] = 1
    return observed


@register("given", source="the dataset's own annotations (OpenImages' human-verified labels, a CSV's 1 / 0 cells)",
          summary="every annotated label observed, positives and negatives; an unannotated one stays unknown")
def _given(labels, areas, seed):
    return 2 * labels.astype(np.int8) - 1  # draw_splits hides the unannotated entries (the dataset's label mask)


# --- a cache's rows ---------------------------------------------------------------------------------------


def official_positions(attrs: dict, num_train: int, num_val: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Where the cache's train and val rows sit among the official training rows, when they are all of them (no
    `--limit`, no image left out): the protocol's split of that many rows; else None."""
    skipped = json.loads(attrs.get("skipped_images") or "{}")
    if attrs.get("limit") or skipped.get("train") or skipped.get("val") or "split_seed" not in attrs:
        return None
    train, val = split_train_val(num_train + num_val, val_frac=float(attrs["val_frac"]), seed=int(attrs["split_seed"]))
    return (train, val) if (len(train), len(val)) == (num_train, num_val) else None


def draw_splits(rule: Rule, train_labels: np.ndarray, val_labels: np.ndarray, attrs: dict,
                areas: tuple[Areas, Areas] | None = None, label_masks: tuple | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """The rule's observed matrices of a cache's train and val rows (see the module docstring for the order);
    with partial labels (`label_masks`, train and val, 1 where annotated) no unannotated entry is observed."""
    train_mask, val_mask = label_masks or (None, None)
    if sparse.is_sparse(train_labels):
        if rule.name == "given" and sparse.is_sparse(train_mask) and sparse.is_sparse(val_mask):  # the annotations
            return sparse.signed_annotations(train_labels, train_mask), sparse.signed_annotations(val_labels, val_mask)
        on_sparse.check(rule, FLAG)
    train, val = _draw_splits(rule, train_labels, val_labels, attrs, areas)
    return hide_unannotated(train, train_mask), hide_unannotated(val, val_mask)


def _draw_splits(rule: Rule, train_labels: np.ndarray, val_labels: np.ndarray, attrs: dict,
                 areas: tuple[Areas, Areas] | None) -> tuple[np.ndarray, np.ndarray]:
    if rule.entry.needs_areas and areas is None:
        raise SpmlError(f"{FLAG} {rule}: needs instance areas (VOC boxes), which this cache does not store: extract"
                        f" the dataset with {FLAG} {rule} (only the rule's masks are stored, no areas)")
    train_areas, val_areas = areas or (None, None)
    if rule.entry.per_split:
        return rule.draw(train_labels, train_areas), rule.draw(val_labels, val_areas, seed=rule.seed + 1)
    num_train, num_val = len(train_labels), len(val_labels)
    positions = official_positions(attrs, num_train, num_val)
    if positions is None:
        positions = np.arange(num_train), np.arange(num_train, num_train + num_val)
    if sparse.is_sparse(train_labels):  # merged: row j of the official order is stacked row argsort(positions)[j]
        merged = sparse.stack([train_labels, val_labels]).take(np.argsort(np.concatenate(positions)))
        observed = rule.draw(merged)
        return observed.take(positions[0]), observed.take(positions[1])
    merged = np.zeros((num_train + num_val, train_labels.shape[1]), dtype=np.uint8)
    merged[positions[0]], merged[positions[1]] = train_labels, val_labels
    merged_areas = None
    if areas is not None:
        merged_areas = Areas(*(np.zeros(merged.shape) for _ in range(2)))
        for rows, part in zip(positions, areas):
            merged_areas.largest[rows], merged_areas.total[rows] = part.largest, part.total
    observed = rule.draw(merged, merged_areas)
    return observed[positions[0]], observed[positions[1]]


@dataclass(frozen=True)
class Observed:
    """One rule's observed train and val rows, and whether the cache stored them or they were drawn now."""

    rule: Rule
    train: np.ndarray  # int8 [N_train, C]
    val: np.ndarray  # int8 [N_val, C]
    stored: bool

    def summary(self, train_labels: np.ndarray) -> dict:
        """What results.json says of the rule: the fraction of training entries observed, observed positives
        and negatives per image, and the training images with a positive but none observed."""
        rows, entries = max(len(self.train), 1), self.train.shape[0] * self.train.shape[1]
        values = self.train.values if sparse.is_sparse(self.train) else self.train  # the non-zero entries suffice
        return {
            "fraction_observed": float(np.count_nonzero(values) / entries) if entries else 0.0,
            "positives_per_image": float((values == 1).sum() / rows),
            "negatives_per_image": float((values == -1).sum() / rows),
            "images_without_positive": int(without_positive(self.train, train_labels).sum()),
            "source": "cache" if self.stored else "drawn from the cache's labels",
        }


def without_positive(observed: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """bool [N]: the rows that have a true positive but no observed one."""
    return sparse.rows_with(labels, 1) & ~sparse.rows_with(observed, 1)


def for_cache(features, rules: list[Rule]) -> dict[str, Observed]:
    """Each rule's observed rows of a loaded cache (`cache.FeatureSet`): `single` is the cache's `observed`,
    another rule its stored masks, else drawn from the cache's full labels."""
    found = {}
    for rule in rules:
        if rule.text == DEFAULT_RULE:
            found[rule.text] = Observed(rule, features.train.observed, features.val.observed, True)
        elif rule.text in features.train.rules and rule.text in features.val.rules:
            found[rule.text] = Observed(rule, features.train.rules[rule.text], features.val.rules[rule.text], True)
        else:
            train, val = draw_splits(rule, features.train.labels, features.val.labels, features.attrs,
                                     label_masks=(features.train.label_mask, features.val.label_mask))
            found[rule.text] = Observed(rule, train, val, False)
    return found


def refuse_unobserved(observed: dict[str, Observed], source) -> None:
    """A rule whose training rows show no label at all (an all-unknown observed matrix) trains every loss on
    nothing, to results that look real: refused before training."""
    for text, found in observed.items():
        values = found.train.values if sparse.is_sparse(found.train) else np.asarray(found.train)
        if not np.any(values):
            fix = ("re-extract the cache (spml-cache extract --force)" if found.stored
                   else f"choose an {FLAG} rule that observes labels")
            raise SpmlError(f"{source}: no training label is observed under {text} (every entry unknown), so every"
                            f" loss would train on nothing: {fix}")


def drawn_note(observed: dict[str, Observed], cache_path) -> str | None:
    """The one line that says which rules were drawn now (not stored in the cache), or None."""
    drawn = [text for text, found in observed.items() if not found.stored]
    if not drawn:
        return None
    return (f"observation rule{'s' if len(drawn) > 1 else ''} {', '.join(drawn)} drawn from the full labels of"
            f" {cache_path} (not stored in it; extract {FLAG} stores them)")


def with_rule(features, rule: Rule):
    """The cache with `rule`'s observed rows in place of `single`'s (what fine-tuning trains on)."""
    if rule.text == DEFAULT_RULE:
        return features
    found = for_cache(features, [rule])[rule.text]
    return replace(features, train=replace(features.train, observed=found.train),
                   val=replace(features.val, observed=found.val))


def result_key(loss: str, rule: Rule | str) -> str:
    """The key of one result in a run directory: the loss's name under `single` (today's files), else
    `loss@rule` (`an@entry:0.1`)."""
    return loss if str(rule) == DEFAULT_RULE else f"{loss}@{rule}"


def split_key(key: str) -> tuple[str, str]:
    """(loss, rule text) of a result key."""
    loss, _, rule = key.partition("@")
    return loss, rule or DEFAULT_RULE
