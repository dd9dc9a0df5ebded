"""Damaged inputs that used to pass (issue 36, item 6, and the CSR format of item 8): a sparse label matrix that
breaks CSR's invariants, a CSR group of another format, a cache without a content checksum under --resume or
--from, a CSV class column without a name. Each is one line naming the file and the fix, before anything is
written; the checksum's absence is a note, since the run can go on."""

import io
from pathlib import Path

import h5py
import numpy as np
import pytest
from rich.console import Console

from cli_support import run_cli
from linear_support import interrupted_run, quiet, write_synthetic_cache
from spml_cache import cache, datasets
from spml_cache.cache.csr import unordered_row
from spml_cache.labels import SparseLabels
from spml_cache.linear import run_linear
from spml_cache.runtime.errors import SpmlError

GRID = {"losses": "an", "lrs": [1e-2], "batch_sizes": [8], "epochs": 1}
NO_CHECKSUM = "cannot verify"


@pytest.fixture(scope="module")
def sparse_cache(tmp_path_factory):
    """A tiny cache whose label matrices are stored as CSR groups (every positive observed, so that observed rows
    hold several classes too)."""
    dense = write_synthetic_cache(tmp_path_factory.mktemp("dense") / "voc-resnet50-448.h5", train=40, val=16, test=20,
                                  classes=5, dim=8)
    features = cache.load(dense)
    splits = {name: {"features": split.features, "labels": split.labels, "ids": list(split.ids),
                     **({"observed": split.labels.astype(np.int8)} if split.observed is not None else {})}
              for name, split in ((name, getattr(features, name)) for name in cache.SPLITS)}
    attrs = {key: features.attrs[key] for key in ("dataset", "classes", "num_classes", "backbone", "weights",
                                                  "resolution", "feature_dim", "expected_positives")}
    return cache.write(tmp_path_factory.mktemp("sparse") / "voc-resnet50-448.h5", attrs=attrs, labels="sparse",
                       **splits)


def damaged_copy(source: Path, target: Path, array: str, damage) -> Path:
    """A copy of `source` whose CSR `/train/<array>` indices are passed through `damage(indices, indptr)`."""
    target.write_bytes(source.read_bytes())
    with h5py.File(target, "r+") as file:
        group = file["train"][array]
        indices, indptr = group["indices"][...], group["indptr"][...]
        damage(indices, indptr)
        group["indices"][...] = indices
    return target


def a_row_of_two(indptr: np.ndarray) -> int:
    return int(np.flatnonzero(np.diff(indptr) >= 2)[0])


def repeated(indices, indptr):
    row = a_row_of_two(indptr)
    indices[indptr[row] + 1] = indices[indptr[row]]


def swapped(indices, indptr):
    row = a_row_of_two(indptr)
    first = indptr[row]
    indices[first], indices[first + 1] = indices[first + 1], indices[first]


DAMAGES = [("labels", repeated), ("labels", swapped), ("observed", repeated)]


@pytest.mark.parametrize("array, damage", DAMAGES, ids=["labels-repeated", "labels-unsorted", "observed-repeated"])
def test_a_csr_row_with_a_repeated_or_unordered_class_is_refused(tmp_path, sparse_cache, array, damage):
    with h5py.File(sparse_cache) as file:  # the damage's target, found independently of the reader
        expected_row = a_row_of_two(file["train"][array]["indptr"][...])
    bad = damaged_copy(sparse_cache, tmp_path / "voc-resnet50-448.h5", array, damage)
    with pytest.raises(SpmlError) as refused:
        run_linear(cache=bad, out=tmp_path / "runs", console=quiet(), **GRID)
    assert str(refused.value) == (f"{bad}: /train/{array} is not a consistent CSR matrix: row {expected_row} holds a"
                                  " class twice or out of ascending order; rebuild the cache (extract --force)")
    assert not (tmp_path / "runs").exists()


def test_a_class_index_out_of_range_is_refused(tmp_path, sparse_cache):
    def beyond(indices, indptr):
        indices[0] = 5  # the cache has classes 0-4

    bad = damaged_copy(sparse_cache, tmp_path / "voc-resnet50-448.h5", "labels", beyond)
    with pytest.raises(SpmlError, match=r"/train/labels is not a consistent CSR matrix of shape \[\d+, 5\]"):
        run_linear(cache=bad, out=tmp_path / "runs", console=quiet(), **GRID)
    assert not (tmp_path / "runs").exists()


