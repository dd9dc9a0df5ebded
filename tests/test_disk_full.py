"""A full disk is one line naming the file, the space left and how to go on, never a crash or a traceback: on a
real small filesystem (a tmpfs the test mounts; skipped where it cannot mount one), for extract, linear, export and
import-features, with nothing half-written left. A read-only one too, and an empty mount point as `export --out`."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from cli_support import run_cli
from linear_support import quiet, write_synthetic_cache

from spml_cache.linear import run_linear
from spml_cache.runtime.errors import DiskFull

GRID = dict(losses=["an", "role"], lrs=[1e-2], batch_sizes=[4, 8], epochs=2)


def mounted(folder, options: str):
    """A 1 MiB tmpfs mounted at `folder` with mount's `options`; the test is skipped where that is not allowed."""
    folder.mkdir()
    if not sys.platform.startswith("linux") or shutil.which("mount") is None:
        pytest.skip("mounting a small filesystem needs Linux's mount")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here (needs root): {done.stderr.strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    yield from mounted(tmp_path / "small", "size=1m")


@pytest.fixture
def read_only_disk(tmp_path):
    yield from mounted(tmp_path / "read-only", "size=1m,ro")


def fill(folder, leave: int):
    """A file that leaves `leave` bytes free on the folder's filesystem."""
    filler = folder / "filler"
    filler.write_bytes(b"\0" * (shutil.disk_usage(folder).free - leave))
    return filler


def linear_stopped_by_full_disk(cache_path, disk, **grid):
    """`linear` into `disk` until it is full: the one line names a file of the run and the command that goes on;
    returns the run directory."""
    with pytest.raises(DiskFull) as full:
        run_linear(cache=cache_path, out=disk, console=quiet(), **grid)
    (run_dir,) = (disk / "voc").iterdir()
    assert re.fullmatch(rf"no space left on the disk to write {re.escape(str(run_dir))}/\S+ \([\d.]+ MiB free\):"
                        rf" free some space, then go on with: spml-cache linear --resume {re.escape(str(run_dir))}",
                        str(full.value))
    return run_dir


def test_extract_on_a_full_disk_stops_before_writing(small_disk, tmp_path):
    from spml_cache.demo.data import make_demo_data

    make_demo_data(tmp_path / "data", num_train=4, num_test=2, size=32)
    done = run_cli("extract", "voc", "--root", str(tmp_path / "data"), "--out", str(small_disk / "voc.h5"),
                   "--weights", "none", "--resolution", "32", "--workers", "0", cwd=tmp_path)
    lines = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert re.match(rf"error: not enough space for {re.escape(str(small_disk))}/voc.h5: it needs about [\d.]+ MiB,"
                    r" and [\d.]+ MiB are free on that disk: free some space, or pick another --out$", lines[0])
    assert list(small_disk.iterdir()) == []


def test_linear_on_a_disk_that_fills_mid_run_says_so_and_goes_on(small_disk, tmp_path):
    cache_path = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5", train=40, val=16, test=20)
    whole = run_linear(cache=cache_path, out=tmp_path / "whole", console=quiet(), **GRID)
    filler = fill(small_disk, leave=24 * 1024)  # the run's first files and a part or two
    run_dir = linear_stopped_by_full_disk(cache_path, small_disk, **GRID)
    assert (run_dir / "labels.npz").exists()  # written first: report's figures need it
    filler.unlink()
    resumed = run_linear(resume=run_dir, console=quiet())
    strip = lambda results: {n: {k: v for k, v in e.items() if k != "seconds"} for n, e in results["losses"].items()}
    assert strip(resumed.results) == strip(whole.results)


def test_demo_data_on_a_read_only_disk_is_one_line(read_only_disk, tmp_path):
    done = run_cli("make-demo-data", str(read_only_disk / "demo"), "--train", "4", "--test", "2", cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"error: cannot write the demo data in {read_only_disk / 'demo'} (Read-only file system): pick a writable"
        " folder"], done.stderr


# --- export and import-features (issue 48) --------------------------------------------------------------------


def run_with_room_unchecked(module: str, *args: str, cwd) -> subprocess.CompletedProcess:
    """`spml-cache ARGS` from a subprocess whose room check (`module`'s `require_room`) passes whatever is free: as
    when the disk fills after the check, another writer taking the space meanwhile. (A subprocess: what this
    reproduces killed its process with SIGBUS.)"""
    from cli_support import REPO

    code = (f"import sys, {module} as m; m.require_room = lambda *a, **k: None; sys.argv[0] = 'spml-cache';"
            " from spml_cache.cli import main; main()")
    environment = {key: value for key, value in os.environ.items() if not key.startswith("SPML_")}
    environment.update(PYTHONPATH=str(REPO), COLUMNS="400")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=environment, capture_output=True,
                          text=True, timeout=300)


