"""Reading caches: the header alone (to compare settings), or the whole validated cache (`load`).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import h5py
import numpy as np

from spml_cache.cache.schema import (
    CONTENT_ATTR, COPY_BLOCK_ROWS, MASK, OBSERVED_SPLITS, RULES_GROUP, SCHEMA_VERSION, SPLITS, CachedSplit, FeatureSet,
    SplitRows, content_hash, partial_path, plain,
)
from spml_cache.cache.columns import ROW_DATASETS, TEXT_GROUP
from spml_cache.cache.csr import read, stored_shape, stored_sparse
from spml_cache.cache.rule_masks import read_rules
from spml_cache.labels import is_sparse
from spml_cache.runtime import locks
from spml_cache.runtime.errors import SpmlError

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
            observed = read(group["observed"], np.int8) if "observed" in group else None
            mask = read(group[MASK], np.uint8) if MASK in group else None
            splits[name] = SplitRows(list(group["ids"].asstr()[...]), read(group["labels"], np.uint8), observed,
                                     mask)
    return attrs, splits


def stored_rules(path: Path | str) -> set[str]:
    """The observation rules besides `single` whose masks a cache stores."""
    with _open(Path(path)) as file:
        return set(file["train"][RULES_GROUP]) if RULES_GROUP in file["train"] else set()


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
        lengths = {array: stored_shape(group[array])[0] for array in needed}
        if len(set(lengths.values())) != 1:
            described = ", ".join(f"{array} {length}" for array, length in lengths.items())
            raise SpmlError(f"{path}: the /{name} arrays disagree in length ({described}); re-extract the cache")
        for array in ("features", "labels") + (("observed",) if name in OBSERVED_SPLITS else ()):
            if len(stored_shape(group[array])) != 2:
                raise SpmlError(f"{path}: /{name}/{array} has shape {stored_shape(group[array])}, not one row"
                                " per image [rows, columns]; re-extract the cache")
        for array in ("labels",) + (("observed",) if name in OBSERVED_SPLITS else ()):
            if stored_shape(group[array])[1] != num_classes:
                raise SpmlError(f"{path}: /{name}/{array} has {stored_shape(group[array])[1]} columns,"
                                f" num_classes is {num_classes}")
        if not group["done"][...].all():
            raise SpmlError(f"{path}: /{name} has rows never written (done=false); re-extract the cache")
    widths = {name: file[name]["features"].shape[1] for name in SPLITS}
    if len(set(widths.values())) != 1:
        described = ", ".join(f"{name} {width}" for name, width in widths.items())
        raise SpmlError(f"{path}: the splits' features differ in width ({described}); re-extract the cache")


def invalid_rows(array: np.ndarray, allowed: range | None = None) -> np.ndarray:
    """Indices of the rows of a 2-d array holding a NaN or an infinity (`allowed` None), or a value outside
    the integer range `allowed`.

    Block by block, each block first by one reduction that reads it once and allocates nothing: its sum is
    non-finite when any element is (finite values that overflow it only cost an exact look), and an integer
    block's min and max bound its values. On a COCO-size cache that costs a tenth of reading the features,
    an elementwise mask half, and a whole-array mask would be a quarter of their memory.
    """
    found = []
    with np.errstate(all="ignore"):  # overflowing sums and inf - inf are expected here
        for start in range(0, len(array), COPY_BLOCK_ROWS):
            block = array[start : start + COPY_BLOCK_ROWS]
            if allowed is None:
                if np.isfinite(block.sum()):
                    continue
                wrong = ~np.isfinite(block).all(axis=1)
            else:
                if block.size == 0 or (
                    block.dtype.kind in "biu" and allowed.start <= block.min() and block.max() < allowed.stop
                ):
                    continue
                wrong = ~np.isin(block, np.asarray(allowed)).all(axis=1)
            found.append(start + np.flatnonzero(wrong))
    return np.concatenate(found) if found else np.zeros(0, dtype=np.intp)


def describe_rows(rows: np.ndarray, ids: list[str], shown: int = 3) -> str:
    """'2 rows (ids a.jpg, b.jpg)': how many, and which, for a one-line error."""
    named = ", ".join(str(ids[i]) for i in rows[:shown]) + (", ..." if len(rows) > shown else "")
    return f"{len(rows)} row{'s' if len(rows) != 1 else ''} (ids {named})"


def _refuse_bad_values(path: Path, name: str, raw: dict[str, np.ndarray], ids: list[str], dataset) -> None:
    """One line naming the file, the split, how many rows and which, and the fix: a cache that a NaN or a
    label of 2 got into would poison every later stage, where it shows as diverged heads, not as its cause."""
    wrong = invalid_rows(raw["features"])
    if len(wrong):
        raise SpmlError(
            f"{path}: /{name}/features is not finite (NaN or inf) in {describe_rows(wrong, ids)}: re-extract it"
            f" in full precision (spml-cache extract {dataset} --precision fp32 --force)"
        )
    for array, allowed in (("labels", range(0, 2)), ("observed", range(-1, 2)), (MASK, range(0, 2))):
        if array not in raw:
            continue
        matrix = raw[array]
        if is_sparse(matrix):
            outside = np.flatnonzero(~np.isin(matrix.values, np.asarray(allowed)))
            wrong = np.unique(np.searchsorted(matrix.indptr, outside, side="right") - 1)
        else:
            wrong = invalid_rows(matrix, allowed)
        if len(wrong):
            values = ", ".join(map(str, allowed))
            raise SpmlError(
                f"{path}: /{name}/{array} has values outside {{{values}}} in {describe_rows(wrong, ids)}: fix the"
                " labels at their source and rebuild the cache (extract or import-features with --force)"
            )


def _label_mask(path: Path, name: str, raw: dict):
    """The split's label mask (partial labels; dense, or sparse beside sparse labels), checked; None without."""
    mask = raw.get(MASK)
    if mask is not None and mask.shape != raw["labels"].shape:
        raise SpmlError(f"{path}: /{name}/{MASK} has shape {mask.shape}, labels {raw['labels'].shape}: rebuild the"
                        " cache (extract --force)")
    if mask is None or is_sparse(mask):
        return mask
    return mask.astype(np.uint8, copy=False)


