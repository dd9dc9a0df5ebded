"""Writing caches: the one-shot `write` and stage one's `PartialCache`, both atomic (see the package docstring).
"""

from __future__ import annotations

import json
import os
from contextlib import suppress
from pathlib import Path
from typing import Callable

import h5py
import numpy as np

from spml_cache.cache.schema import (
    CONTENT_ATTR, COPY_BLOCK_ROWS, MASK, OBSERVED_SPLITS, SCHEMA_VERSION, SPLITS, SplitRows,
    partial_path, plain,
)
from spml_cache.cache import columns, reading
from spml_cache.cache.columns import ROW_DATASETS, RowShapes, TEXT_GROUP, row_shapes
from spml_cache.cache.csr import DEFAULT_FORMAT, read, resolve_format, store, stored_sparse
from spml_cache.cache.rule_masks import RuleMasks, write_rules
from spml_cache.labels import is_sparse, take
from spml_cache.runtime.errors import DiskFull, SpmlError, check_stop

FEATURE_DTYPES = {"float32": np.float32, "float16": np.float16}  # how a cache may store its features

def _check_rows(name: str, rows: SplitRows, num_classes: int) -> None:
    if rows.labels.shape != (len(rows), num_classes):
        raise SpmlError(f"{name}: labels have shape {rows.labels.shape}, expected ({len(rows)}, {num_classes})")
    if (rows.observed is None) != (name not in OBSERVED_SPLITS):
        raise SpmlError(f"{name}: observed labels belong to train and val only")
    if rows.observed is not None and rows.observed.shape != rows.labels.shape:
        raise SpmlError(f"{name}: observed has shape {rows.observed.shape}, labels {rows.labels.shape}")
    if rows.label_mask is not None and rows.label_mask.shape != rows.labels.shape:
        raise SpmlError(f"{name}: the label mask has shape {rows.label_mask.shape}, labels {rows.labels.shape}")


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


