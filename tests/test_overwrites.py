"""What `--force` may replace (issue 36, item 7): only caches. An HDF5 file that is not a cache is named and left
alone, by `extract` and `import-features`, with --force or without; the shard files of a running torchrun
extraction are locked against a one-process `extract --force` as the cache itself is."""

import h5py
import numpy as np
import pytest
from cli_support import run_cli
from test_import_features import write_authors_files

from spml_cache.demo.data import make_demo_data
from spml_cache.extract import extract, import_features
from spml_cache.runtime import locks
from spml_cache.runtime.errors import SpmlError

NOT_A_CACHE = "is an HDF5 file but not an spml-cache cache (no schema_version attribute): pick another --out"


@pytest.fixture(scope="module")
def voc_root(tmp_path_factory):
    return make_demo_data(tmp_path_factory.mktemp("voc"), num_train=10, num_test=4, size=40)


def foreign_hdf5(path):
    """Someone's own HDF5 file (not written by spml-cache), and its bytes to compare after."""
    with h5py.File(path, "w") as file:
        file.create_dataset("measurements", data=np.arange(12.0))
        file.attrs["owner"] = "another tool"
    return path.read_bytes()


@pytest.mark.parametrize("force", [False, True])
def test_extract_never_replaces_an_hdf5_file_that_is_not_a_cache(tmp_path, voc_root, force):
    out = tmp_path / "voc.h5"
    before = foreign_hdf5(out)
    with pytest.raises(SpmlError) as refused:
        extract("voc", voc_root, out=out, force=force, weights="none", resolution=32, device="cpu", workers=0)
    assert str(refused.value).startswith(f"{out} {NOT_A_CACHE}")
    assert out.read_bytes() == before


def test_the_command_line_names_the_file_that_is_not_a_cache(tmp_path, voc_root):
    out = tmp_path / "voc.h5"
    before = foreign_hdf5(out)
    done = run_cli("extract", "voc", "--root", str(voc_root), "--out", str(out), "--force", "--weights", "none",
                   cwd=tmp_path)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: {out} {NOT_A_CACHE}") and "re-extract" not in line
    assert out.read_bytes() == before


@pytest.mark.parametrize("force", [False, True])
def test_import_features_never_replaces_an_hdf5_file_that_is_not_a_cache(tmp_path, force):
    folder = tmp_path / "pascal"
    write_authors_files(folder)
    out = tmp_path / "voc.h5"
    before = foreign_hdf5(out)
    with pytest.raises(SpmlError) as refused:
        import_features(folder, dataset="voc", out=out, force=force)
    assert str(refused.value).startswith(f"{out} {NOT_A_CACHE}")
    assert out.read_bytes() == before


def test_a_cache_is_still_replaced_with_force(tmp_path):
    folder = tmp_path / "pascal"
    write_authors_files(folder)
    out = tmp_path / "voc.h5"
    import_features(folder, dataset="voc", out=out)
    with h5py.File(out) as file:
        assert "schema_version" in file.attrs  # what tells a cache, restated from docs/internals.md
    assert import_features(folder, dataset="voc", out=out, force=True).path == out


# --- the shards of a torchrun extraction --------------------------------------------------------------------

def shard_files(out):
    """The partial files a 2-process extraction of `out` leaves beside it (as extract/shards.py names them)."""
    partials = [out.with_name(f"{out.name}.shard-{rank}-of-2.partial") for rank in range(2)]
    for path in partials:
        path.write_bytes(b"rows of a running rank")
    return partials, [out.with_name(f"{out.name}.shard-{rank}-of-2") for rank in range(2)]


@pytest.mark.parametrize("rank", [0, 1])
def test_force_leaves_the_shards_of_a_running_extraction_alone(tmp_path, voc_root, rank):
    out = tmp_path / "voc.h5"
    partials, writers = shard_files(out)
    with locks.held(writers[rank], f"the cache {writers[rank]}"):  # as that rank holds it while it extracts
        with pytest.raises(SpmlError) as refused:
            extract("voc", voc_root, out=out, force=True, dry_run=True, weights="none", resolution=32, device="cpu")
    assert str(refused.value).startswith(f"the cache shard {writers[rank]} is being written by process ")
    assert all(path.read_bytes() == b"rows of a running rank" for path in partials)


def test_force_leaves_the_shards_alone_while_rank_0_joins_them(tmp_path, voc_root):
    out = tmp_path / "voc.h5"
    partials, _ = shard_files(out)
    with locks.held(out, f"the cache {out}"):  # rank 0 holds the cache's lock while it copies the shards in
        with pytest.raises(SpmlError, match=f"the cache {out} is being written by process "):
            extract("voc", voc_root, out=out, force=True, dry_run=True, weights="none", resolution=32, device="cpu")
    assert all(path.exists() for path in partials)


def test_force_removes_the_shards_of_a_stopped_extraction(tmp_path, voc_root):
    out = tmp_path / "voc.h5"
    partials, writers = shard_files(out)
    extract("voc", voc_root, out=out, force=True, dry_run=True, weights="none", resolution=32, device="cpu")
    assert not any(path.exists() for path in partials)
    assert not any(locks.lock_path(path).exists() for path in [out, *writers])  # no lock file left behind