NORM_TOLERANCE = 1e-2  # stored embeddings are L2-normalised: a norm further from 1 is a damaged or foreign array


def _embeddings(path: Path, where: str, dataset, shape: tuple) -> np.ndarray:
    """One stored embedding array, checked: its shape (None: any size there), finite, rows of unit norm."""
    fix = f"re-extract it (spml-cache extract {dataset} --backbone clip:ViT-B-16/openai --force)"
    with _open(path) as file:
        array = file[where][...].astype(np.float32, copy=False)
    if array.ndim != len(shape) or any(want is not None and got != want for got, want in zip(array.shape, shape)):
        wanted = "[" + ", ".join("*" if want is None else str(want) for want in shape) + "]"
        raise SpmlError(f"{path}: {where} has shape {list(array.shape)}, expected {wanted}: {fix}")
    flat = array.reshape(-1, array.shape[-1]) if array.size else array.reshape(0, 1)
    if len(invalid_rows(flat)):
        raise SpmlError(f"{path}: {where} is not finite (NaN or inf): {fix}")
    norms = np.linalg.norm(flat, axis=1)
    if len(norms) and np.abs(norms - 1).max() > NORM_TOLERANCE:
        raise SpmlError(f"{path}: {where} holds rows that are not L2-normalised (norms {norms.min():.3g} to"
                        f" {norms.max():.3g}): {fix}")
    return array


def _text_side(path: Path, attrs: dict, lengths: dict[str, int]) -> tuple[np.ndarray | None, dict]:
    """The class text embeddings and each split's image (and crop) embeddings, where the cache has a text side:
    `(text [C, E] or None, {split: {"image_embeddings": ..., "crop_embeddings": ...}})`."""
    with _open(path) as file:
        if TEXT_GROUP not in file or "embeddings" not in file[TEXT_GROUP]:
            return None, {name: {} for name in SPLITS}
        crops = {name: "crop_embeddings" in file[name] for name in SPLITS}
        grids = {name: plain(file[name]["crop_embeddings"].attrs.get("grid", 0)) for name in SPLITS if crops[name]}
        has_images = {name: "image_embeddings" in file[name] for name in SPLITS}
    dataset = attrs.get("dataset", "DATASET")
    text = _embeddings(path, f"/{TEXT_GROUP}/embeddings", dataset, (int(attrs["num_classes"]), None))
    width = text.shape[1]
    sides = {}
    for name in SPLITS:
        if not has_images[name]:
            raise SpmlError(f"{path} has class text embeddings but no /{name}/image_embeddings: re-extract it"
                            f" (spml-cache extract {dataset} --backbone clip:ViT-B-16/openai --force)")
        side = {"image_embeddings": _embeddings(path, f"/{name}/image_embeddings", dataset, (lengths[name], width))}
        if crops[name]:
            grid = int(grids[name] or 0)
            side["crop_embeddings"] = _embeddings(path, f"/{name}/crop_embeddings", dataset,
                                                  (lengths[name], grid * grid if grid else None, width))
        sides[name] = side
    return text, sides


