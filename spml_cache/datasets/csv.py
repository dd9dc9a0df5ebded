"""The user's own multi-label data, described by one CSV file.

The root is a CSV file, or a folder holding `labels.csv`. The header row names the columns:

    path,labels,split
    images/0001.jpg,cat|dog,train
    images/0002.jpg,,test

- `path`: the image file, relative to the CSV's folder (which becomes the dataset root, so ids are these paths
  in POSIX form); each image once.
- `labels`: class names joined by `|`; may be empty (an image without any positive).
- `split` (optional): `train` or `test`. Without this column a deterministic 20% of the rows is held out as the
  test split: `numpy.random.RandomState(1200).permutation(N)`, the last `round(0.2 * N)` indices are the test
  rows, the rest the training rows (the protocol's val split is then carved out of the training rows).

Classes are the sorted union of every label name. Rows keep their CSV order within each split.

Partial labels take the wide form instead of `labels`: one column per class, in the order the header gives them,
each cell `1` (positive), `0` (negative), `-1` or blank (unknown):

    path,split,cat,dog
    images/0001.jpg,train,1,
    images/0002.jpg,test,0,-1

An unknown cell is a label nobody annotated: no observation rule observes it and test mAP leaves it out (the
split's label mask, docs/protocol.md, "The metric"). A wide file whose every cell is 1 or 0 is fully labelled.
"""

from __future__ import annotations

import csv
import posixpath
from pathlib import Path, PurePosixPath, PureWindowsPath

import numpy as np

from spml_cache.datasets.base import ImageSplit, LabeledImages, finish, label_matrix
from spml_cache.runtime.errors import SpmlError

NAME = "csv"
TITLE = "your own data (CSV)"
MARKER = "labels.csv"
LAYOUT = [
    "labels.csv (or pass the CSV file as the root)",
    "columns: path, labels (class names joined by |), optional split (train|test)",
    "or partial labels: path, optional split, one column per class with 1 / 0 / -1 or blank (unknown)",
    "paths relative to the CSV's folder",
]
ABOUT = "classes: every label name, sorted; no split column: a RandomState(1200) permutation holds out 20% as test"
# Its values elsewhere in the pipeline (datasets/__init__.py says what each is for; None: it has none)
EXPECTED_POSITIVES = None
PUBLISHED_ID_PREFIX = ""
REPORT_LABEL = None
COLUMNS = ("path", "labels", "split")
SPLITS = ("train", "test")
HOLDOUT_SEED = 1200
HOLDOUT_FRAC = 0.2


def holdout_test_rows(num_rows: int) -> np.ndarray:
    """bool [N]: the rows held out as the test split when the CSV has no split column."""
    perm = np.random.RandomState(HOLDOUT_SEED).permutation(num_rows)
    num_test = int(round(HOLDOUT_FRAC * num_rows))
    is_test = np.zeros(num_rows, dtype=bool)
    is_test[perm[num_rows - num_test :]] = True
    return is_test


def csv_path(root: Path) -> Path:
    path = root / MARKER if root.is_dir() else root
    if not path.is_file():
        raise SpmlError(f"missing {path}: expected a CSV file with columns path,labels[,split]")
    return path


def image_id(path: Path, line: int, value: str) -> str:
    """The image path as a POSIX id relative to the CSV's folder."""
    value = value.strip()
    if not value:
        raise SpmlError(f"{path}, line {line}: empty path; give the image file relative to {path.parent}")
    if PurePosixPath(value).is_absolute() or PureWindowsPath(value).is_absolute():
        raise SpmlError(f"{path}, line {line}: path {value!r} is absolute; make it relative to {path.parent}")
    normal = posixpath.normpath(value.replace("\\", "/"))  # one id per file: a/../a/x.jpg is a/x.jpg
    if normal == ".." or normal.startswith("../"):
        raise SpmlError(f"{path}, line {line}: path {value!r} is outside {path.parent}; keep the images below it")
    return normal


UNKNOWN_CELLS = ("", "-1")
CELL_VALUES = {"1": 1, "0": 0}


def read_cells(path: Path, line: int, header: list[str], fields: list[str]) -> list[str]:
    """The class names of a wide row's positive cells, then "!" + name for each negative: one list per row, as the
    long form's names; anything but 1 / 0 / -1 / blank is one line naming the cell."""
    names = []
    for name, cell in zip(header, fields):
        if name in COLUMNS:
            continue
        cell = cell.strip()
        if cell in UNKNOWN_CELLS:
            continue
        if cell not in CELL_VALUES:
            raise SpmlError(f"{path}, line {line}: column {name!r} holds {cell!r}; a class cell is 1 (positive), 0"
                            " (negative), -1 or blank (unknown)")
        names.append(name if CELL_VALUES[cell] else "!" + name)
    return names


