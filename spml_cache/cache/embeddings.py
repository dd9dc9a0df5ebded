"""The clip-retrieval embedding layout, read (`import-features DIR --root R`) and written (`spml-cache export`).

    DIR/img_emb/img_emb_{i}.npy            float [N_i, D], one row per image
    DIR/metadata/metadata_{i}.parquet      N_i rows naming the same images in the same order

clip-retrieval writes it, embedding-reader reads it; a part's metadata row k names the image of its embedding row
k (by `image_path`, or by an `id` column). An export writes one part per split (0: train, 1: val, 2: test)
whose parquet has `id` and `image_path` (the image's id, its path under the dataset root), `split`, `labels`
(fixed-size list of uint8, the full labels), `observed` (list of int8, -1/0/1, one per class; null in test) and,
for partial labels, `label_mask` (fixed-size list of uint8, 1 where annotated), and `spml_cache.json` beside them:
the cache's dataset, classes, path, backbone settings and protocol settings. An import reads such an export back
as it was (`read_export`: its splits, labels and single positives; no images needed).
Parquet goes through pyarrow, the `parquet` extra.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from spml_cache.cache.reading import load
from spml_cache.cache.csr import SPARSE_MIN_CLASSES
from spml_cache.cache.schema import COPY_BLOCK_ROWS, OBSERVED_SPLITS, SPLITS, cache_id, plain
from spml_cache.labels import SparseLabels, is_sparse, stack
from spml_cache.runtime.disk import remove_stale_temporaries, require_room, temporary_path
from spml_cache.runtime.errors import DiskFull, Interrupted, SpmlError, check_stop, finished, stops_deferred

EMBEDDINGS, METADATA = "img_emb", "metadata"
SIDECAR = "spml_cache.json"
KEY_COLUMNS = ("id", "image_path")  # what a metadata row names its image by, in order of preference
# The cache attrs that say what the features are: an export keeps them, an import of it restores them.
DESCRIBING = ("backbone", "weights", "resolution", "resize", "mean", "std", "feature_dim", "clip_features",
              "backbone_origin", "features")
# The cache attrs that say how its rows were drawn: an export keeps them, so that an import of it without the
# images gives the same cache (`read_export`); an export without them (made before they were kept) needs --root.
PROTOCOL = ("split_seed", "val_frac", "observe_seed", "num_pos", "num_neg", "expected_positives", "precision",
            "decoder", "limit", "skipped_missing", "skipped_images")
LABEL_MASK = "label_mask"
EXPORT_MARGIN = 64 * 2**10  # bytes beyond `export_size` (an overestimate: parquet compresses): its footers


def is_layout(folder: Path) -> bool:
    """Whether `folder` holds the clip-retrieval layout (an img_emb/ folder)."""
    return (Path(folder) / EMBEDDINGS).is_dir()


def parquet():
    """(pyarrow, pyarrow.parquet), or one line saying how to install them."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise SpmlError('the clip-retrieval layout\'s metadata is parquet, which needs pyarrow: pip install'
                        ' "spml-cache[parquet]"') from None
    return pyarrow, pyarrow.parquet


@dataclass
class Parts:
    """Every part of a layout, in part order: its embedding arrays (memory-mapped) and key columns."""

    folder: Path
    arrays: list[np.ndarray]
    offsets: np.ndarray  # the first row of each part, and the total at the end
    keys: dict[str, list] = field(default_factory=dict)  # KEY_COLUMNS present in every part, row for row
    sidecar: dict = field(default_factory=dict)

    def take(self, positions: np.ndarray) -> np.ndarray:
        """float32 rows at `positions` (over all parts, in part order)."""
        width = self.arrays[0].shape[1]
        out = np.empty((len(positions), width), dtype=np.float32)
        part = np.searchsorted(self.offsets, positions, side="right") - 1
        for index in np.unique(part):
            chosen = part == index
            out[chosen] = self.arrays[index][positions[chosen] - self.offsets[index]]
        return out


