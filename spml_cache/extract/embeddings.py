"""`import-features DIR --dataset D --root R` for embeddings in the clip-retrieval layout (cache/embeddings.py):
each image of dataset D under R is matched to its embedding row, and the cache is written as `extract` would
have, with the protocol's splits and single positives drawn from the dataset's own labels.

A metadata row names its image by `id` (the dataset's image id, a path relative to R: what `spml-cache export`
writes) or else by `image_path` (absolute, or relative to R: what clip-retrieval writes). Every image of the
dataset needs exactly one row: a missing or a repeated one is refused with the count and an example; rows that
name no image of the dataset are left out and counted.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from spml_cache import cache, datasets, protocol
from spml_cache.backbones import DEFAULT_FEATURES, slug
from spml_cache.cache import embeddings
from spml_cache.extract.pipeline import run_attrs
from spml_cache.extract.plan import plan_rows, refuse_foreign_file
from spml_cache.extract.published import ImportReport, write_import
from spml_cache.runtime.errors import SpmlError, check_stop

FOREIGN = {"backbone": "imported", "weights": "unknown", "resolution": 0,
           "resize": "unknown (embeddings imported in the clip-retrieval layout)"}


def _absolute(path, root: Path) -> str:
    path = Path(str(path)).expanduser()
    return os.path.normpath(os.path.abspath(path if path.is_absolute() else root / path))


def _positions(parts: embeddings.Parts, images, ids: list[str]) -> tuple[dict[str, int], str, int]:
    """{image id: row over all parts}, the column matched by, and how many rows matched no image."""
    if not parts.keys:
        raise SpmlError(f"{parts.folder / embeddings.METADATA}: no id or image_path column in the parquet files;"
                        " name each row's image in one of them")
    column = next(name for name in embeddings.KEY_COLUMNS if name in parts.keys)
    if column == "id":
        keys, wanted = [None if v is None else str(v) for v in parts.keys[column]], {i: i for i in ids}
    else:
        keys = [None if v is None else _absolute(v, images.root) for v in parts.keys[column]]
        wanted = {_absolute(images.path(image_id), images.root): image_id for image_id in ids}
    repeated = [key for key, count in Counter(k for k in keys if k is not None).items() if count > 1]
    if repeated:
        raise SpmlError(f"{parts.folder}: {len(repeated)} {column} values name more than one embedding row (e.g."
                        f" {repeated[0]}); keep one row per image and import again")
    row_of = {key: row for row, key in enumerate(keys) if key is not None}
    missing = [image_id for key, image_id in wanted.items() if key not in row_of]
    if missing:
        raise SpmlError(f"{parts.folder}: {len(missing)} of the {len(ids)} images of {images.dataset} under"
                        f" {images.root} have no embedding row by {column} (e.g. {missing[0]}); embed them too, or"
                        " point --root at the folder the paths are relative to")
    positions = {image_id: row_of[key] for key, image_id in wanted.items()}
    return positions, column, len(keys) - len(ids)


def _split(rows: cache.SplitRows, parts: embeddings.Parts, positions: dict[str, int], name: str) -> dict:
    features = parts.take(np.array([positions[image_id] for image_id in rows.ids], dtype=np.int64))
    wrong = cache.invalid_rows(features)
    if len(wrong):
        raise SpmlError(f"{parts.folder}: embeddings not finite (NaN or inf) for {name}"
                        f" {cache.describe_rows(wrong, rows.ids)}; nothing was written: compute them again")
    split = {"features": features, "labels": rows.labels, "ids": rows.ids}
    if rows.observed is not None:
        split["observed"] = rows.observed
    if rows.label_mask is not None:
        split["label_mask"] = rows.label_mask
    return split


def _attrs(images, protocol_attrs: dict, described: dict, folder: Path) -> dict:
    return {
        "dataset": images.dataset, "classes": json.dumps(list(images.classes)), "num_classes": len(images.classes),
        **described, "precision": "fp32", "limit": 0,
        **{key: protocol_attrs[key] for key in ("split_seed", "val_frac", "observe_seed", "num_pos", "num_neg")},
        "expected_positives": float(protocol_attrs["expected_positives"]),
        "skipped_missing": json.dumps(list(images.skipped)), "skipped_images": "{}",
        "source": f"import-features {folder.resolve()}", **run_attrs(torch.device("cpu")),
        "device": "unknown (imported embeddings)",
    }  # fmt: skip


def _output(out: Path | None, dataset: str, described: dict, sidecar: dict, force: bool) -> Path:
    """Where the import goes: --out, else the default path of its dataset, backbone and resolution; never a file
    that is not a cache, a cache without --force, nor the very cache an export was made from."""
    if out is None:
        kind = described.get("features", DEFAULT_FEATURES)  # a last4 export comes back as a last4 cache
        backbone = slug(described["backbone"]) + ("" if kind == DEFAULT_FEATURES else f"_{kind}")
        out = cache.default_path(dataset, int(described["resolution"]), backbone=backbone)
    path = Path(out).expanduser()
    if embeddings.made_from(sidecar, path):
        raise SpmlError(f"{path} is the cache this export was made from, which an import never writes over: pass"
                        " --out FILE for the imported cache")
    refuse_foreign_file(path)
    if path.exists() and not force:
        raise SpmlError(f"{path} already exists: pass --force to replace it, or pick another --out")
    return path


def import_export(folder: Path, *, out: Path | None = None, force: bool = False) -> ImportReport:
    """The cache an `spml-cache export` in `folder` was made from, again, from the export alone (no images): its
    rows, labels and single positives as exported, its backbone's and protocol's settings from spml_cache.json.
    Refuses to replace a cache unless `force`, and the export's own source always."""
    exported = embeddings.read_export(folder)
    sidecar, splits = exported.sidecar, exported.splits
    check_stop()
    described = {**FOREIGN, **sidecar.get("attrs", {}), "feature_dim": int(splits["train"]["features"].shape[1])}
    path = _output(out, sidecar["dataset"], described, sidecar, force)
    for name, split in splits.items():
        wrong = cache.invalid_rows(split["features"])
        if len(wrong):
            raise SpmlError(f"{exported.folder}: embeddings not finite (NaN or inf) for {name}"
                            f" {cache.describe_rows(wrong, split['ids'])}; nothing was written: export them again")
        check_stop()
    attrs = {"dataset": sidecar["dataset"], "classes": json.dumps(list(sidecar["classes"])),
             "num_classes": len(sidecar["classes"]), **described, "precision": "fp32", "limit": 0,
             "skipped_missing": "[]", "skipped_images": "{}", **sidecar["protocol"],
             "source": f"import-features {exported.folder.resolve()}", **run_attrs(torch.device("cpu")),
             "device": "unknown (imported embeddings)"}
    written = write_import(path, attrs, splits)
    note = (f"the export's own splits, labels and single positives, as in {sidecar.get('cache', 'its cache')}; no"
            " images were read")
    return ImportReport(written, {name: len(splits[name]["ids"]) for name in cache.SPLITS}, [note])


