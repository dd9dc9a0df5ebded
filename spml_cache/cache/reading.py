"""Reading caches: the header alone (to compare settings), or the whole validated cache (`load`).
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np

from spml_cache.cache.schema import (
    OBSERVED_SPLITS, SCHEMA_VERSION, SPLITS, CachedSplit, FeatureSet, SplitRows, partial_path, plain,
)
from spml_cache.errors import SpmlError

REQUIRED_ATTRS = ("dataset", "classes", "num_classes")

def _open(path: Path) -> h5py.File:
    if not path.exists():
        hint = (
            f"; {partial_path(path).name} holds an interrupted extraction: re-run spml-cache extract to resume it"
            if partial_path(path).exists()
            else ": run spml-cache extract (or import-features) first"
        )
        raise SpmlError(f"no cache at {path}{hint}")
    try:
        return h5py.File(path, "r")
    except OSError as err:
        if "unable to lock file" in str(err):
            raise SpmlError(
                f"{path} is open in another process (an extraction still running?); wait for it or stop it"
            ) from None
        raise SpmlError(f"{path} is not a readable HDF5 cache ({err}); re-extract it with --force") from None


def read_header(path: Path | str) -> tuple[dict, dict[str, SplitRows]]:
    """Root attrs and every split's ids, labels and observed, without features (to compare settings)."""
    path = Path(path)
    with _open(path) as file:
        attrs = {key: plain(value) for key, value in file.attrs.items()}
        splits = {}
        for name in SPLITS:
            if name not in file:
                raise SpmlError(f"{path}: no /{name} group; re-extract it with --force")
            group = file[name]
            observed = group["observed"][...] if "observed" in group else None
            splits[name] = SplitRows(list(group["ids"].asstr()[...]), group["labels"][...], observed)
    return attrs, splits


def class_names(attrs) -> list[str] | None:
    """The `classes` attribute (a JSON list; older files may hold a string array), or None if it is neither."""
    value = plain(attrs["classes"])
    try:
        value = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        return None
    return [str(name) for name in value] if isinstance(value, list) else None


def _validate(path: Path, file: h5py.File) -> None:
    version = plain(file.attrs.get("schema_version"))
    if version != SCHEMA_VERSION:
        raise SpmlError(
            f"{path} has schema_version {version}; this spml-cache reads version {SCHEMA_VERSION}: re-extract it"
        )
    if not plain(file.attrs.get("complete", False)):
        raise SpmlError(f"{path} is incomplete (complete=false): re-run spml-cache extract to finish it")
    missing = [key for key in REQUIRED_ATTRS if key not in file.attrs]
    if missing:
        raise SpmlError(f"{path} lacks the attribute(s) {', '.join(missing)} every cache has: it was not written by"
                        " spml-cache (or is damaged); re-extract it, or import the features with import-features")
    num_classes = plain(file.attrs.get("num_classes"))
    classes = class_names(file.attrs)
    if classes is None or len(classes) != num_classes:
        raise SpmlError(f"{path}: the classes attribute is not a JSON list of {num_classes} names; re-extract it")
    for name in SPLITS:
        needed = ("features", "labels", "ids", "done") + (("observed",) if name in OBSERVED_SPLITS else ())
        for array in needed:
            if name not in file or array not in file[name]:
                raise SpmlError(f"{path}: /{name}/{array} is missing; re-extract the cache")
        group = file[name]
        lengths = {array: group[array].shape[0] for array in needed}
        if len(set(lengths.values())) != 1:
            described = ", ".join(f"{array} {length}" for array, length in lengths.items())
            raise SpmlError(f"{path}: the /{name} arrays disagree in length ({described}); re-extract the cache")
        for array in ("labels",) + (("observed",) if name in OBSERVED_SPLITS else ()):
            if group[array].shape[1] != num_classes:
                raise SpmlError(
                    f"{path}: /{name}/{array} has {group[array].shape[1]} columns, num_classes is {num_classes}"
                )
        if not group["done"][...].all():
            raise SpmlError(f"{path}: /{name} has rows never written (done=false); re-extract the cache")


def load(path: Path | str) -> FeatureSet:
    """Read and validate a complete cache into memory."""
    path = Path(path)
    with _open(path) as file:
        _validate(path, file)
        attrs = {key: plain(value) for key, value in file.attrs.items()}
        splits = {}
        for name in SPLITS:
            group = file[name]
            splits[name] = CachedSplit(
                features=group["features"][...].astype(np.float32, copy=False),
                labels=group["labels"][...].astype(np.uint8, copy=False),
                ids=list(group["ids"].asstr()[...]),
                observed=group["observed"][...].astype(np.int8, copy=False) if "observed" in group else None,
            )
    classes = class_names(attrs)
    return FeatureSet(splits["train"], splits["val"], splits["test"], classes, attrs, str(attrs["dataset"]), path)