def _numbered(folder: Path, stem: str, suffix: str) -> dict[int, Path]:
    pattern = re.compile(rf"{stem}_(\d+)\.{suffix}")
    return {int(match.group(1)): path for path in folder.glob(f"{stem}_*.{suffix}")
            if (match := pattern.fullmatch(path.name))}


def _matched_files(folder: Path) -> list[tuple[Path, Path]]:
    arrays = _numbered(folder / EMBEDDINGS, EMBEDDINGS, "npy")
    tables = _numbered(folder / METADATA, METADATA, "parquet")
    if not arrays:
        raise SpmlError(f"{folder / EMBEDDINGS}: no img_emb_<i>.npy files; pass a folder in the clip-retrieval"
                        " layout (img_emb/img_emb_<i>.npy beside metadata/metadata_<i>.parquet)")
    for index in sorted(set(arrays) ^ set(tables)):
        have, lack = ((arrays[index], folder / METADATA / f"{METADATA}_{index}.parquet") if index in arrays
                      else (tables[index], folder / EMBEDDINGS / f"{EMBEDDINGS}_{index}.npy"))
        raise SpmlError(f"{have} has no partner {lack}: every part needs both files; add it or remove {have.name}")
    return [(arrays[index], tables[index]) for index in sorted(arrays)]


def _read_array(path: Path) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as err:
        raise SpmlError(f"{path} is not a readable .npy array ({err}); write it again") from None
    if array.ndim != 2 or array.dtype.kind != "f":
        raise SpmlError(f"{path}: {array.dtype} {array.shape}, not a float [rows, width] array of embeddings")
    return array


def read_parts(folder: Path) -> Parts:
    """The layout in `folder`, checked: partner files, one metadata row per embedding row, one width."""
    _, pq = parquet()
    folder = Path(folder).expanduser()
    arrays, keys, lengths = [], {name: [] for name in KEY_COLUMNS}, []
    for array_path, table_path in _matched_files(folder):
        array = _read_array(array_path)
        try:
            table = pq.read_table(table_path, columns=[c for c in KEY_COLUMNS
                                                       if c in pq.read_schema(table_path).names])
        except Exception as err:  # pyarrow's own errors: a damaged or foreign file
            raise SpmlError(f"{table_path} is not a readable parquet file ({type(err).__name__}: {err})") from None
        if table.num_rows != len(array):
            raise SpmlError(f"{table_path}: {table.num_rows} rows for the {len(array)} of {array_path.name}; a"
                            " part's metadata names its embeddings row for row: write the two together")
        if arrays and array.shape[1] != arrays[0].shape[1]:
            raise SpmlError(f"{array_path}: width {array.shape[1]}, the first part's is {arrays[0].shape[1]};"
                            " every part must come from one model")
        for name in KEY_COLUMNS:
            values = table.column(name).to_pylist() if name in table.column_names else None
            keys[name] = None if values is None or keys[name] is None else keys[name] + values
        arrays.append(array)
        lengths.append(len(array))
    sidecar_path = folder / SIDECAR
    sidecar = json.loads(sidecar_path.read_text(encoding="utf-8")) if sidecar_path.is_file() else {}
    present = {name: values for name, values in keys.items() if values is not None}
    return Parts(folder, arrays, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), present, sidecar)


def read_sidecar(folder: Path) -> dict:
    """The folder's spml_cache.json ({} where there is none: clip-retrieval's own output)."""
    path = Path(folder) / SIDECAR
    if not path.is_file():
        return {}
    try:
        sidecar = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SpmlError(f"{path} is not readable JSON ({err}); export the cache again") from None
    return sidecar if isinstance(sidecar, dict) else {}


def is_export(sidecar: dict) -> bool:
    """Whether the sidecar is an export's that records how its rows were drawn (read back without images)."""
    return {"dataset", "classes", "parts", "protocol"} <= sidecar.keys()


