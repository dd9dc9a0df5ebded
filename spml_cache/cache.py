"""The HDF5 feature cache (spec/design.md, "The HDF5 cache"): write it, validate it, read it back.

One file per dataset x backbone x resolution. Every write goes to `<name>.h5.partial` and is renamed to
`<name>.h5` only once complete, so a file under the final name is never half-written. Extraction fills the
partial file batch by batch (`PartialCache`) and can resume from it; `write` is the one-shot writer.

Inside a partial file the arrays are allocated when the file is created, so writing rows later touches no
HDF5 metadata: a process killed between batches leaves a file that opens and resumes. A partial file also
holds `/{split}/bad` (rows whose image could not be decoded), which finalisation turns into dropped rows.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from spml_cache.errors import SpmlError

SCHEMA_VERSION = 1
SPLITS = ("train", "val", "test")
OBSERVED_SPLITS = ("train", "val")
COPY_BLOCK_ROWS = 8192


@dataclass(frozen=True)
class SplitRows:
    """Everything of one split but the features: what a cache is built for, and what resuming must match."""

    ids: list[str]
    labels: np.ndarray  # uint8 [N, C]
    observed: np.ndarray | None  # int8 [N, C] for train and val, None for test

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class CachedSplit:
    features: np.ndarray  # float32 [N, D]
    labels: np.ndarray  # uint8 [N, C]
    ids: list[str]
    observed: np.ndarray | None  # int8 [N, C] (train, val); None for test

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class FeatureSet:
    train: CachedSplit
    val: CachedSplit
    test: CachedSplit
    classes: list[str]
    attrs: dict
    dataset: str
    path: Path


def default_path(
    dataset: str, resolution: int = 448, folder: Path | str | None = None, backbone: str = "resnet50"
) -> Path:
    """`<folder or $SPML_CACHE or ./cache>/<dataset>-<backbone>-<resolution>.h5`."""
    folder = Path(folder) if folder is not None else Path(os.environ.get("SPML_CACHE", "cache"))
    return folder / f"{dataset}-{backbone}-{resolution}.h5"


def partial_path(path: Path | str) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".partial")


def plain(value):
    """An HDF5 attribute value as plain Python (numpy scalars and arrays become ints, floats, lists)."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value


