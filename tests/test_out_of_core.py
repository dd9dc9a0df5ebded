"""Stage two out of core: the memory plan, the seeded chunk order, streamed training and class-blocked scoring
against the in-memory run, and `--memory-budget` checked in one line."""

import json

import pytest
import torch
from cli_support import REPO, run_cli
from linear_support import quiet, reordering_step, write_synthetic_cache

from spml_cache.linear import out_of_core, run_linear
from spml_cache.linear.out_of_core import MemoryPlan, chunked_permutations
from spml_cache.linear.parts import KeptParts, StoredState
from spml_cache.runtime import memory
from spml_cache.runtime.errors import SpmlError

# |out of core - in memory| in test mAP points on this synthetic cache, for a chunk order instead of a full
# shuffle (docs/protocol.md, "Out of core", gives the measured figure on a VOC-shaped cache)
TOLERANCE = 3.0


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory):
    return write_synthetic_cache(tmp_path_factory.mktemp("cache") / "voc-resnet50-448.h5", train=160, val=40,
                                 test=60, classes=6, noise=0.7)


def test_the_chunk_order_is_seeded_deterministic_and_chunked():
    order = chunked_permutations(100, 16, seed=3, epochs=2)
    assert torch.equal(order, chunked_permutations(100, 16, seed=3, epochs=2))
    assert not torch.equal(order, chunked_permutations(100, 16, seed=4, epochs=2))
    assert not torch.equal(order[0], order[1])
    for epoch in order:
        assert sorted(epoch.tolist()) == list(range(100))
        chunks = (epoch // 16).tolist()
        runs = [chunks[0]] + [b for a, b in zip(chunks, chunks[1:]) if a != b]
        assert sorted(runs) == list(range(7))  # each chunk's rows together, each chunk once
        assert epoch[:16].tolist() != sorted(epoch[:16].tolist())  # shuffled within a chunk


def test_the_plan_streams_only_what_does_not_fit():
    shapes = {"train": (10_000, 256), "val": (1000, 256), "test": (1000, 256)}
    roomy = out_of_core.plan(2**30, shapes, 20, heads=4, label_bytes=0, baseline=0)
    assert not roomy.streams and roomy.class_block == 0
    tight = out_of_core.plan(12 * 2**20, shapes, 20, heads=4, label_bytes=0, baseline=2**20)
    assert not tight.train_in_memory and 1 <= tight.chunk_rows < 10_000 and 1 <= tight.class_block <= 20
    assert tight.short == 0 and "more than the budget" not in tight.describe()
    over = out_of_core.plan(2**20, shapes, 20, heads=4, label_bytes=0, baseline=2**20)
    assert over.short > 0 and "more than the budget" in over.describe()
    assert over.chunk_rows == out_of_core.MIN_CHUNK_ROWS  # never rows read one by one


def test_memory_budget_sizes_and_one_line_errors():
    assert memory.parse_size("1GB") == 2**30 and memory.parse_size("512MB") == 2**29
    assert memory.parse_size("1.5k") == 1536 and memory.parse_size(None) is None
    for bad in ("lots", "-1GB", "0", "1 parsec"):
        with pytest.raises(SpmlError, match="--memory-budget") as error:
            memory.parse_size(bad)
        assert "\n" not in str(error.value)
    assert memory.budget(None, torch.device("cpu")) > 0


def test_a_bad_memory_budget_on_the_command_line_is_one_line(tmp_path):
    done = run_cli("linear", "--cache", str(tmp_path / "x.h5"), "--loss", "an", "--memory-budget", "huge",
                   cwd=REPO)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--memory-budget 'huge'" in lines[0]


def run(cache_path, out, monkeypatch=None, forced=None, **options):
    if forced is not None:
        monkeypatch.setattr(out_of_core, "plan", lambda budget, *args: MemoryPlan(budget=budget, **dict(zip(
            ("train_in_memory", "eval_in_memory", "chunk_rows", "class_block"), forced))))
    grid = dict(losses=["an", "bce"], lrs=[1e-2, 1e-3], batch_sizes=[8, 16], epochs=6, workers=1)
    return run_linear(cache=cache_path, out=out, console=quiet(), **{**grid, **options}).results["losses"]


def test_class_blocked_scoring_of_streamed_val_and_test_equals_one_pass(tmp_path, small_cache, monkeypatch):
    """The same heads scored a block of classes at a time: their logits come from matrix products of other shapes,
    float32 rounding apart (linear_support.reordering_step); mAPs within 1e-9 points, far below the 4.1e-6 a
    reordering of two scores makes on the 160 train rows of 6 classes: the same rankings, best epochs, selection."""
    assert 1e-9 < reordering_step(160, 6)
    whole = run(small_cache, tmp_path / "whole")
    blocked = run(small_cache, tmp_path / "blocked", monkeypatch, (True, False, 0, 4))  # val/test read per block
    for name in ("an", "bce"):
        assert blocked[name]["selected"] == whole[name]["selected"]
        assert blocked[name]["best_epoch"] == whole[name]["best_epoch"]
        for key in ("val_map", "test_map", "train_map"):
            assert blocked[name][key] == pytest.approx(whole[name][key], abs=1e-9), (name, key)


def test_out_of_core_training_agrees_with_in_memory(tmp_path, small_cache, monkeypatch):
    whole = run(small_cache, tmp_path / "whole")
    streamed = run(small_cache, tmp_path / "streamed", monkeypatch, (False, False, 32, 4))
    for name in ("an", "bce"):
        assert abs(streamed[name]["test_map"] - whole[name]["test_map"]) <= TOLERANCE, name
        assert streamed[name]["train_map"] is None  # not measured when the train rows stream
    again = run(small_cache, tmp_path / "again", monkeypatch, (False, False, 32, 4))
    assert again["an"]["test_map"] == streamed["an"]["test_map"]  # the chunk order is seeded


def test_a_tiny_budget_streams_everything_end_to_end(tmp_path, small_cache):
    results = run(small_cache, tmp_path, memory_budget="1KB", losses="an", lrs=[1e-2], batch_sizes=[8], epochs=2)
    assert 0 < results["an"]["test_map"] <= 100


def test_losses_that_score_every_training_row_are_refused_out_of_core(tmp_path, small_cache):
    with pytest.raises(SpmlError, match="--memory-budget"):
        run(small_cache, tmp_path, memory_budget="1KB", losses="em_apl", lrs=[1e-2], batch_sizes=[8], epochs=1)


def test_a_resumed_out_of_core_run_keeps_its_chunk_order(tmp_path, small_cache, monkeypatch):
    from linear_support import interrupted_run

    grid = dict(losses=["an", "bce"], lrs=[1e-2, 1e-3], batch_sizes=[8, 16], epochs=3, workers=1)
    whole = run(small_cache, tmp_path / "whole", monkeypatch, (False, True, 32, 0), **grid)
    run_dir = interrupted_run(tmp_path / "cut", small_cache, monkeypatch, 1, **grid)
    monkeypatch.setattr(out_of_core, "plan", lambda budget, *args: MemoryPlan(budget=budget))  # all would fit now
    resumed = run_linear(resume=run_dir, console=quiet()).results["losses"]
    for name in ("an", "bce"):
        assert resumed[name]["test_map"] == whole[name]["test_map"]
        assert resumed[name]["val_map"] == whole[name]["val_map"]


def test_heads_beyond_the_budget_train_in_lr_groups_with_the_same_results(tmp_path, small_cache, monkeypatch):
    """When the grid's heads alone exceed the budget, they train a group of lrs of one batch size at a time, in
    turn: every head, its history and the selection are those of the run that holds them all at once.

    A stack of 2 lrs (or 1) against the stack of 3: other shapes, so heads float32 rounding apart
    (linear_support.reordering_step); mAPs within 1e-9 points, far below the 7.8e-5 a reordering of two scores
    makes on 60 test rows of 6 classes: the same rankings, the same best epochs and selection."""
    assert 1e-9 < reordering_step(60, 6)
    grid = dict(losses=["an", "role"], lrs=[1e-2, 1e-3, 1e-4], batch_sizes=[8, 16], epochs=3, console=quiet())
    whole = run_linear(cache=small_cache, out=tmp_path / "whole", **grid)
    planned = []

    def two_heads_fit(budget, shapes, num_classes, heads, label_bytes, baseline):
        planned.append(heads)
        return MemoryPlan(budget=budget, short=max(heads - 2, 0))  # the heads alone exceed it beyond two

    spill, spilled = KeptParts.spill, []

    def spill_seen(self, key, part):  # each lr group's best states go to disk as soon as it is trained
        spilled.append((key, sorted({r.lr for r in part.records})))
        part = spill(self, key, part)
        assert all(isinstance(r.best_state, StoredState) for r in part.records if r.best_state is not None)
        return part

    monkeypatch.setattr(out_of_core, "plan", two_heads_fit)
    monkeypatch.setattr(KeptParts, "spill", spill_seen)
    grouped = run_linear(cache=small_cache, out=tmp_path / "grouped", **grid)
    assert planned[0] == 6 and planned[-1] == 2  # the whole grid, then the largest group that fits: two lrs
    assert ("an", [1e-4]) in spilled and ("role", [1e-3, 1e-2]) in spilled
    for name in ("an", "role"):
        ours, theirs = (sorted((c["lr"], c["batch_size"], c["val_map"], c["test_map"], c["best_epoch"])
                               for c in r.results["losses"][name]["configs"]) for r in (grouped, whole))
        assert len(ours) == 6
        for a, b in zip(ours, theirs):
            assert a[:2] == b[:2] and a[4] == b[4] and a[2:4] == pytest.approx(b[2:4], abs=1e-9)
        assert grouped.results["losses"][name]["selected"] == whole.results["losses"][name]["selected"]


def test_three_identical_out_of_core_runs_give_identical_results(tmp_path, small_cache, monkeypatch):
    """The chunk plan is a function of the command (budget, shapes, grid): the process's resident memory, which
    differs by a few KB from run to run, changes nothing (it used to change the chunks by a row and the results
    by up to 1.8 mAP)."""
    # A budget just above the process's allowance: the train rows stream in chunks of a few dozen rows.
    process = out_of_core.PROCESS_BYTES["cpu"]
    budget = int((process + 30_000) / (1 - out_of_core.MARGIN))
    results, plans = [], []
    for index, resident in enumerate((process, process + 2_000, process + 9_000)):
        monkeypatch.setattr(memory, "resident", lambda: resident)
        run_ = run_linear(cache=small_cache, out=tmp_path / str(index), memory_budget=budget, console=quiet(),
                          losses=["an", "bce"], lrs=[1e-2, 1e-3], batch_sizes=[8, 16], epochs=4, workers=1)
        results.append({name: [(c["lr"], c["batch_size"], c["val_map"], c["test_map"]) for c in entry["configs"]]
                        for name, entry in run_.results["losses"].items()})
        config = json.loads((run_.run_dir / "config.json").read_text())
        plans.append((config["memory_budget"], config["chunk_rows"]))
    assert results[0] == results[1] == results[2]
    assert plans[0] == plans[1] == plans[2] and plans[0][0] == budget and 1 < plans[0][1] < 160, plans


def test_chunk_rows_trains_that_chunk_order_whatever_the_budget(tmp_path, small_cache, monkeypatch):
    """--chunk-rows N: the train rows stream in chunks of N rows even where they would fit (the same order on a
    machine with more memory), recorded in config.json, the results those of the plan that chose N itself."""
    asked = run(small_cache, tmp_path / "asked", chunk_rows=32)
    config = json.loads(next((tmp_path / "asked" / "voc").iterdir()).joinpath("config.json").read_text())
    assert config["chunk_rows"] == 32
    planned = run(small_cache, tmp_path / "planned", monkeypatch, (False, True, 32, 0))
    for name in ("an", "bce"):
        assert asked[name]["configs"] == planned[name]["configs"], name


@pytest.mark.parametrize("rows", ["0", "-3"])
def test_a_bad_chunk_rows_is_one_line(tmp_path, small_cache, monkeypatch, capsys, rows):
    from cli_support import run_main

    code, err = run_main("linear", "--cache", str(small_cache), "--loss", "an", "--chunk-rows", rows, cwd=tmp_path,
                         monkeypatch=monkeypatch, capsys=capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and f"--chunk-rows {rows}" in lines[0], err
    assert not (tmp_path / "runs").exists()


def test_chunk_rows_beyond_the_training_rows_is_one_chunk_of_them_all(tmp_path, small_cache, monkeypatch, capsys):
    """It allocated a buffer of the size given (`MemoryError: Unable to allocate 745. TiB`) and left an incomplete
    run. More rows than the training rows is one chunk of them all, whose order is the in-memory order
    (`chunked_permutations`): said in one note, recorded as given (a resume reads it back and plans the same one
    chunk), and the same results as in memory."""
    from cli_support import run_main

    code, err = run_main("linear", "--cache", str(small_cache), "--loss", "an,bce", "--lr", "1e-2,1e-3",
                         "--batch-size", "8,16", "--epochs", "6", "--workers", "1", "--chunk-rows", "99999999999999",
                         cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0, err
    assert "--chunk-rows 99,999,999,999,999 is more than the 160 training rows: one chunk of them all, in the order" \
           " an in-memory run takes" in " ".join(err.split()), err
    (run_dir,) = (tmp_path / "runs" / "voc").iterdir()
    assert json.loads((run_dir / "config.json").read_text())["chunk_rows"] == 99999999999999
    streamed = json.loads((run_dir / "results.json").read_text())["losses"]
    whole = run(small_cache, tmp_path / "whole")
    for name in ("an", "bce"):
        assert streamed[name]["configs"] == whole[name]["configs"], name
    for order in (chunked_permutations(160, 160, 3, 2), chunked_permutations(160, 10**12, 3, 2)):
        assert torch.equal(order, out_of_core.epoch_permutations(160, 3, 2))