def test_the_order_check_matches_a_row_by_row_restatement():
    """`unordered_row` against the definition, row by row, on random CSR matrices with empty rows at either end."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        counts = rng.integers(0, 4, size=rng.integers(1, 8))
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        indices = rng.integers(0, 6, size=int(indptr[-1])).astype(np.int32)
        matrix = SparseLabels(indptr, indices, np.ones(len(indices), np.int8), 6)
        rows = [indices[indptr[r] : indptr[r + 1]] for r in range(len(counts))]
        expected = next((r for r, row in enumerate(rows) if not (np.diff(row.astype(int)) > 0).all()), None)
        assert unordered_row(matrix) == expected


def test_a_sparse_cache_written_by_the_package_passes(tmp_path, sparse_cache):
    done = run_linear(cache=sparse_cache, out=tmp_path / "runs", console=quiet(), **GRID)
    assert "an" in done.results["losses"]


def test_a_csr_group_of_another_format_is_one_line(tmp_path, sparse_cache):
    bad = tmp_path / "voc-resnet50-448.h5"
    bad.write_bytes(sparse_cache.read_bytes())
    with h5py.File(bad, "r+") as file:
        file["val"]["labels"].attrs["format"] = "csc"
    done = run_cli("linear", "--cache", str(bad), "--loss", "an", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"error: {bad}: /val/labels is a group with format 'csc', not a CSR matrix (format \"csr\") nor a dataset:"
        " rebuild the cache (extract --force)"]
    assert not (tmp_path / "runs").exists()


def test_a_damaged_csr_row_is_one_line_from_the_command_line(tmp_path, sparse_cache):
    bad = damaged_copy(sparse_cache, tmp_path / "voc-resnet50-448.h5", "labels", repeated)
    done = run_cli("linear", "--cache", str(bad), "--loss", "an", cwd=tmp_path)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: {bad}: /train/labels is not a consistent CSR matrix: row ")
    assert not (tmp_path / "runs").exists()


# --- a cache without a content checksum -----------------------------------------------------------------------

@pytest.fixture
def unsealed(tmp_path):
    """A cache as written before checksums existed: no content_hash attr."""
    path = write_synthetic_cache(tmp_path / "cache" / "voc-resnet50-448.h5", train=40, val=16, test=20, classes=4,
                                 dim=8)
    with h5py.File(path, "r+") as file:
        del file.attrs["content_hash"]  # the attr every sealed cache has (docs/internals.md)
    return path


def printed(**arguments) -> str:
    console = Console(file=io.StringIO(), width=400)
    run_linear(console=console, **arguments)
    return console.file.getvalue()


def test_from_a_run_on_a_cache_without_checksum_says_it_cannot_verify(tmp_path, unsealed):
    first = run_linear(cache=unsealed, out=tmp_path / "runs", console=quiet(), **GRID)
    assert NO_CHECKSUM not in printed(cache=unsealed, out=tmp_path / "fresh", **GRID)  # nothing to verify
    text = printed(cache=unsealed, out=tmp_path / "runs", from_run=first.run_dir, **GRID)
    assert f"note: cannot verify {unsealed}: it has no content checksum" in text


def test_resume_on_a_cache_without_checksum_says_it_cannot_verify(tmp_path, unsealed, monkeypatch):
    run_dir = interrupted_run(tmp_path / "runs", unsealed, monkeypatch, parts=1, losses=["an", "bce"], lrs=[1e-2],
                              batch_sizes=[8], epochs=1)
    text = printed(resume=run_dir)
    assert f"note: cannot verify {unsealed}: it has no content checksum" in text
    assert (run_dir / "results.json").exists()


def test_a_sealed_cache_gives_no_such_note(tmp_path):
    sealed = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5", train=40, val=16, test=20, classes=4, dim=8)
    first = run_linear(cache=sealed, out=tmp_path / "runs", console=quiet(), **GRID)
    assert NO_CHECKSUM not in printed(cache=sealed, out=tmp_path / "runs", from_run=first.run_dir, **GRID)


def test_a_new_run_on_a_cache_edited_in_place_is_refused(tmp_path, monkeypatch, capsys):
    """Only --resume and --from read the checksum: a new run trained on the edited features and recorded the sealed
    content's id. In memory the check is one more pass over what is loaded; streamed it is left to --resume."""
    from cli_support import run_main

    path = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5", train=40, val=16, test=20, classes=4, dim=8)
    with h5py.File(path, "r+") as file:
        file["val"]["features"][3, 1] += 0.5
    code, err = run_main("linear", "--cache", str(path), "--loss", "an", "--epochs", "1", cwd=tmp_path,
                         monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and err.strip().splitlines() == [
        f"error: {path} was changed after it was written (its contents no longer match its checksum): extract it"
        " again, or put the original back"], err
    assert not (tmp_path / "runs").exists()


# --- a CSV class column without a name ------------------------------------------------------------------------

@pytest.mark.parametrize("header, column", [("path,split,cat,,dog", 4), ("path,cat,dog,", 4), (",path,cat", 1)],
                         ids=["middle", "trailing comma", "first"])
def test_a_csv_class_column_without_a_name_is_refused(tmp_path, header, column):
    width = header.count(",") + 1
    row = ["x.jpg" if name == "path" else "train" if name == "split" else "1"
           for name in header.split(",")]
    (tmp_path / "labels.csv").write_text(header + "\n" + ",".join(row[:width]) + "\n")
    with pytest.raises(SpmlError) as refused:
        datasets.read("csv", tmp_path)
    assert str(refused.value) == (f"{tmp_path / 'labels.csv'}, line 1: column {column} has an empty name; name every"
                                  " class column (or delete the empty one, a trailing comma included)")