def load_cache(path: Path | str, *, in_memory: bool = True) -> FeatureSet:
    """The feature cache at `path` (`sc.load_cache`), read and validated: a `FeatureSet`, whose `train`, `val` and
    `test` splits each hold `features` (float32 [N, D]), `labels` (uint8 [N, C], the full ground truth; sparse
    caches: `SparseLabels`), `ids` (the images' paths under the dataset's root) and, for train and val,
    `observed` (int8 [N, C]: 1 the single observed positive, 0 unobserved); `classes`, `attrs` (how it was made),
    `dataset`.

    Parameters
    ----------
    path : path
        The cache file (.h5), as `sc.extract` wrote it (`report.path`).
    in_memory : True or False
        False: the features stay in the file, read on demand (a cache larger than memory)."""
    if not isinstance(path, (str, os.PathLike)):
        raise SpmlError(f"sc.load_cache: path {path!r}: give the cache file's path (a str or pathlib.Path)")
    if not isinstance(in_memory, bool):
        raise SpmlError(f"sc.load_cache: in_memory {in_memory!r}: give True or False")
    return load(path, in_memory)


def load(path: Path | str, in_memory: bool = True) -> FeatureSet:
    """Read and validate a complete cache; refuses non-finite features and labels out of range. Labels stored
    sparse come as `SparseLabels`. `in_memory` False: the features stay in the file, each split's a
    `StoredFeatures` that reads rows on demand (checked block by block now)."""
    path = Path(path)
    with _open(path) as file:
        _validate(path, file)
        attrs = {key: plain(value) for key, value in file.attrs.items()}
        splits = {}
        for name in SPLITS:
            group = file[name]
            raw = {"labels": read(group["labels"], np.uint8)}
            if "observed" in group:
                raw["observed"] = read(group["observed"], np.int8)
            # a float64 beyond float32 is an inf
            raw["features"] = group["features"][...].astype(np.float32, copy=False) if in_memory else group["features"]
            if MASK in group:
                raw[MASK] = read(group[MASK], np.uint8)
            ids = list(group["ids"].asstr()[...])
            _refuse_bad_values(path, name, raw, ids, attrs.get("dataset", "DATASET"))
            splits[name] = CachedSplit(
                features=raw["features"] if in_memory else StoredFeatures(path, name, group["features"].shape),
                labels=raw["labels"] if is_sparse(raw["labels"]) else raw["labels"].astype(np.uint8, copy=False),
                ids=ids,
                observed=raw.get("observed"),
                rules=read_rules(path, name, group, raw["labels"].shape),
                label_mask=_label_mask(path, name, raw),
            )
    text, sides = _text_side(path, attrs, {name: len(split) for name, split in splits.items()})
    splits = {name: replace(split, **sides[name]) for name, split in splits.items()}
    classes = class_names(attrs)
    return FeatureSet(train=splits["train"], val=splits["val"], test=splits["test"], classes=classes, attrs=attrs,
                      dataset=str(attrs["dataset"]), path=path, text_embeddings=text)