def cache_id(attrs: dict) -> str:
    """Short stable id of one cache: a hash of all its attrs (`created` included, so rebuilds differ)."""
    text = json.dumps({key: plain(value) for key, value in attrs.items()}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


# --- writing ---------------------------------------------------------------------------------------------


def _check_rows(name: str, rows: SplitRows, num_classes: int) -> None:
    if rows.labels.shape != (len(rows), num_classes):
        raise SpmlError(f"{name}: labels have shape {rows.labels.shape}, expected ({len(rows)}, {num_classes})")
    if (rows.observed is None) != (name not in OBSERVED_SPLITS):
        raise SpmlError(f"{name}: observed labels belong to train and val only")
    if rows.observed is not None and rows.observed.shape != rows.labels.shape:
        raise SpmlError(f"{name}: observed has shape {rows.observed.shape}, labels {rows.labels.shape}")


def _allocated(group: h5py.Group, name: str, shape: tuple, dtype) -> h5py.Dataset:
    """A contiguous dataset whose storage exists from the start (no metadata changes on later writes)."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    return group.create_dataset(name, shape=shape, dtype=dtype, dcpl=dcpl)


def _set_attrs(file: h5py.File, attrs: dict) -> None:
    for key, value in attrs.items():
        if value is None:
            raise SpmlError(f"cache attribute {key!r} is None; HDF5 cannot store it")
        # str subclasses (torch.__version__) would be stored as numpy unicode, which HDF5 cannot hold
        file.attrs[key] = str(value) if isinstance(value, str) else value


def _create(path: Path, attrs: dict, splits: dict[str, SplitRows], feature_dim: int, *, bad_rows: bool) -> h5py.File:
    """A new file at `path` (replacing any) with every array allocated, no row done, `complete` false."""
    num_classes = int(attrs["num_classes"])
    for name in SPLITS:
        _check_rows(name, splits[name], num_classes)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        file = h5py.File(path, "w")
    except OSError as err:
        raise SpmlError(f"cannot write {path} ({err.strerror or err}): pick a writable --out folder") from None
    try:
        _set_attrs(file, attrs)
        file.attrs["schema_version"] = SCHEMA_VERSION
        file.attrs["complete"] = False
        for name in SPLITS:
            rows, group = splits[name], file.create_group(name)
            _allocated(group, "features", (len(rows), feature_dim), np.float32)
            group.create_dataset("labels", data=rows.labels.astype(np.uint8))
            group.create_dataset("ids", data=np.array(rows.ids, dtype=object), dtype=h5py.string_dtype("utf-8"))
            if rows.observed is not None:
                group.create_dataset("observed", data=rows.observed.astype(np.int8))
            group.create_dataset("done", data=np.zeros(len(rows), dtype=bool))
            if bad_rows:
                group.create_dataset("bad", data=np.zeros(len(rows), dtype=bool))
        file.flush()
    except BaseException:
        file.close()
        path.unlink(missing_ok=True)
        raise
    return file


def _seal(file: h5py.File, temporary: Path, final: Path) -> Path:
    file.attrs["complete"] = True
    file.close()
    try:
        os.replace(temporary, final)
    except OSError as err:
        raise SpmlError(f"cannot move {temporary} to {final} ({err.strerror or err})") from None
    return final


def write(path: Path | str, *, attrs: dict, train: dict, val: dict, test: dict) -> Path:
    """Write a complete cache in one go (import-features, tests, benchmarks).

    Each split dict has `features` float32 [N, D], `labels` uint8 [N, C], `ids` list[str] and, for train and
    val, `observed` int8 [N, C]. `attrs` are the root attrs (schema_version and complete are set here).
    """
    path = Path(path)
    temporary = partial_path(path)
    given = {"train": train, "val": val, "test": test}
    splits = {name: SplitRows(list(d["ids"]), np.asarray(d["labels"]), d.get("observed")) for name, d in given.items()}
    dims = {np.asarray(d["features"]).shape[1] for d in given.values()}
    if len(dims) != 1:
        raise SpmlError(f"features of the splits have different widths {sorted(dims)}")
    file = _create(temporary, attrs, splits, dims.pop(), bad_rows=False)
    try:
        for name, split in given.items():
            features = np.asarray(split["features"], dtype=np.float32)
            if len(features) != len(splits[name]):
                raise SpmlError(f"{name}: {len(features)} feature rows for {len(splits[name])} ids")
            file[name]["features"][...] = features
            file[name]["done"][...] = True
    except BaseException:
        file.close()
        temporary.unlink(missing_ok=True)
        raise
    return _seal(file, temporary, path)


class PartialCache:
    """An extraction in progress: `<name>.h5.partial`, filled batch by batch, then finalised."""

    def __init__(self, file: h5py.File, final: Path) -> None:
        self.file, self.final = file, final

    @classmethod
    def create(cls, final: Path, attrs: dict, splits: dict[str, SplitRows], feature_dim: int) -> "PartialCache":
        return cls(_create(partial_path(final), attrs, splits, feature_dim, bad_rows=True), final)

    @classmethod
    def open(cls, final: Path) -> "PartialCache":
        path = partial_path(final)
        try:
            file = h5py.File(path, "r+")
        except OSError as err:
            raise SpmlError(
                f"cannot resume from {path} ({err}): another extraction may be writing it; "
                "otherwise delete it or pass --force"
            ) from None
        if "bad" not in file["train"]:
            file.close()
            raise SpmlError(f"{path} was not written by an extraction; delete it or pass --force")
        return cls(file, final)

    def pending(self, split: str) -> np.ndarray:
        """Row indices not yet done, ascending."""
        return np.flatnonzero(~self.file[split]["done"][...])

    def num_done(self) -> int:
        return sum(int(self.file[split]["done"][...].sum()) for split in SPLITS)

    def write_rows(self, split: str, rows: np.ndarray, features: np.ndarray, bad: np.ndarray) -> None:
        """Store the features of `rows` (ascending) and mark them done; rows flagged `bad` get no features.

        Features go in first and are flushed before `done` is set, so a kill in between redoes the rows.
        """
        group = self.file[split]
        for start, stop in _runs(rows):
            take = slice(np.searchsorted(rows, start), np.searchsorted(rows, start) + stop - start)
            group["features"][start:stop] = features[take]
            if bad[take].any():
                group["bad"][start:stop] = bad[take]
        self.file.flush()
        for start, stop in _runs(rows):
            group["done"][start:stop] = True
        self.file.flush()

    def finalise(self, attrs: dict) -> tuple[Path, dict[str, list[str]]]:
        """Seal the cache under its final name, dropping rows whose image was bad; returns (path, dropped ids).

        `attrs` are added to the root attrs (the run's device and versions). Without bad rows the partial
        file itself is sealed and renamed; with them a compact copy without those rows is written instead.
        """
        for split in SPLITS:
            if not self.file[split]["done"][...].all():
                raise SpmlError(f"{partial_path(self.final)}: {split} has rows not yet extracted; resume the run")
        bad = {split: self.file[split]["bad"][...] for split in SPLITS}
        dropped = {split: [] for split in SPLITS}
        for split in SPLITS:
            if bad[split].any():
                ids = self._ids(split)
                dropped[split] = [ids[i] for i in np.flatnonzero(bad[split])]
        attrs = {**attrs, "skipped_images": json.dumps({k: v for k, v in dropped.items() if v})}
        if not any(bad[split].any() for split in SPLITS):
            _set_attrs(self.file, attrs)
            for split in SPLITS:
                del self.file[split]["bad"]
            return _seal(self.file, partial_path(self.final), self.final), dropped
        return self._compact(attrs, bad), dropped

    def _ids(self, split: str) -> list[str]:
        return list(self.file[split]["ids"].asstr()[...])

    def _compact(self, attrs: dict, bad: dict[str, np.ndarray]) -> Path:
        source = self.file
        keep = {split: np.flatnonzero(~bad[split]) for split in SPLITS}
        ids = {split: self._ids(split) for split in SPLITS}
        splits = {
            split: SplitRows(
                [ids[split][i] for i in keep[split]],
                source[split]["labels"][...][keep[split]],
                source[split]["observed"][...][keep[split]] if split in OBSERVED_SPLITS else None,
            )
            for split in SPLITS
        }
        root_attrs = {key: plain(value) for key, value in source.attrs.items()} | attrs
        temporary = self.final.with_name(self.final.name + ".compact.partial")
        target = _create(temporary, root_attrs, splits, source["train"]["features"].shape[1], bad_rows=False)
        try:
            for split in SPLITS:
                rows = keep[split]
                for begin in range(0, len(rows), COPY_BLOCK_ROWS):
                    block = rows[begin : begin + COPY_BLOCK_ROWS]
                    lo, hi = int(block[0]), int(block[-1]) + 1  # one contiguous read, then pick the kept rows
                    target[split]["features"][begin : begin + len(block)] = source[split]["features"][lo:hi][block - lo]
                target[split]["done"][...] = True
        except BaseException:
            target.close()
            temporary.unlink(missing_ok=True)
            raise
        path = _seal(target, temporary, self.final)
        self.close()
        partial_path(self.final).unlink(missing_ok=True)
        return path

    def close(self) -> None:
        if self.file.id.valid:
            self.file.close()


def _runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """Ascending row indices as maximal [start, stop) runs, so each run is one slice write."""
    if len(rows) == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [len(rows)]])
    return [(int(rows[a]), int(rows[b - 1]) + 1) for a, b in zip(starts, stops)]


# --- reading ---------------------------------------------------------------------------------------------


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


def _validate(path: Path, file: h5py.File) -> None:
    version = plain(file.attrs.get("schema_version"))
    if version != SCHEMA_VERSION:
        raise SpmlError(
            f"{path} has schema_version {version}; this spml-cache reads version {SCHEMA_VERSION}: re-extract it"
        )
    if not plain(file.attrs.get("complete", False)):
        raise SpmlError(f"{path} is incomplete (complete=false): re-run spml-cache extract to finish it")
    num_classes = plain(file.attrs.get("num_classes"))
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
    classes = json.loads(attrs["classes"]) if isinstance(attrs.get("classes"), str) else list(attrs["classes"])
    return FeatureSet(splits["train"], splits["val"], splits["test"], classes, attrs, str(attrs["dataset"]), path)