def _create(path: Path, attrs: dict, splits: dict[str, SplitRows], feature_dim: int | RowShapes, *, bad_rows: bool,
            text: dict | None = None, labels: str = DEFAULT_FORMAT, features: str = "float32") -> h5py.File:
    """A new file at `path` (replacing any) with every array allocated, no row done, `complete` false.
    `feature_dim`: the features' width, or every per-row dataset's shape per row (`ROW_DATASETS`); `text`: a CLIP
    cache's text side; `labels`: auto, dense or sparse (`resolve_format`); `features`: float32 or float16
    storage of the features."""
    shapes = {"features": (feature_dim,)} if isinstance(feature_dim, int) else dict(feature_dim)
    num_classes = int(attrs["num_classes"])
    for name in SPLITS:
        _check_rows(name, splits[name], num_classes)
    as_csr = resolve_format(labels, num_classes) == "sparse"
    if features not in FEATURE_DTYPES:
        raise SpmlError(f"feature storage {features!r}: use {' or '.join(FEATURE_DTYPES)}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        file = h5py.File(path, "w")
    except OSError as err:
        if DiskFull.caused(err):
            with suppress(OSError):  # h5py leaves an empty file where the disk had no room for its first block
                path.unlink(missing_ok=True)
            raise DiskFull(path) from None
        raise SpmlError(f"cannot write {path} ({err.strerror or err}): pick a writable --out folder") from None
    try:
        _set_attrs(file, attrs)
        file.attrs["schema_version"] = SCHEMA_VERSION
        file.attrs["complete"] = False
        for name in SPLITS:
            rows, group = splits[name], file.create_group(name)
            for key, shape in shapes.items():
                dtype = FEATURE_DTYPES[features] if key == "features" else np.float32
                allocated = _allocated(group, key, (len(rows), *shape), dtype)
                if key == "crop_embeddings":  # [N, G*G, E]: the grid's side G on the dataset
                    allocated.attrs["grid"] = round(shape[0] ** 0.5)
            store(group, "labels", rows.labels, as_csr, np.uint8)
            group.create_dataset("ids", data=np.array(rows.ids, dtype=object), dtype=h5py.string_dtype("utf-8"))
            if rows.observed is not None:
                store(group, "observed", rows.observed, as_csr, np.int8)
            if rows.label_mask is not None:
                store(group, MASK, rows.label_mask, as_csr, np.uint8)
            group.create_dataset("done", data=np.zeros(len(rows), dtype=bool))
            if bad_rows:
                group.create_dataset("bad", data=np.zeros(len(rows), dtype=bool))
                group.create_dataset("recomputed", data=np.zeros(len(rows), dtype=bool))
        columns.write_text(file, text)
        file.flush()
    except BaseException:
        _discard(file, path)
        raise
    return file


def _discard(file: h5py.File, path: Path) -> None:
    """Close `file` and remove it: a write that failed leaves nothing (closing flushes, which on a full disk fails
    too, and must not keep the file)."""
    try:
        file.close()
    except Exception:
        pass
    path.unlink(missing_ok=True)


def _seal(file: h5py.File, temporary: Path, final: Path) -> Path:
    file.attrs[CONTENT_ATTR] = reading.file_checksum(file)
    file.attrs["complete"] = True
    file.close()
    try:
        os.replace(temporary, final)
    except OSError as err:
        raise SpmlError(f"cannot move {temporary} to {final} ({err.strerror or err})") from None
    return final


def write(path: Path | str, *, attrs: dict, train: dict, val: dict, test: dict, text: dict | None = None,
          labels: str = DEFAULT_FORMAT, features: str = "float32") -> Path:
    """Write a complete cache in one go (import-features, tests, benchmarks).

    Each split dict has `features` float32 [N, D] (or a callable `(start, stop) -> rows`, for caches larger than
    memory), `labels` uint8 [N, C], `ids` list[str] and, for train and val, `observed` int8 [N, C] and
    optionally `rules` ({rule text: int8 [N, C]}, other observation rules); any split may have `label_mask` uint8
    [N, C] (1 where annotated) when its labels are partial; label matrices may be `SparseLabels`. `attrs`
    are the root attrs (schema_version and complete are set here). A CLIP cache's splits also have
    `image_embeddings` float32 [N, E] (and `crop_embeddings` [N, G*G, E]), and `text` is {"embeddings": float32
    [C, E], "templates": [str]}. `labels`: auto (CSR from `SPARSE_MIN_CLASSES` classes), dense or sparse;
    `features`: float32 or float16 storage.
    """
    path = Path(path)
    temporary = partial_path(path)
    given = {"train": train, "val": val, "test": test}
    splits = {name: SplitRows(list(d["ids"]), d["labels"] if is_sparse(d["labels"]) else np.asarray(d["labels"]),
                              d.get("observed"), d.get("label_mask")) for name, d in given.items()}
    dims = {_width(d["features"]) for d in given.values()}
    if len(dims) != 1:
        raise SpmlError(f"features of the splits have different widths {sorted(dims)}")
    shapes = {key: np.asarray(train[key]).shape[1:] for key in ROW_DATASETS if key in train and key != "features"}
    shapes = {"features": (dims.pop(),), **shapes}
    try:
        file = _create(temporary, attrs, splits, shapes, bad_rows=False, text=text, labels=labels, features=features)
    except DiskFull:  # its partial file is gone: the cache is what the user named
        raise DiskFull(path) from None
    try:
        for name, split in given.items():
            stored, total = file[name]["features"], len(splits[name])
            for start in range(0, max(total, 1), COPY_BLOCK_ROWS):
                check_stop()  # a signal that only asked for a stop (`stops_deferred`) ends the write here
                block = _feature_rows(split["features"], start, min(start + COPY_BLOCK_ROWS, total))
                if start == 0 and not callable(split["features"]) and len(split["features"]) != total:
                    raise SpmlError(f"{name}: {len(split['features'])} feature rows for {total} ids")
                stored[start : start + len(block)] = block
            for key in shapes.keys() - {"features"}:  # a CLIP cache's embeddings
                array = np.asarray(split[key], dtype=np.float32)
                if array.shape != (total, *shapes[key]):
                    raise SpmlError(f"{name}: {key} has shape {array.shape}, expected {(total, *shapes[key])}")
                file[name][key][...] = array
            file[name]["done"][...] = True
        rules = train.get("rules") or {}
        write_rules(file, {rule: (mask, val["rules"][rule]) for rule, mask in rules.items()})
        check_stop()
        return _seal(file, temporary, path)
    except BaseException as err:
        _discard(file, temporary)
        if isinstance(err, (OSError, RuntimeError)) and DiskFull.caused(err):  # h5py's words: lines of HDF5's
            raise DiskFull(path) from None
        raise


def _width(features) -> int:
    return int(features(0, 1).shape[1]) if callable(features) else np.asarray(features).shape[1]


def _feature_rows(features, start: int, stop: int) -> np.ndarray:
    rows = features(start, stop) if callable(features) else features[start:stop]
    return np.asarray(rows, dtype=np.float32)


class PartialCache:
    """An extraction in progress: `<name>.h5.partial`, filled batch by batch, then finalised."""

    def __init__(self, file: h5py.File, final: Path) -> None:
        self.file, self.final = file, final

    @classmethod
    def create(cls, final: Path, attrs: dict, splits: dict[str, SplitRows], feature_dim: int | RowShapes,
               text: dict | None = None, labels: str = DEFAULT_FORMAT) -> "PartialCache":
        """`feature_dim`: the features' width, or the shape per row of each per-row dataset (a CLIP cache's
        embeddings besides the features); `text`: a CLIP cache's class text embeddings and templates; `labels`:
        auto (CSR from `SPARSE_MIN_CLASSES` classes), dense or sparse."""
        return cls(_create(partial_path(final), attrs, splits, feature_dim, bad_rows=True, text=text, labels=labels),
                   final)

    @classmethod
    def open(cls, final: Path) -> "PartialCache":
        path = partial_path(final)
        try:
            file = h5py.File(path, "r+")
        except OSError as err:
            raise reading.partial_not_writable(path, err) from None
        if "bad" not in file["train"]:
            file.close()
            raise SpmlError(f"{path} was not written by an extraction; delete it or pass --force")
        for split in SPLITS:  # a partial file from before the fp32 fallback: none of its rows was recomputed
            if "recomputed" not in file[split]:
                file[split].create_dataset("recomputed", data=np.zeros(len(file[split]["done"]), dtype=bool))
        return cls(file, final)

    def pending(self, split: str) -> np.ndarray:
        """Row indices not yet done, ascending."""
        return np.flatnonzero(~self.file[split]["done"][...])

    def num_done(self) -> int:
        return sum(int(self.file[split]["done"][...].sum()) for split in SPLITS)

    def num_bad(self) -> int:
        """Rows flagged bad so far (left out when the cache is finalised)."""
        return sum(int(self.file[split]["bad"][...].sum()) for split in SPLITS)

    def write_rows(
        self, split: str, rows: np.ndarray, features: np.ndarray, bad: np.ndarray, recomputed: np.ndarray | None = None
    ) -> None:
        """Store the features of `rows` (ascending) and mark them done; rows flagged `bad` get no features,
        rows flagged `recomputed` were computed again in fp32 after giving non-finite features in fp16/bf16.
        `features` holds every per-row dataset's columns side by side (`row_shapes`): the features alone, or
        for a CLIP cache the features then the embeddings.

        Features go in first and are flushed before `done` is set, so a kill in between redoes the rows.
        """
        group = self.file[split]
        for start, stop in _runs(rows):
            take = slice(np.searchsorted(rows, start), np.searchsorted(rows, start) + stop - start)
            columns.write_wide(group, start, stop, features[take])
            if bad[take].any():
                group["bad"][start:stop] = bad[take]
            if recomputed is not None and recomputed[take].any():
                group["recomputed"][start:stop] = recomputed[take]
        self.file.flush()
        for start, stop in _runs(rows):
            group["done"][start:stop] = True
        self.file.flush()

    def join_shards(self, shards: list["PartialCache"]) -> None:
        """Fill every row from `shards`, shard i of N holding rows i, i + N, i + 2N, ... of each split (how
        extraction under torchrun divides them), a block of rows at a time: one contiguous write per block."""
        count = len(shards)
        for split in SPLITS:
            total, dim = len(self.file[split]["features"]), columns.width(row_shapes(self.file[split]))
            for low in range(0, total, COPY_BLOCK_ROWS):
                high = min(low + COPY_BLOCK_ROWS, total)
                features = np.zeros((high - low, dim), dtype=np.float32)
                bad, recomputed = np.zeros(high - low, dtype=bool), np.zeros(high - low, dtype=bool)
                for index, shard in enumerate(shards):
                    first = -(-(low - index) // count)  # the shard's first row at or after global row `low`
                    here = slice(index + first * count - low, high - low, count)
                    there = slice(first, first + len(range(high - low)[here]))
                    group = shard.file[split]
                    if not group["done"][there].all():
                        raise SpmlError(f"{partial_path(shard.final)} has rows not yet extracted; resume the run")
                    features[here], bad[here] = columns.read_wide(group, there), group["bad"][there]
                    recomputed[here] = group["recomputed"][there]
                self.write_rows(split, np.arange(low, high), features, bad, recomputed)

    def recomputed(self) -> dict[str, int]:
        """Rows per split kept with features recomputed in fp32, this run and the runs it resumes."""
        return {
            split: int((self.file[split]["recomputed"][...] & ~self.file[split]["bad"][...]).sum()) for split in SPLITS
        }

    def finalise(self, attrs: dict, rules: Callable[[dict[str, SplitRows]], RuleMasks] | None = None
                 ) -> tuple[Path, dict[str, list[str]]]:
        """Seal the cache under its final name, dropping rows whose image was bad; returns (path, dropped ids).

        `attrs` are added to the root attrs (the run's device and versions), with `recomputed_fp32`. Without
        bad rows the partial file itself is sealed and renamed; with them a compact copy without those rows
        is written instead. `rules`: given the kept train and val rows (ids and labels), the observation rules'
        masks to store with them.
        """
        for split in SPLITS:
            if not self.file[split]["done"][...].all():
                raise SpmlError(f"{partial_path(self.final)}: {split} has rows not yet extracted; resume the run")
        bad = {split: self.file[split]["bad"][...] for split in SPLITS}
        self._refuse_emptied(bad)
        dropped = {split: [] for split in SPLITS}
        for split in SPLITS:
            if bad[split].any():
                ids = self._ids(split)
                dropped[split] = [ids[i] for i in np.flatnonzero(bad[split])]
        recomputed = {split: count for split, count in self.recomputed().items() if count}
        attrs = {
            **attrs,
            "skipped_images": json.dumps({k: v for k, v in dropped.items() if v}),
            "recomputed_fp32": json.dumps(recomputed),
        }

        def store_rules(file: h5py.File) -> None:  # from the rows kept
            if rules is not None:
                kept = {split: SplitRows(list(file[split]["ids"].asstr()[...]),
                                         read(file[split]["labels"], np.uint8), None,
                                         read(file[split][MASK], np.uint8) if MASK in file[split] else None)
                        for split in OBSERVED_SPLITS}
                write_rules(file, rules(kept))

        if not any(bad[split].any() for split in SPLITS):
            _set_attrs(self.file, attrs)
            for split in SPLITS:
                del self.file[split]["bad"]
                del self.file[split]["recomputed"]
            store_rules(self.file)
            return _seal(self.file, partial_path(self.final), self.final), dropped
        return self._compact(attrs, bad, store_rules), dropped

    def _refuse_emptied(self, bad: dict[str, np.ndarray]) -> None:
        """A split whose every image was left out as undecodable would seal a cache of no rows there, which no
        later stage can use: one line naming the split instead."""
        for split in SPLITS:
            if len(bad[split]) and bad[split].all():
                raise SpmlError(
                    f"{partial_path(self.final)}: every one of the {len(bad[split])} {split} images was left out as"
                    f" undecodable (e.g. {self._ids(split)[0]}), so the cache would have no {split} rows: check the"
                    " images under --root, then run the command again with --force"
                )

    def _ids(self, split: str) -> list[str]:
        return list(self.file[split]["ids"].asstr()[...])

    def _compact(self, attrs: dict, bad: dict[str, np.ndarray], store_rules: Callable) -> Path:
        source = self.file
        keep = {split: np.flatnonzero(~bad[split]) for split in SPLITS}
        ids = {split: self._ids(split) for split in SPLITS}
        splits = {
            split: SplitRows(
                [ids[split][i] for i in keep[split]],
                take(read(source[split]["labels"], np.uint8), keep[split]),
                (take(read(source[split]["observed"], np.int8), keep[split])
                 if split in OBSERVED_SPLITS else None),
                take(read(source[split][MASK], np.uint8), keep[split]) if MASK in source[split] else None,
            )
            for split in SPLITS
        }
        as_csr = stored_sparse(source["train"]["labels"])
        root_attrs = {key: plain(value) for key, value in source.attrs.items()} | attrs
        temporary = self.final.with_name(self.final.name + ".compact.partial")
        stored = "float16" if source["train"]["features"].dtype == np.float16 else "float32"
        target = _create(temporary, root_attrs, splits, row_shapes(source["train"]), bad_rows=False,
                         labels="sparse" if as_csr else "dense", features=stored)
        try:
            for split in SPLITS:
                rows = keep[split]
                for begin in range(0, len(rows), COPY_BLOCK_ROWS):
                    block = rows[begin : begin + COPY_BLOCK_ROWS]
                    lo, hi = int(block[0]), int(block[-1]) + 1  # one contiguous read, then pick the kept rows
                    for name in row_shapes(source[split]):
                        target[split][name][begin : begin + len(block)] = source[split][name][lo:hi][block - lo]
                target[split]["done"][...] = True
            if TEXT_GROUP in source:
                source.copy(source[TEXT_GROUP], target, name=TEXT_GROUP)
            store_rules(target)
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
