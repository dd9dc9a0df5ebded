"""On a GPU, stage two's captured-graph path (linear/graphs.py) trains what the eager path trains: the same
histories up to float rounding, the same selection, for every loss, and `run_linear` with and without graphs
selects the same configs. Marked `cuda`: skipped where no CUDA GPU is visible."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from linear_support import quiet, write_synthetic_cache

from spml_cache import cache, losses
from spml_cache.linear import run_linear
from spml_cache.linear.engine import LinearData, SeedRun
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
    return LinearData.from_features(cache.load(tiny_cache), torch.device("cuda"))


def seed_runs(names, data, fidelity="exact"):
    return [SeedRun(name, dict(PHASES.get(name, {})), seed, [1e-2, 1e-3], [8, 16], EPOCHS, data, fidelity=fidelity)
            for name in names for seed in (0, 1)]


def train_eagerly(runs):
    for run in runs:
        for epoch in range(1, EPOCHS + 1):
            run.run_epoch(epoch)


def train_in_lockstep(runs):
    together = Lockstep(runs)
    for epoch in range(1, EPOCHS + 1):
        together.train_epoch(epoch)
        for run in runs:
            run.score(epoch)
    fell_back = sorted({captured.stack.records[0].loss for captured in together.stacks if captured.eager})
    assert not fell_back, f"these losses' steps could not be captured: {fell_back}"
    assert all(captured.captures for captured in together.stacks)


@pytest.mark.parametrize("fidelity", ["exact", "authors"])
def test_captured_graphs_train_every_loss_as_the_eager_path_does(data, fidelity):
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