def import_embeddings(folder: Path, *, dataset: str, root: Path, out: Path | None = None,
                      force: bool = False) -> ImportReport:
    """The cache of `dataset` (read under `root`) from the embeddings in `folder`; refuses to replace a cache
    unless `force`."""
    folder = Path(folder).expanduser()
    parts = embeddings.read_parts(folder)
    check_stop()  # import_features takes a stop between its steps (`stops_deferred`)
    images = datasets.read(dataset, root)
    check_stop()
    protocol_result = protocol.apply_protocol(images)
    check_stop()
    rows = plan_rows(protocol_result, 0)
    ids = [image_id for name in cache.SPLITS for image_id in rows[name].ids]
    positions, column, unmatched = _positions(parts, images, ids)
    described = {**FOREIGN, **parts.sidecar.get("attrs", {}), "feature_dim": int(parts.arrays[0].shape[1])}
    path = _output(out, images.dataset, described, parts.sidecar, force)
    splits = {name: _split(rows[name], parts, positions, name) for name in cache.SPLITS}
    check_stop()
    attrs = _attrs(images, protocol_result.attrs, described, folder)
    written = write_import(path, attrs, splits)
    note = (f"matched {len(ids)} of {int(parts.offsets[-1])} embedding rows to the images of {images.dataset} by"
            f" {column}" + (f"; {unmatched} rows name no image of it and were left out" if unmatched else ""))
    return ImportReport(written, {name: len(rows[name]) for name in cache.SPLITS}, [note, *images.notes])
