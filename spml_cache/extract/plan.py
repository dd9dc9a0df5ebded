"""What stage one's cache file will hold, planned before any feature is computed: its rows, its settings
attrs and its size; whether a cache or partial file already on disk was built with the same settings; and where
it goes, and whether that folder is writable (its room: `runtime/disk.py`'s `require_room`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np

from spml_cache import cache
from spml_cache.backbones import Description, templates_attr
from spml_cache.cache.csr import format_of
from spml_cache.images import DECODERS, recorded_decoder
from spml_cache.labels import head, nonzero_count, same, take
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.plugins import Origin

# The attrs that decide what the features are; a cache differing in one of them is another cache.
SETTINGS = (
    "dataset", "classes", "backbone", "weights", "resolution", "resize", "mean", "std", "feature_dim",
    "precision", "decoder", "split_seed", "val_frac", "observe_seed", "num_pos", "num_neg", "limit",
    "clip_features", "templates", "grid",  # CLIP caches only: absent from the others' settings and files
    "features",  # last4 caches only (a pooled cache's attrs are as they were)
    "backbone_origin",  # a plugin backbone's only: its file's hash or its distribution's version
)  # fmt: skip


def plan_rows(protocol_splits, limit: int) -> dict[str, cache.SplitRows]:
    """The protocol's splits as cache rows, cut to the first `limit` rows of each split (0: all). Sparse label
    matrices stay sparse (cut with `take`, never densified)."""
    rows = {}
    for name in cache.SPLITS:
        split = getattr(protocol_splits, name)
        count = len(split.ids) if limit == 0 else min(limit, len(split.ids))
        rows[name] = cache.SplitRows(list(split.ids)[:count], head(split.labels, count, np.uint8),
                                     head(split.observed, count, np.int8), head(split.mask, count, np.uint8))
    return rows


def settings_attrs(images, protocol_attrs: dict, backbone: Description, precision: str, limit: int,
                   templates: list[str] | None = None, *, decode: str) -> dict:
    """The cache's root attrs known before extraction; `templates`: a CLIP backbone's prompt templates; `decode`:
    gpu or cpu (`--decode`), recorded as its decoder's name."""
    clip = {} if templates is None else {"templates": templates_attr(templates)}
    if backbone.grid:
        clip["grid"] = backbone.grid
    return {
        "dataset": images.dataset,
        "classes": json.dumps(list(images.classes)),
        "num_classes": len(images.classes),
        **backbone.attrs(),
        **clip,
        "precision": precision,
        "decoder": DECODERS[decode],
        "limit": limit,
        **{key: protocol_attrs[key] for key in ("split_seed", "val_frac", "observe_seed", "num_pos", "num_neg")},
        "expected_positives": float(protocol_attrs["expected_positives"]),
        "skipped_missing": json.dumps(list(images.skipped)),
        "source": "extract",
    }


def _same(a, b) -> bool:
    return json.dumps(cache.plain(a), sort_keys=True) == json.dumps(cache.plain(b), sort_keys=True)


def _setting_change(key: str, stored, now) -> str | None:
    """How setting `key` differs between the file (`stored`) and this run, in words, or None."""
    if key == "backbone_origin" and stored and now:
        change = _origin_change(stored, now)
        return None if change is None else f"the backbone's code (backbone_origin): {change}"
    return None if _same(stored, now) else f"{key}: {stored!r} in the file, {now!r} now"


def _origin_change(stored, now) -> str | None:
    """What differs between two plugin records (a record in an earlier version's keys reads as today's)."""
    return Origin.read(cache.plain(stored)).change(Origin.read(now))


def backbone_code_change(path: Path, settings: dict) -> str | None:
    """How the plugin backbone's code now differs from the code that started the file at `path`, or None."""
    stored, now = cache.read_header(path)[0].get("backbone_origin"), settings.get("backbone_origin")
    if stored and now:
        return _origin_change(stored, now)
    return _setting_change("backbone_origin", stored, now)  # a plugin then and none now, or the other way


NEVER_REPLACED = "pick another --out (a cache is never written over a file that is not one, not even with --force)"


