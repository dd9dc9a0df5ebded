"""A cache's rows under a rule: the order rules draw in, each rule's observed train and val rows of a cache
(stored by stage one, or drawn now from its full labels), and what results.json says of them.

Row-wise rules draw over the official training rows in their order, before the train/val split, as Cole et al.'s
`generate_observed_labels` does: `single` is today's draw, `uniform:pos=K,neg=M` its generalisation. A cache
whose train and val rows are the whole official training set gets them back in that order from the protocol's
split (`official_positions`); a cut one (`--limit`, images left out) draws over its own rows, train then val.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import numpy as np

from spml_cache.labels import hide_unannotated, nonzero_count, rows_with, signed_annotations, stack, take, value_count
from spml_cache.observation.keys import DEFAULT_RULE, FLAG
from spml_cache.observation.rules import Areas, Rule
from spml_cache.protocol import split_train_val
from spml_cache.runtime.errors import SpmlError


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
    if rule.name == "given" and train_mask is not None and val_mask is not None:  # the annotations, entry by entry
        return signed_annotations(train_labels, train_mask), signed_annotations(val_labels, val_mask)
    rule.check_form(train_labels)
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
    # merged: row j of the official order is stacked row argsort(positions)[j]
    merged = take(stack([train_labels, val_labels]), np.argsort(np.concatenate(positions)))
    merged_areas = None
    if areas is not None:
        merged_areas = Areas(*(np.zeros(merged.shape) for _ in range(2)))
        for rows, part in zip(positions, areas):
            merged_areas.largest[rows], merged_areas.total[rows] = part.largest, part.total
    observed = rule.draw(merged, merged_areas)
    return take(observed, positions[0]), take(observed, positions[1])


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
        return {
            "fraction_observed": float(nonzero_count(self.train) / entries) if entries else 0.0,
            "positives_per_image": float(value_count(self.train, 1) / rows),
            "negatives_per_image": float(value_count(self.train, -1) / rows),
            "images_without_positive": int(without_positive(self.train, train_labels).sum()),
            "source": "cache" if self.stored else "drawn from the cache's labels",
        }


def without_positive(observed: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """bool [N]: the rows that have a true positive but no observed one."""
    return rows_with(labels, 1) & ~rows_with(observed, 1)


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
        if nonzero_count(found.train) == 0:
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
