"""Raw errors that became one line naming the file and the fix (issue 36, item 8): no space for a lock file,
torch.save on a disk that fills mid-file (with linear's resume hint), a rule seed beyond numpy's 32 bits, a
results.json or config.json that is not an object, a scores file that is not an .npz archive. (A CSR group of
another format: test_damaged_inputs.py.)"""

import errno
import json
import re

import numpy as np
import pytest
import torch
from cli_support import run_cli, run_main
from linear_support import quiet, write_synthetic_cache
from test_disk_full import fill, linear_stopped_by_full_disk, mounted
from test_report import make_run

from spml_cache import observation, runs
from spml_cache.linear import run_linear
from spml_cache.report import collect, plots
from spml_cache.runtime import locks
from spml_cache.runtime.errors import DiskFull, SpmlError


@pytest.fixture
def small_disk(tmp_path):
    yield from mounted(tmp_path / "small", "size=4m")


# --- a full disk --------------------------------------------------------------------------------------------

def test_no_room_for_the_lock_file_is_one_line_naming_it(small_disk, tmp_path):
    from spml_cache.demo.data import make_demo_data

    root = make_demo_data(tmp_path / "data", num_train=4, num_test=2, size=32)
    fill(small_disk, leave=0)
    out = small_disk / "voc.h5"
    done = run_cli("extract", "voc", "--root", str(root), "--out", str(out), "--weights", "none", "--resolution",
                   "32", "--workers", "0", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if not line.startswith("warning: --weights none")]
    assert "Traceback" not in done.stderr, done.stderr
    assert re.fullmatch(rf"error: no space left on the disk to write {re.escape(str(locks.lock_path(out)))}"
                        r" \(0\.0 MiB free\): free some space, then run the command again", line), line
    assert not locks.lock_path(out).exists()


def test_a_lock_file_that_cannot_be_written_is_disk_full_wherever_it_is(tmp_path, monkeypatch):
    """The same without a small filesystem: the holder's line fails to be written with ENOSPC."""
    def no_room(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(locks.os, "pwrite", no_room)
    guarded = tmp_path / "voc.h5"
    with pytest.raises(DiskFull, match=f"no space left on the disk to write {re.escape(str(tmp_path))}/.voc.h5.lock"):
        with locks.held(guarded, "the cache"):
            pytest.fail("the block must not run without its lock named")
    assert not locks.lock_path(guarded).exists()


def test_torch_saves_context_of_a_full_disk_is_a_full_disk():
    """torch.save turns a failed write into RuntimeError("... unexpected pos ..."), the OSError as its context."""
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 832 vs 726")
    except RuntimeError as err:
        assert DiskFull.caused(err)
    assert not DiskFull.caused(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1 vs 0"))


@pytest.mark.parametrize("leave", [30 * 1024, 50 * 1024, 100 * 1024])
def test_linear_filling_the_disk_inside_torch_save_names_the_file_and_the_resume(small_disk, tmp_path, leave):
    """Files of a few hundred KB (1024-wide heads) on a disk that fills inside one of them: torch.save's own
    error, before, at these sizes (the leave values were found that way); now the run's one line with --resume."""
    cache_path = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5", train=40, val=16, test=20, dim=1024,
                                       classes=10)
    grid = {"losses": ["an"], "lrs": [1e-2], "batch_sizes": [8], "epochs": 1}
    fill(small_disk, leave=leave)
    run_dir = linear_stopped_by_full_disk(cache_path, small_disk, **grid)
    assert not list(run_dir.rglob(".*.tmp-*"))  # no temporary file left behind


def test_save_checkpoint_on_a_disk_that_fills_mid_file_names_it(small_disk):
    fill(small_disk, leave=8192)
    with pytest.raises(DiskFull, match=f"to write {re.escape(str(small_disk))}/best.pt"):
        runs.save_checkpoint(small_disk / "best.pt", {"weight": torch.zeros(256, 1024)})
    assert [path.name for path in small_disk.iterdir()] == ["filler"]


# --- a rule's seed ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["entry:0.1,seed=4294967296", "per-class:2,seed=4294967295",
                                  "single:seed=99999999999999"])