def read_rows(path: Path) -> tuple[list[tuple[int, str, list[str], str | None]], bool, list[str] | None]:
    """(line, id, label names, split or None) per data row, whether the file has a split column, and the class
    columns of a wide (partial-label) file, None for the long form (where a negative name reads "!name")."""
    with open(path, encoding="utf-8-sig", newline="") as file:
        reader = csv.reader(file)
        header = next(reader, None)
        if header is None:
            raise SpmlError(f"{path}: the file is empty; expected a header row 'path,labels[,split]'")
        names = [name.strip() for name in header]
        header = [name.lower() if name.lower() in COLUMNS else name for name in names]
        wide = [name for name in header if name not in COLUMNS]
        if wide and "labels" in header:
            raise SpmlError(f"{path}, line 1: a labels column and class columns ({wide[0]!r}, ...): give labels"
                            " (names joined by |) or one column per class, not both")
        for name in ("path",) if wide else ("path", "labels"):
            if name not in header:
                raise SpmlError(f"{path}, line 1: no '{name}' column; the header must be 'path,labels[,split]'")
        if "" in wide:  # a class without a name: nothing could name it in a result, a loss or a prompt
            raise SpmlError(f"{path}, line 1: column {header.index('') + 1} has an empty name; name every class column"
                            " (or delete the empty one, a trailing comma included)")
        if len(set(header)) != len(header):
            raise SpmlError(f"{path}, line 1: a column is named twice; the header must be 'path,labels[,split]'")
        column = {name: index for index, name in enumerate(header)}
        rows = []
        for fields in reader:
            line = reader.line_num
            if not any(field.strip() for field in fields):
                continue
            if len(fields) != len(header):
                raise SpmlError(
                    f"{path}, line {line}: {len(fields)} fields for {len(header)} columns; "
                    "quote a field that contains a comma"
                )
            if wide:
                names = read_cells(path, line, header, fields)
            else:
                names = [name.strip() for name in fields[column["labels"]].split("|")]
            split = None
            if "split" in column:
                split = fields[column["split"]].strip().lower()
                if split not in SPLITS:
                    raise SpmlError(
                        f"{path}, line {line}: split {fields[column['split']]!r} is neither train nor test; "
                        "use train or test (or drop the column for a 20% hold-out)"
                    )
            rows.append((line, image_id(path, line, fields[column["path"]]), [n for n in names if n], split))
    return rows, "split" in column, (wide or None)


def read(root: Path, *, skip_missing: bool = False) -> LabeledImages:
    path = csv_path(root)
    rows, has_split, wide = read_rows(path)
    classes = wide or sorted({name for _, _, names, _ in rows for name in names})
    if not classes:
        raise SpmlError(f"{path}: no row has a label; put class names joined by | in the labels column")
    spellings: dict[str, list[str]] = {}
    for name in classes:
        spellings.setdefault(name.casefold(), []).append(name)
    for names in spellings.values():
        if len(names) > 1:  # almost always one class typed two ways, which would split its positives silently
            raise SpmlError(f"{path}: the labels {', '.join(repr(n) for n in names)} differ only in case; spell each"
                            " class one way")
    column = {name: index for index, name in enumerate(classes)}
    labels = label_matrix([[column[name] for name in names if name in column] for _, _, names, _ in rows],
                          len(classes))
    mask = None
    if wide:
        negatives = label_matrix([[column[name[1:]] for name in names if name not in column] for _, _, names, _ in rows],
                                 len(classes))
        mask = labels | negatives
        mask = None if mask.all() else mask
    ids = [row_id for _, row_id, _, _ in rows]
    notes = []
    if has_split:
        is_test = np.array([split == "test" for _, _, _, split in rows], dtype=bool)
    else:
        is_test = holdout_test_rows(len(rows))
        notes.append(
            f"no split column: {int(is_test.sum())} of {len(rows)} rows held out as test "
            f"(RandomState({HOLDOUT_SEED}) permutation, {HOLDOUT_FRAC:.0%})"
        )
    splits = {}
    for name, rows_in in (("train", ~is_test), ("test", is_test)):
        index = np.flatnonzero(rows_in)
        splits[name] = ImageSplit([ids[i] for i in index], labels[index], None if mask is None else mask[index])
    return finish(
        NAME, path.parent, classes, splits["train"], splits["test"], source=path, skip_missing=skip_missing, notes=notes
    )