def the_error_line(code: int, stderr: str) -> str:
    assert code == 1, (code, stderr)
    (line,) = stderr.strip().splitlines()
    assert line.startswith("error: "), line
    return line


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    """`spml-cache ARGS` in this process (`cli.main`), for the refusals: (exit code, stderr)."""
    from cli_support import run_main

    return lambda *args: run_main(*args, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)


@pytest.fixture
def export_cache(tmp_path):
    pytest.importorskip("pyarrow")
    return write_synthetic_cache(tmp_path / "voc.h5", train=3000, val=500, test=1000, dim=64)  # 1.1 MiB of rows


def test_export_to_a_small_disk_says_the_room_it_needs_and_leaves_nothing(small_disk, export_cache, cli):
    for leave in (None, 0):  # as it is, and with no byte free (it was a raw "[Errno 28]" naming no file)
        if leave is not None:
            fill(small_disk, leave)
        line = the_error_line(*cli("export", str(export_cache), "--out", str(small_disk / "ex")))
        assert re.fullmatch(rf"error: not enough space for {re.escape(str(small_disk))}/ex: it needs about [\d.]+ MiB,"
                            r" and [\d.]+ MiB are free on that disk: free some space, or pick another --out", line)
        assert sorted(path.name for path in small_disk.iterdir()) == ([] if leave is None else ["filler"])


def test_export_on_a_disk_that_fills_as_it_writes_is_one_line_not_sigbus(small_disk, tmp_path, export_cache):
    """The .npy went through a memory map over a sparse file: the disk full, writing into it killed the process
    with SIGBUS (rc 135, nothing printed) and left its hidden temporary folder behind."""
    done = run_with_room_unchecked("spml_cache.cache.embeddings", "export", str(export_cache), "--out",
                                   str(small_disk / "ex"), cwd=tmp_path)
    assert re.fullmatch(rf"error: no space left on the disk to write {re.escape(str(small_disk))}/ex \([\d.]+ MiB"
                        r" free\): free some space, then export again \(it needs about [\d.]+ MiB\)",
                        the_error_line(done.returncode, done.stderr))
    assert list(small_disk.iterdir()) == []


def test_export_to_a_read_only_disk_is_one_line(read_only_disk, tmp_path, cli):
    pytest.importorskip("pyarrow")
    cache_path = write_synthetic_cache(tmp_path / "voc.h5", train=40, val=16, test=20)
    for out in (read_only_disk / "ex", read_only_disk):  # a folder in it, and the empty mount point itself
        assert the_error_line(*cli("export", str(cache_path), "--out", str(out))) == (
            f"error: cannot write the export in {out} (Read-only file system): nothing was written; pick a writable"
            " --out folder")


def test_export_into_an_empty_mount_point_writes_into_it(small_disk, tmp_path):
    """A mount point cannot be replaced by a rename ("[Errno 16] Device or resource busy"): the layout is built in
    it and moved into place there."""
    from spml_cache.cache.embeddings import read_parts

    pytest.importorskip("pyarrow")
    cache_path = write_synthetic_cache(tmp_path / "voc.h5", train=40, val=16, test=20)
    done = run_cli("export", str(cache_path), "--out", str(small_disk), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(path.name for path in small_disk.iterdir()) == ["img_emb", "metadata", "spml_cache.json"]
    parts = read_parts(small_disk)
    assert list(parts.offsets) == [0, 40, 56, 76] and parts.sidecar["dataset"] == "voc"


@pytest.fixture
def authors_files(tmp_path):
    from test_import_features import write_authors_files

    write_authors_files(tmp_path / "authors", num_train=3000, num_test=1000, dim=64)
    return tmp_path / "authors"


def test_import_features_on_a_full_disk_is_one_line_and_leaves_no_partial_file(small_disk, authors_files, cli,
                                                                                monkeypatch):
    """It was two lines of HDF5's own text, at 0 bytes free "pick a writable --out folder", and a 0-byte
    `.partial` left behind."""
    from spml_cache.extract import published

    out = small_disk / "voc.h5"
    args = ("import-features", str(authors_files), "--dataset", "voc", "--out", str(out))
    assert re.fullmatch(rf"error: not enough space for {re.escape(str(out))}: it needs about [\d.]+ MiB, and [\d.]+"
                        r" MiB are free on that disk: free some space, or pick another --out",
                        the_error_line(*cli(*args)))
    monkeypatch.setattr(published, "require_room", lambda *a, **k: None)  # the disk fills after the check
    for leave in (None, 0):  # as it writes, and no byte free at all
        if leave is not None:
            fill(small_disk, leave)
        assert re.fullmatch(rf"error: no space left on the disk to write {re.escape(str(out))} \([\d.]+ MiB free\):"
                            r" free some space, then run the command again", the_error_line(*cli(*args)))
        assert sorted(path.name for path in small_disk.iterdir()) == ([] if leave is None else ["filler"])