def test_a_rule_seed_beyond_32_bits_is_one_line(tmp_path, monkeypatch, capsys, rule):
    cache_path = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5", train=40, val=16, test=20)
    code, err = run_main("linear", "--cache", str(cache_path), "--loss", "an", "--observe", rule, cwd=tmp_path,
                         monkeypatch=monkeypatch, capsys=capsys)
    seed = rule.rsplit("=", 1)[1]
    assert code == 1 and err.strip().splitlines() == [
        f"error: --observe {rule}: seed must be a whole number from 0 to 4294967294, got {seed}"]


def test_the_largest_seed_draws_train_and_val():
    """The boundary: 2**32 - 2 is numpy's largest seed a per-split rule can draw val with (seed + 1)."""
    (rule,) = observation.parse_rules("per-class:1,seed=4294967294")
    labels = np.eye(3, dtype=np.uint8)[[0, 1, 2, 0, 1, 2]]
    train, val = observation.draw_splits(rule, labels, labels, attrs={})
    expected = np.random.RandomState(2**32 - 1)  # val's draw, restated: the first class's positives shuffled
    rows = np.flatnonzero(labels[:, 0] == 1)
    expected.shuffle(rows)
    assert val[rows[0], 0] == 1 and np.count_nonzero(val[:, 0] == 1) == 1 and np.count_nonzero(train) > 0


# --- run directories' files ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name, data", [("results.json", [1, 2]), ("results.json", "done"),
                                        ("config.json", [{"stage": "linear"}])])
def test_a_run_file_that_is_not_an_object_is_one_line(tmp_path, name, data):
    run = make_run(tmp_path / "runs", "voc", "linear", {"an": [80.0]}, stamp="20240101-120000")
    (run / name).write_text(json.dumps(data))
    with pytest.raises(SpmlError) as refused:
        runs.load_results(run) if name == "results.json" else runs.open_for_resume(run, "linear")
    assert str(refused.value) == (f"{run / name} holds a JSON {type(data).__name__}, not the object spml-cache writes"
                                  " there (damaged, or written by hand): run that stage again")
    (found,) = collect.collect_runs([tmp_path / "runs"])  # report lists it as a run it cannot read
    assert found.results is None and found.problem == str(refused.value)


def test_linear_from_a_run_whose_results_are_a_list_is_one_line(tmp_path):
    cache_path = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5", train=40, val=16, test=20)
    first = run_linear(cache=cache_path, out=tmp_path / "runs", console=quiet(), losses="an", lrs=[1e-2],
                       batch_sizes=[8], epochs=1)
    (first.run_dir / "results.json").write_text("[]")
    done = run_cli("linear", "--cache", str(cache_path), "--loss", "an", "--from", str(first.run_dir), cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"error: {first.run_dir / 'results.json'} holds a JSON list, not the object spml-cache writes there"
        " (damaged, or written by hand): run that stage again"]


@pytest.mark.parametrize("content", [b"not an archive at all\n", b"PK\x03\x04 cut short", "npy"],
                         ids=["text", "torn zip", "npy array"])
def test_a_scores_file_that_is_not_an_npz_is_one_line(tmp_path, content):
    run = make_run(tmp_path / "runs", "voc", "linear", {"an": [80.0], "role": [82.0]}, stamp="20240101-120000")
    scores = run / "scores" / "role.npz"
    if content == "npy":
        with open(scores, "wb") as file:
            np.save(file, np.zeros((3, 3)))
    else:
        scores.write_bytes(content)
    with pytest.raises(SpmlError) as refused:
        plots.write_plots([tmp_path / "runs"], tmp_path / "figures")
    message = str(refused.value)
    assert message.startswith(f"{scores} is not the .npz file of a run (") and "\n" not in message
    assert message.endswith("): run that stage again, or remove the file")
    assert not (tmp_path / "figures").exists()


def test_report_plots_with_a_bad_scores_file_is_one_line_from_the_command_line(tmp_path):
    run = make_run(tmp_path / "runs", "voc", "linear", {"an": [80.0], "role": [82.0]}, stamp="20240101-120000")
    (run / "scores" / "an.npz").write_text("garbage")
    done = run_cli("report", "--plots", str(tmp_path / "figures"), cwd=tmp_path)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: {(run / 'scores' / 'an.npz').relative_to(tmp_path)} is not the .npz file of a run")
    assert "Traceback" not in done.stderr