def made_from(sidecar: dict, path: Path) -> bool:
    """Whether the cache at `path` is the one the export was made from: the path its sidecar records, or a cache
    of the same id (its attrs hash) wherever it now lies."""
    source = sidecar.get("cache")
    if source and Path(source).expanduser().resolve() == Path(path).expanduser().resolve():
        return True
    if not Path(path).is_file() or "cache_id" not in sidecar:
        return False
    try:
        with h5py.File(path, "r") as file:
            attrs = {key: plain(value) for key, value in file.attrs.items()}
    except OSError:  # not HDF5, or locked by its writer: not the export's source as it was
        return False
    return cache_id(attrs) == sidecar["cache_id"]


@dataclass
class Exported:
    """An export read back as the cache it was made from: the sidecar and `cache.write`'s split dicts (features
    memory-mapped; labels, observed and label_mask as exported, sparse from `SPARSE_MIN_CLASSES` classes)."""

    folder: Path
    sidecar: dict
    splits: dict[str, dict]


def _label_rows(table_path: Path, name: str, column, num_classes: int, dtype, sparse: bool):
    """A list column of `num_classes` values per row as an [N, C] matrix (None where every row is null)."""
    if column.null_count == len(column) and len(column):
        return None
    values = column.flatten().to_numpy(zero_copy_only=False)
    lengths = column.value_lengths().to_numpy(zero_copy_only=False) if hasattr(column, "value_lengths") else None
    allowed = (-1, 0, 1) if dtype == np.int8 else (0, 1)
    if (len(values) != len(column) * num_classes or (lengths is not None and (lengths != num_classes).any())
            or not np.isin(values, allowed).all()):
        raise SpmlError(f"{table_path}: its {name} lists are not {num_classes} values in {allowed} per row; export"
                        " the cache again")
    matrix = values.astype(dtype).reshape(len(column), num_classes)
    return SparseLabels.from_dense(matrix) if sparse else matrix


def _read_split_rows(table_path: Path, num_classes: int, observed: bool) -> dict:
    """An export's metadata part read back a block of rows at a time: ids, labels, label_mask, and observed where
    the split has single positives (test's null column is not read: older exports wrote it as a null fixed-size
    list, which pyarrow before 26 cannot read back, "Expected all lists to be of size=C")."""
    _, pq = parquet()
    sparse = num_classes >= SPARSE_MIN_CLASSES
    required = {"id", "labels", "observed"}
    try:
        file = pq.ParquetFile(table_path)
        present = set(file.schema_arrow.names)
        names = [name for name in ("id", "labels", "observed", LABEL_MASK)
                 if name in present and (observed or name != "observed")]
        blocks = list(file.iter_batches(batch_size=COPY_BLOCK_ROWS, columns=names)) if required <= present else []
    except Exception as err:  # pyarrow's own errors: a damaged or foreign file
        raise SpmlError(f"{table_path} is not a readable parquet file ({type(err).__name__}: {err})") from None
    if not required <= present:
        raise SpmlError(f"{table_path}: no id, labels and observed columns, which an export writes; export the"
                        " cache again, or import with --root DIR (the images' folder)")
    rows = {"ids": [str(v) for block in blocks for v in block.column("id").to_pylist()]}
    for name, dtype in (("labels", np.uint8), ("observed", np.int8), (LABEL_MASK, np.uint8)):
        if name in names:
            parts = [_label_rows(table_path, name, block.column(name), num_classes, dtype, sparse) for block in blocks]
            if parts and all(part is not None for part in parts):
                rows[name] = stack(parts)
    if not blocks:
        rows["labels"] = np.zeros((0, num_classes), np.uint8)
    return rows


def read_export(folder: Path) -> Exported:
    """An export (`is_export`) read back: one part per split as its sidecar's `parts` names them, each part's
    metadata row for row with its embeddings."""
    folder = Path(folder).expanduser()
    sidecar = read_sidecar(folder)
    files = _matched_files(folder)
    parts = {int(index): name for index, name in sidecar["parts"].items()}
    if sorted(parts) != list(range(len(files))) or sorted(parts.values()) != sorted(SPLITS):
        raise SpmlError(f"{folder}: {len(files)} img_emb parts, where {SIDECAR} names {len(parts)} ({parts}); an"
                        " export holds one part per split: export the cache again")
    splits = {}
    for index, (array_path, table_path) in enumerate(files):
        check_stop()
        array = _read_array(array_path)
        rows = _read_split_rows(table_path, len(sidecar["classes"]), parts[index] in OBSERVED_SPLITS)
        if len(rows["ids"]) != len(array):
            raise SpmlError(f"{table_path}: {len(rows['ids'])} rows for the {len(array)} of {array_path.name}; a"
                            " part's metadata names its embeddings row for row: export the cache again")
        splits[parts[index]] = {"features": array, **rows}
    return Exported(folder, sidecar, splits)


