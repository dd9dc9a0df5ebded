"""`report --ci` and `--compare` resample the test images in memory: a count that would not fit is refused before
anything is allocated, in one line naming --resamples and the most that fits (issue 56)."""

from __future__ import annotations

import itertools
import math
import os
import resource
import subprocess
import sys

import numpy as np
import pytest
from cli_support import REPO, run_cli
from test_report_metrics import fake_scores, write_run

from spml_cache.report import bootstrap


@pytest.fixture
def sixty_images(tmp_path):
    labels = (np.random.default_rng(0).random((60, 5)) < 0.3).astype(np.uint8)
    write_run(tmp_path / "runs", {"an": fake_scores(1, labels, 1.0), "role": fake_scores(2, labels, 1.6)}, labels)
    return tmp_path


def test_a_count_no_machine_holds_is_refused_in_one_line(sixty_images):
    done = run_cli("report", "--ci", "--resamples", "1000000000000", cwd=sixty_images)
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 1 and line.startswith("error: --resamples 1,000,000,000,000: the bootstrap of 60 test"
                                                    " images (5 classes) would take about "), done.stderr
    assert " TB of memory, and " in line and " or fewer (1,000, the default, is enough for a 95% interval)" in line


def mapped_after_imports() -> int:
    """The address space a report process maps before it resamples (torch, numpy, scipy: gigabytes of libraries)."""
    probe = ("import scipy.sparse, torch, spml_cache.cli, spml_cache.report.command;"
             " print(open('/proc/self/status').read().split('VmPeak:')[1].split()[0])")
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, check=True)
    return int(done.stdout) * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; an address-space limit is Linux's")
def test_under_a_memory_limit_the_refusal_names_a_count_that_runs(sixty_images):
    """Under `ulimit -v` (the machine's RAM free, the process's room not) 8,000,000 resamples raised a MemoryError
    ("Unable to allocate ..."), the flag never named. The count the line names runs under the same limit."""
    limit = mapped_after_imports() + 400 * 2**20

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    done = run_cli("report", "--ci", "--resamples", "8000000", cwd=sixty_images, preexec_fn=limited)
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 1 and line.startswith("error: --resamples 8,000,000: the bootstrap of 60 test images"), line
    fit = int(line.split("give --resamples ")[1].split(" or fewer")[0].replace(",", ""))
    assert 1000 <= fit < 8_000_000
    done = run_cli("report", "--ci", "--resamples", str(fit), cwd=sixty_images, preexec_fn=limited)
    assert done.returncode == 0 and f"{fit:,} resamples" in done.stdout, done.stderr


def test_the_memory_needed_grows_with_the_count_and_the_most_that_fits_is_the_largest():
    for metric in ("map", "cf1@3"):
        needs = [bootstrap.bytes_needed(count, 60, 5, 20, metric) for count in (1, 10, 1000, 10**6, 10**9)]
        assert needs == sorted(needs)
        room = bootstrap.bytes_needed(123_456, 60, 5, 20, metric)
        assert bootstrap.most_that_fit(room, 60, 5, 20, metric) == 123_456
        assert bootstrap.bytes_needed(123_457, 60, 5, 20, metric) > room
    assert bootstrap.most_that_fit(10, 60, 5, 20, "map") == 0


@pytest.mark.parametrize("rows, classes, density, count, metric", [
    (200, 20, 0.3, 30_000, "map"), (60, 5, 0.3, 300_000, "map"), (400, 3, 0.5, 60_000, "map"),
    (2000, 5, 0.3, 5_000, "map"), (20, 200, 0.3, 30_000, "cf1"), (50, 1000, 0.3, 5_000, "of1@3"),
])
def test_the_estimate_is_not_below_the_peak_measured(rows, classes, density, count, metric):
    """In a process of its own: the peak resident memory that drawing the resamples and scoring one result on them
    adds (Linux's high-water mark, reset to the resident memory just before), against `bytes_needed`, which may be
    above it, never below."""
    code = f"""
import numpy as np, torch
from spml_cache.report import bootstrap
from spml_cache.runs import StoredTest
rng = np.random.default_rng(0)
labels = (rng.random(({rows}, {classes})) < {density}).astype(np.uint8)
stored = StoredTest([0], rng.random((1, {rows}, {classes})).astype(np.float32), labels, None)
status = lambda key: int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark starts again from here
before = status("VmRSS")
bootstrap.resampled(stored, {metric!r}, bootstrap.Resamples.draw({rows}, {count}))
print(status("VmHWM") - before, int(labels.sum(0).max()))
"""
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, check=True)
    peak, most = map(int, done.stdout.split())
    estimate = bootstrap.bytes_needed(count, rows, classes, most, metric)
    assert peak <= estimate <= 1.5 * peak, (peak, estimate)


def test_a_test_split_too_small_for_its_resamples_to_differ_is_said(tmp_path, sixty_images):
    """3 test images have C(5, 3) = 10 distinct resamples: --ci printed intervals and --compare p = 1 from them with
    no word that they mean little (issue 56)."""
    labels = np.array([[1, 0, 1, 0, 1], [0, 1, 1, 0, 0], [1, 1, 0, 1, 1]], dtype=np.uint8)
    write_run(tmp_path / "tiny" / "runs", {"an": fake_scores(1, labels, 1.0), "role": fake_scores(2, labels, 1.6)},
              labels)
    note = ("VOC linear: the test split has 3 images, so only 10 distinct resamples of it exist and the 1,000 drawn"
            " repeat them: its intervals and p-values say little (they need a larger test split)")
    for flags in (["--ci"], ["--compare", "an,role"]):
        done = run_cli("report", *flags, cwd=tmp_path / "tiny")
        assert done.returncode == 0 and note in done.stdout.splitlines(), done.stdout
    assert math.comb(2 * 3 - 1, 3) == 10 == len({tuple(np.bincount(draw, minlength=3)) for draw in  # restated
                                                 itertools.product(range(3), repeat=3)})
    done = run_cli("report", "--ci", "--compare", "an,role", cwd=sixty_images)  # C(119, 60): no note
    assert done.returncode == 0 and "distinct resamples" not in done.stdout, done.stdout
