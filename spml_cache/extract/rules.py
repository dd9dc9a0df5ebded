"""`extract --observe R1,R2,...`: the observation rules' masks stored in the cache beside `single`'s `observed`.

The masks are drawn from the rows the cache finally keeps (`observation.draw_splits`, the draw `linear --observe`
makes from a cache that lacks them, so both give the same masks), once the features are done. A rule that needs
instance areas reads them from the dataset's annotations first, before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from spml_cache import cache, datasets, observation
from spml_cache.observation import Areas, Rule
from spml_cache.runtime.errors import SpmlError


class RuleStore:
    """The extra rules of one extraction (all but `single`) and, for those that need them, the instance areas of
    the official training rows by image id."""

    def __init__(self, rules: list[Rule] | None, images, settings: dict) -> None:
        self.rules = [rule for rule in rules or [] if rule.text != observation.DEFAULT_RULE]
        self.settings = settings
        self.areas: dict[str, tuple[np.ndarray, np.ndarray]] | None = None
        needing = [rule.text for rule in self.rules if rule.entry.needs_areas]
        if needing:
            found = datasets.instance_areas(images, list(images.train.ids))
            if found is None:
                raise SpmlError(f"{observation.FLAG} {','.join(needing)}: {images.dataset} has no instance areas"
                                " (only VOC's boxes are read): leave those rules out for this dataset")
            largest, total = found
            self.areas = {image_id: (largest[i], total[i]) for i, image_id in enumerate(images.train.ids)}

    def masks(self, kept: dict[str, cache.SplitRows], planned: dict[str, cache.SplitRows] | None = None,
              rules: list[Rule] | None = None, attrs: dict | None = None) -> cache.RuleMasks:
        """The rules' (all of them, or `rules`) train and val masks of the rows `kept`; `planned`, the rows the
        cache was planned with, tells which were left out; `attrs`, the cache's (else the settings)."""
        attrs = dict(attrs or self.settings)
        if planned is not None:
            dropped = {name: sorted(set(planned[name].ids) - set(kept[name].ids)) for name in cache.OBSERVED_SPLITS}
            attrs["skipped_images"] = json.dumps({name: ids for name, ids in dropped.items() if ids})
        areas = None
        if self.areas is not None:
            areas = tuple(self._areas_of(kept[name]) for name in cache.OBSERVED_SPLITS)
        label_masks = tuple(kept[name].label_mask for name in cache.OBSERVED_SPLITS)
        return {rule.text: observation.draw_splits(rule, kept["train"].labels, kept["val"].labels, attrs, areas,
                                                   label_masks)
                for rule in (self.rules if rules is None else rules)}

    def _areas_of(self, rows: cache.SplitRows) -> Areas:
        """The instance areas of `rows`, in their order."""
        largest, total = (np.array([self.areas[i][k] for i in rows.ids], dtype=np.float64).reshape(rows.labels.shape)
                          for k in range(2))
        return Areas(largest, total)

    def for_finalise(self, planned: dict[str, cache.SplitRows]):
        """What `PartialCache.finalise` calls with the rows it keeps (None without extra rules)."""
        return (lambda kept: self.masks(kept, planned)) if self.rules else None

    def add_to(self, path: Path) -> list[str]:
        """Store the rules the complete cache at `path` lacks (rewriting it atomically); the texts of those added."""
        stored = cache.stored_rules(path)
        missing = [rule for rule in self.rules if rule.text not in stored]
        if missing:
            attrs, rows = cache.read_header(path)
            cache.add_rules(path, self.masks({name: rows[name] for name in cache.OBSERVED_SPLITS}, rules=missing,
                                             attrs=attrs))
        return [rule.text for rule in missing]