def refuse_foreign_file(path: Path) -> None:
    """Extraction replaces a cache (with --force), never a file of something else that happens to sit there: not
    an HDF5 file, nor an HDF5 file without the `schema_version` every cache carries from its creation."""
    if not path.exists():
        return
    if not (path.is_file() and h5py.is_hdf5(path)):
        raise SpmlError(f"{path} exists and is not an HDF5 cache: {NEVER_REPLACED}")
    try:
        with h5py.File(path, "r") as file:
            foreign = "schema_version" not in file.attrs
    except OSError:  # locked by its writer, or damaged: a cache's own checks say which
        foreign = False
    if foreign:
        raise SpmlError(f"{path} is an HDF5 file but not an spml-cache cache (no schema_version attribute):"
                        f" {NEVER_REPLACED}")


def refuse_other_settings(path: Path, settings: dict, rows: dict[str, cache.SplitRows], was: str, fix: str,
                          label_format: str | None = None, but: tuple[str, ...] = ()) -> None:
    """Refuse the file at `path` when it differs from this run in anything (`but` the settings named there)."""
    difference = settings_difference(path, settings, rows, label_format, but)
    if difference is not None:
        raise SpmlError(
            f"{path} {was} with other settings ({difference}): pass --force to {fix}, or pick another --out"
        )


def settings_difference(path: Path, settings: dict, rows: dict[str, cache.SplitRows],
                        label_format: str | None = None, but: tuple[str, ...] = ()) -> str | None:
    """What differs between the cache (or partial file) at `path` and this run, or None. `label_format`: dense
    or sparse, how this run stores the label matrices (None: either will do)."""
    attrs, found = cache.read_header(path)
    attrs["decoder"] = recorded_decoder(attrs)  # a cache from before the attr: its device's (images.py)
    for key in SETTINGS:
        change = None if key in but else _setting_change(key, attrs.get(key), settings.get(key))
        if change is not None:
            return change
    stored = format_of(found["train"].labels)
    if label_format is not None and stored != label_format:
        return f"--labels: {stored} in the file, {label_format} now"
    dropped = json.loads(attrs.get("skipped_images") or "{}")
    for name in cache.SPLITS:
        gone = set(dropped.get(name, []))
        keep = [i for i, image_id in enumerate(rows[name].ids) if image_id not in gone]
        planned = rows[name]
        if found[name].ids != [planned.ids[i] for i in keep]:
            return f"the {name} images differ ({len(found[name])} rows in the file, {len(keep)} now)"
        if not same(found[name].labels, take(planned.labels, keep)):
            return f"the {name} labels differ"
        if planned.observed is not None and not same(found[name].observed, take(planned.observed, keep)):
            return f"the {name} observed labels differ"
    return None


def estimated_size(rows: dict[str, cache.SplitRows], num_classes: int, row_width: int, labels: str = "dense") -> int:
    """Bytes of the arrays (features and embeddings dominate; ids counted at their UTF-8 length plus a pointer).
    `labels`: how the label matrices are stored, dense (a byte an entry) or sparse (CSR: 8 bytes a row and 5 a
    non-zero entry, counted without densifying)."""
    total = 0
    for name, split in rows.items():
        matrices = [m for m in (split.labels, split.observed, split.label_mask) if m is not None]
        if labels == "sparse":
            total += sum(8 * (len(split) + 1) + 5 * nonzero_count(m) for m in matrices)
        else:
            total += len(split) * num_classes * len(matrices)
        total += len(split) * (row_width * 4 + 2) + sum(len(i.encode()) + 16 for i in split.ids)
    return total


def output_path(out: Path | None, dataset: str, resolution: int, slug: str = "resnet50") -> Path:
    """`--out` (a file, or a folder for the default name), else `<dataset>-<backbone slug>-<R>.h5` in the cache
    folder."""
    path = cache.default_path(dataset, resolution, backbone=slug) if out is None else Path(out).expanduser()
    if path.is_dir():
        path = cache.default_path(dataset, resolution, folder=path, backbone=slug)
    return path


def require_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        problem = err.strerror or err
        raise SpmlError(f"cannot create the output folder {folder} ({problem}); pick another --out") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SpmlError(f"the output folder {folder} is not writable; pick another --out")