class StoredFeatures:
    """One split's features left in the cache file: rows read (as float32) when asked for."""

    def __init__(self, path: Path, split: str, shape: tuple[int, int]) -> None:
        self.path, self.split, self.shape = Path(path), split, tuple(int(v) for v in shape)
        self._file = None

    def __len__(self) -> int:
        return self.shape[0]

    def _dataset(self) -> h5py.Dataset:
        if self._file is None or not self._file.id.valid:
            self._file = _open(self.path)
        return self._file[self.split]["features"]

    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows `start:stop` as float32 `[stop - start, D]`: one contiguous read, converted as it is read (no
        float16 copy beside it), into the first rows of `out` (float32, C-contiguous) when given: a buffer
        reused from read to read keeps resident memory flat."""
        dataset, rows = self._dataset(), stop - start
        if out is None:
            return dataset[start:stop] if dataset.dtype == np.float32 else dataset.astype(np.float32)[start:stop]
        if rows:
            dataset.read_direct(out, np.s_[start:stop], np.s_[0:rows])
        return out[:rows]

    def __getitem__(self, rows: slice) -> np.ndarray:
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("StoredFeatures reads contiguous row ranges only")
        start, stop, _ = rows.indices(len(self))
        return self.read(start, stop)

    def close(self) -> None:
        if self._file is not None and self._file.id.valid:
            self._file.close()
        self._file = None

    def __getstate__(self) -> dict:
        return {"path": self.path, "split": self.split, "shape": self.shape, "_file": None}


def feature_shapes(path: Path | str) -> tuple[dict[str, tuple[int, int]], int, int]:
    """Each split's feature shape, the bytes the label matrices take in memory and the class count, without
    reading them (to plan memory)."""
    def size(node) -> int:
        return sum(part.nbytes for part in node.values()) if stored_sparse(node) else node.nbytes

    with _open(Path(path)) as file:
        _validate(Path(path), file)
        shapes = {name: tuple(file[name]["features"].shape) for name in SPLITS}
        labels = sum(size(file[name][array]) for name in SPLITS for array in ("labels", "observed")
                     if array in file[name])
        num_classes = int(plain(file.attrs["num_classes"]))
    return shapes, labels, num_classes


def file_checksum(file: h5py.File) -> str:
    """The content checksum of an open cache's arrays, as sealing stores it (writing.py) and `verify` compares it."""
    return content_hash({
        name: (file[name]["features"], read(file[name]["labels"], np.uint8),
               read(file[name]["observed"], np.int8) if "observed" in file[name] else None,
               list(file[name]["ids"].asstr()[...]),
               read(file[name][MASK], np.uint8) if MASK in file[name] else None,
               {key: file[name][key] for key in ROW_DATASETS[1:] if key in file[name]})
        for name in SPLITS
    }, file[TEXT_GROUP]["embeddings"] if TEXT_GROUP in file else None)


def verify(features: FeatureSet) -> str | None:
    """The cache's arrays are still those it was sealed with (its content checksum), else one line. Caches
    written before the checksum existed have none to compare: the note that says so is returned (else None)."""
    stored = features.attrs.get(CONTENT_ATTR)
    if stored is None:
        return (f"note: cannot verify {features.path}: it has no content checksum (written before checksums"
                " existed), so a changed or swapped cache would go unnoticed; extract it again to give it one")
    now = content_hash({name: (split.features, split.labels, split.observed, split.ids, split.label_mask,
                               {"image_embeddings": split.image_embeddings, "crop_embeddings": split.crop_embeddings})
                        for name, split in ((name, getattr(features, name)) for name in SPLITS)},
                       features.text_embeddings)
    if now != stored:
        raise SpmlError(f"{features.path} was changed after it was written (its contents no longer match its"
                        " checksum): extract it again, or put the original back")
    return None


def partial_not_writable(path: Path, err: OSError) -> SpmlError:
    """Why the partial file cannot be opened for writing, with the fix. HDF5 locks a file that a program has open
    for reading (h5py, HDFView) against any writer: closing that program keeps every image done, where deleting the
    file or --force would extract them all again. (Another extraction is refused before, by its lock.)"""
    if "unable to lock file" not in str(err):
        return SpmlError(f"cannot resume from {path} ({err}): it is damaged; delete it or pass --force (its images"
                         " are then extracted again)")
    try:
        with h5py.File(path, "r", locking=False) as file:
            kept = sum(int(file[split]["done"][...].sum()) for split in SPLITS)
        kept_text = f"the {kept} images done are kept"
    except (OSError, KeyError):
        kept_text = "what was done is kept"
    holders = ", ".join(locks.opened_by(path)) or "an HDF5 reader: h5py, HDFView"
    return SpmlError(f"cannot resume from {path}: another program has it open ({holders}), and HDF5 keeps a file"
                     f" open for reading from being written: close it there, then run the same command again"
                     f" ({kept_text})")
