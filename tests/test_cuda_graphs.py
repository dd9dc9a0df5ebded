"""On a GPU, stage two's captured-graph path (linear/graphs.py) trains what the eager path trains: the same
histories up to float rounding, the same selection, for every loss, and `run_linear` with and without graphs
selects the same configs. Every step after the first of its shape runs under
`torch.cuda.set_sync_debug_mode("error")` (a step that syncs raises, eager or captured), every stack's step is
captured (one that cannot be stops the run), and a graph is captured again only after a head of its stack
stopped. Marked `cuda`: skipped where no CUDA GPU is visible."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from linear_support import quiet, write_synthetic_cache

from spml_cache import cache, losses
from spml_cache.linear import run_linear
from spml_cache.linear.engine import HeadStack, LinearData, SeedGrid, SeedRun
from spml_cache.linear.graphs import Lockstep
from spml_cache.selection import select_config

pytestmark = pytest.mark.cuda
EPOCHS = 4
PHASES = {"em_apl": {"warmup": 1}, "opml_sp": {"warmup": 1}}  # every phase within EPOCHS


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    # 301 training rows: batches of 8 and 16 both leave a partial batch
    return write_synthetic_cache(tmp_path_factory.mktemp("graphs") / "voc.h5", train=301, val=60, test=90, dim=64,
                                 classes=8)


@pytest.fixture(scope="module")
def data(tiny_cache):
    data = LinearData.from_features(cache.load(tiny_cache), torch.device("cuda"))
    # a hand-added text side, so that the losses that read one (vlpl, gpr) train here too
    similarity = torch.rand(data.num_train, data.num_classes, generator=torch.Generator().manual_seed(3)) * 0.3
    return dataclasses.replace(data, train_similarity=similarity.to(data.train_features.device))


def seed_runs(names, data, fidelity="exact"):
    """Every loss's heads at lrs 1e-2 and 1e-3, and one at an infinite lr: NaN from its first step, so every stack
    stops a head after epoch 1 and captures anew in epoch 2, into the pool its first graphs held (which torch's
    allocator allows only while one of them is alive: graphs.py), in both fidelities."""
    return [SeedRun(name, dict(PHASES.get(name, {})), seed, SeedGrid([1e-2, 1e-3, math.inf], [8, 16], EPOCHS), data,
                    fidelity=fidelity)
            for name in names for seed in (0, 1)]


@pytest.fixture
def steps_never_sync(monkeypatch):
    """Every `HeadStack.train_step` after the first of its batch shape (the warm-up, which may make buffers from
    host data) runs under sync debug mode "error": an op that waits for the GPU raises there, in an eager step as
    in one being captured (a replay runs no Python: its steps were checked when it was captured)."""
    original, warm = HeadStack.train_step, set()

    def train_step(stack, rows, data):
        if (stack, len(rows)) not in warm:
            warm.add((stack, len(rows)))
            return original(stack, rows, data)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(stack, rows, data)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(HeadStack, "train_step", train_step)


def train_eagerly(runs):
    for run in runs:
        for epoch in range(1, EPOCHS + 1):
            run.run_epoch(epoch)


def train_in_lockstep(runs):
    """Every stack captured (a step that cannot be stops the run with an SpmlError naming it), and no graph captured
    again unless a head of its stack stopped at the end of the epoch before: an epoch's captures are then only
    the shapes the stack had no graph of (the partial batch's first comes in epoch 2)."""
    together = Lockstep(runs)
    stopped_before = [captured.stack.stopped_heads for captured in together.stacks]
    for epoch in range(1, EPOCHS + 1):
        start = [(captured.captures, set(captured.graphs), captured.stack.stopped_heads) for captured in together.stacks]
        together.train_epoch(epoch)
        for run in runs:
            run.score(epoch)
        for i, (captured, (count, shapes, stopped)) in enumerate(zip(together.stacks, start)):
            if stopped == stopped_before[i]:  # no head of this stack stopped since the last epoch began
                new_shapes = set(captured.graphs) - shapes
                assert captured.captures - count == len(new_shapes), (
                    f"{captured.stack.records[0].loss} batch {captured.stack.batch_size}: epoch {epoch} captured"
                    f" {captured.captures - count} graphs, {len(new_shapes)} of them new shapes")
            stopped_before[i] = stopped
    assert all(captured.captures for captured in together.stacks)


@pytest.mark.parametrize("fidelity", ["exact", "authors"])
def test_captured_graphs_train_every_loss_as_the_eager_path_does(data, fidelity, steps_never_sync):
    names = losses.names()
    eager, graphed = seed_runs(names, data, fidelity), seed_runs(names, data, fidelity)
    train_eagerly(eager)
    train_in_lockstep(graphed)  # every loss and seed at once, each stack on its own stream
    for mine, theirs in zip(graphed, eager):
        for a, b in zip(mine.records, theirs.records):
            where = f"{a.loss} lr {a.lr} batch {a.batch_size} seed {a.seed}"
            assert (a.diverged_epoch, a.stopped_epoch) == (b.diverged_epoch, b.stopped_epoch), where
            np.testing.assert_allclose(a.val_map, b.val_map, atol=1e-3, err_msg=where)
            np.testing.assert_allclose(a.train_loss, b.train_loss, rtol=1e-4, atol=1e-6, err_msg=where)
            if b.best_state is not None:
                for key in ("weight", "bias"):
                    torch.testing.assert_close(a.best_state["head"][key], b.best_state["head"][key], rtol=1e-4,
                                               atol=1e-5, msg=where)
        chosen, expected = select_config(mine.records), select_config(theirs.records)
        assert (chosen is None) == (expected is None)
        if expected is not None:
            assert (chosen.lr, chosen.batch_size) == (expected.lr, expected.batch_size), mine.records[0].loss


def test_linear_with_and_without_graphs_selects_the_same(tiny_cache, tmp_path):
    grid = dict(losses=["an", "role", "ll_r", "em_apl"], lrs=[1e-2, 1e-3], batch_sizes=[8, 16], epochs=EPOCHS, seeds=2)
    graphed = run_linear(cache=tiny_cache, device="cuda", out=tmp_path / "graphs", console=quiet(), **grid)
    eager = run_linear(cache=tiny_cache, device="cuda", graphs=False, out=tmp_path / "eager", console=quiet(), **grid)
    for name in grid["losses"]:
        mine, theirs = graphed.results["losses"][name], eager.results["losses"][name]
        assert mine["selected"] == theirs["selected"], name
        assert mine["test_map"] == pytest.approx(theirs["test_map"], abs=0.05), name


def test_capturing_neither_synchronises_the_device_nor_empties_its_cache(data, monkeypatch):
    """Hundreds of captures in a run (graphs.py `CudaGraphs.capture`): none may wait for every stream's queued
    replays, as `torch.cuda.graph` does before each."""
    calls = []
    for name in ("synchronize", "empty_cache"):
        original = getattr(torch.cuda, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch.cuda, name, counted)
    runs = seed_runs(["an", "role"], data)
    together = Lockstep(runs)
    for epoch in (1, 2):
        together.train_epoch(epoch)
        for run in runs:
            run.score(epoch)
    assert sum(captured.captures for captured in together.stacks) >= 2 * len(together.stacks)
    assert calls == []
