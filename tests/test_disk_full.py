"""A full disk is one line naming the file, the space left and how to go on, never a crash or a traceback: on a
real small filesystem (a tmpfs the test mounts; skipped where it cannot mount one). A read-only one too."""

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