@dataclass
class ExportReport:
    folder: Path
    counts: dict[str, int]


def _dense_rows(matrix, start: int, stop: int, dtype) -> np.ndarray:
    if is_sparse(matrix):
        return matrix.row_range(start, stop, dtype)
    return np.asarray(matrix[start:stop], dtype=dtype)


def _fixed_lists(pa, rows: np.ndarray, value_type):
    return pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1), type=value_type), rows.shape[1])


def _lists(pa, rows: np.ndarray, value_type):
    """[N, C] rows as a plain list column (pyarrow before 26 cannot read a null fixed-size list from parquet)."""
    offsets = np.arange(len(rows) + 1, dtype=np.int32) * rows.shape[1]
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(rows.reshape(-1), type=value_type))


def _write_features(file, split) -> None:
    """The split's features as a float32 .npy, written with plain writes a block at a time: a full disk is an
    error here, where a memory map over a file whose blocks are not yet on the disk dies of SIGBUS."""
    total, width = len(split.ids), split.features.shape[1]
    np.lib.format.write_array_header_1_0(file, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)),
                                                "fortran_order": False, "shape": (total, width)})
    for start in range(0, total, COPY_BLOCK_ROWS):
        check_stop()
        file.write(np.ascontiguousarray(split.features[start : start + COPY_BLOCK_ROWS], dtype=np.float32).data)


def _write_metadata(file, name: str, split) -> None:
    pa, pq = parquet()
    total, num_classes = len(split.ids), split.labels.shape[1]
    mask = getattr(split, LABEL_MASK, None)
    schema = pa.schema([("id", pa.string()), ("image_path", pa.string()), ("split", pa.string()),
                        ("labels", pa.list_(pa.uint8(), num_classes)), ("observed", pa.list_(pa.int8())),
                        *([(LABEL_MASK, pa.list_(pa.uint8(), num_classes))] if mask is not None else [])])
    with pq.ParquetWriter(file, schema) as writer:
        for start in range(0, max(total, 1), COPY_BLOCK_ROWS):  # labels made dense a block at a time
            check_stop()
            stop = min(start + COPY_BLOCK_ROWS, total)
            ids = split.ids[start:stop]
            observed = (pa.nulls(stop - start, schema.field("observed").type) if split.observed is None else
                        _lists(pa, _dense_rows(split.observed, start, stop, np.int8), pa.int8()))
            masks = [] if mask is None else [_fixed_lists(pa, _dense_rows(mask, start, stop, np.uint8), pa.uint8())]
            writer.write_table(pa.table([pa.array(ids, pa.string()), pa.array(ids, pa.string()),
                                         pa.array([name] * (stop - start), pa.string()),
                                         _fixed_lists(pa, _dense_rows(split.labels, start, stop, np.uint8), pa.uint8()),
                                         observed, *masks], schema=schema))


def _write_file(path: Path, write) -> None:
    """`write(file)` into a new file at `path`, flushed to the disk before it is closed."""
    with open(path, "xb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())


def _write_layout(folder: Path, path: Path, features) -> None:
    """The whole layout of `features` (the cache at `path`) into the new folder `folder`."""
    (folder / EMBEDDINGS).mkdir(parents=True)
    (folder / METADATA).mkdir()
    for index, name in enumerate(SPLITS):
        split = getattr(features, name)
        _write_file(folder / EMBEDDINGS / f"{EMBEDDINGS}_{index}.npy", lambda file: _write_features(file, split))
        _write_file(folder / METADATA / f"{METADATA}_{index}.parquet",
                    lambda file: _write_metadata(file, name, split))
    sidecar = {"dataset": features.dataset, "classes": features.classes, "cache": str(path.resolve()),
               "cache_id": cache_id(features.attrs), "parts": dict(enumerate(SPLITS)),
               "attrs": {key: plain(features.attrs[key]) for key in DESCRIBING if key in features.attrs},
               "protocol": {key: plain(features.attrs[key]) for key in PROTOCOL if key in features.attrs}}
    _write_file(folder / SIDECAR, lambda file: file.write(json.dumps(sidecar, indent=1).encode("utf-8")))


def export_size(features) -> int:
    """About the bytes an export of `features` takes: the .npy files exactly, the parquet files' columns before
    compression (ids twice, one byte per label and per observed label)."""
    splits = [getattr(features, name) for name in SPLITS]
    arrays = sum(128 + 4 * len(split.ids) * split.features.shape[1] for split in splits)
    tables = sum(sum(2 * len(i.encode("utf-8")) + 16 for i in split.ids) + 2 * split.labels.size for split in splits)
    return arrays + tables


def _move_into(temporary: Path, out: Path) -> None:
    """The layout built in `temporary` (inside `out`, an empty folder that may be a mount point, which cannot be
    replaced) moved into `out`: img_emb/ last, so that a reader finds the layout only once it is whole."""
    for entry in (SIDECAR, METADATA, EMBEDDINGS):
        os.replace(temporary / entry, out / entry)
    temporary.rmdir()


def _refuse_occupied(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SpmlError(f"--out {out} exists and is not an empty folder: pick another --out (an export never"
                        " writes over files)")


def export(path: Path, out: Path) -> ExportReport:
    """Write the cache at `path` into `out` in the clip-retrieval layout (a new or empty folder), all at once: it
    is built in a temporary folder and renamed into place, beside `out` for a new folder, inside it for an
    empty one (a mount point cannot be replaced). What an export killed before it finished left there (its
    process gone) is removed first."""
    parquet()
    path, out = Path(path).expanduser(), Path(out).expanduser()
    remove_stale_temporaries(out.parent, out.name)
    if out.is_dir():
        remove_stale_temporaries(out, out.name)
    _refuse_occupied(out)
    features = load(path)
    inside = out.is_dir()
    temporary = temporary_path(out / out.name if inside else out)
    needed = export_size(features)
    require_room(out, needed, margin=EXPORT_MARGIN, disk=out if inside else out.parent)
    try:
        with stops_deferred():  # pyarrow's and h5py's callbacks would lose a KeyboardInterrupt: taken per block
            _write_layout(temporary, path, features)
            if inside:
                _move_into(temporary, out)
            else:
                os.replace(temporary, out)
            finished()  # in place: a stop that came meanwhile has nothing left to stop
    except BaseException as err:
        shutil.rmtree(temporary, ignore_errors=True)
        if inside:  # what was moved in before the error (out was empty)
            shutil.rmtree(out / EMBEDDINGS, ignore_errors=True)
            shutil.rmtree(out / METADATA, ignore_errors=True)
            with suppress(OSError):
                (out / SIDECAR).unlink()
        raise _export_error(err, out, needed) from None
    return ExportReport(out, {name: len(getattr(features, name)) for name in SPLITS})


def _export_error(err: BaseException, out: Path, needed: int) -> BaseException:
    """What an export that failed says: nothing of it is left, and why."""
    if isinstance(err, KeyboardInterrupt):  # Ctrl-C, SIGTERM: the half-written folder is gone, nothing kept
        return Interrupted(f"nothing was written to {out}")
    if isinstance(err, Exception) and DiskFull.caused(err):
        return DiskFull(out, f"export again (it needs about {needed / 2**20:.1f} MiB)")
    if isinstance(err, OSError):
        return SpmlError(f"cannot write the export in {out} ({err.strerror or err}): nothing was written; pick a"
                         " writable --out folder")
    return err
