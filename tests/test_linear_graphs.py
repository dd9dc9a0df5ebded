"""The captured-graph engine (linear/graphs.py), run on the CPU with a stand-in for CUDA graphs that checks what
CUDA would: every replay against its capture (the op trace a CUDA graph would bake in, trace_support.py, must be the
same at each replay), and the life of the graphs' memory pools as torch's caching allocator keeps it. Training in
lockstep must give exactly what the eager engine gives, for every loss, in both fidelities, with heads stopping.

On a GPU, tests/test_cuda_graphs.py runs the real graphs against the eager path.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from contextlib import ExitStack, nullcontext

import numpy as np
import pytest
import torch
from linear_support import write_synthetic_cache
from torch.utils._python_dispatch import TorchDispatchMode
from trace_support import first_difference, record

from spml_cache import cache, losses
from spml_cache.linear.adam_kernel import fused_adam_available
from spml_cache.linear.engine import LinearData, SeedGrid, SeedRun
from spml_cache.linear.graphs import CudaGraphs, Lockstep
from spml_cache.runtime.devices import to_host
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.step_trace import HostReads, KernelHostReads, StepRecorder

pytestmark = pytest.mark.skipif(not fused_adam_available(torch.device("cpu")),
                                reason="captured steps need torch's fused Adam kernel, here on the CPU")

EPOCHS = 4
# Every phase of every loss within EPOCHS: pseudo-labelling and corrections from epoch 2, schedules moving.
PHASES = {"em_apl": {"warmup": 1}, "opml_sp": {"warmup": 1}}
ALLOCATOR_REFUSAL = 'it->second->use_count > 0 INTERNAL ASSERT FAILED at "CUDACachingAllocator.cpp" (the stand-in)'


class CheckedPool:
    """A graph memory pool as torch's caching allocator keeps it (CUDACachingAllocator.cpp): `beginAllocateToPool`
    makes a pool for an id it does not hold, and for one it holds asserts `use_count > 0` (a capture into it adds
    one); a graph destroyed takes its one away (`releasePool`), and a pool at 0 stays in the allocator's books
    until `empty_cache` frees its memory. Here the count is the captured graphs still alive (a weak set: a graph
    the code drops is released at once under CPython's reference counting), and capturing into a pool that had
    graphs and has none alive raises, as the allocator's assertion does. (The allocator forgets such a pool
    after an `empty_cache`, and would then make it anew; the stand-in never forgets: stricter.)"""

    def __init__(self) -> None:
        self.live: weakref.WeakSet = weakref.WeakSet()
        self.ever = 0  # graphs ever captured into it

    def capture_into(self, graph) -> None:
        if self.ever and not self.live:
            raise RuntimeError(ALLOCATOR_REFUSAL)
        self.live.add(graph)
        self.ever += 1


class CheckedGraph:
    """A CUDA graph on the CPU. Capturing runs the steps (so its first replay is skipped) and records their op
    trace; every later replay runs them again and must record the same trace."""

    def __init__(self) -> None:
        self.steps, self.pool, self.ops, self.ran_at_capture = None, None, None, True
        self.recording: ExitStack | None = None
        self.recorder: StepRecorder | None = None

    def capture_begin(self, pool) -> None:
        pool.capture_into(self)
        self.pool = pool
        self.recorder, self.recording = StepRecorder(), ExitStack()  # trace_support.record's recorders, entered
        for mode in (KernelHostReads(self.recorder), HostReads(self.recorder.forbidden), self.recorder):
            self.recording.enter_context(mode)

    def capture_end(self) -> None:
        self.recording.close()
        assert not self.recorder.forbidden, "a captured step may not sync or copy from the host:\n" + "\n".join(
            self.recorder.forbidden)
        self.ops = self.recorder.trace
        ReplayChecked.captured += 1

    def replay(self) -> None:
        if self.ran_at_capture:
            self.ran_at_capture = False
            return
        ops = record(self.steps)[1].trace
        assert ops == self.ops, "a replay would not do what its capture did: " + first_difference(
            self.ops, ops, ("captured", "replayed"))
        ReplayChecked.replayed += 1


class ReplayChecked(CudaGraphs):
    """`graphs.CudaGraphs` on the CPU: its own `capture` (begin, the steps, end; the errors of each) with
    `CheckedGraph`s and `CheckedPool`s."""

    captured = 0
    replayed = 0
    graph = CheckedGraph

    @staticmethod
    def new_stream(device):
        return None

    @staticmethod
    def on(stream):
        return nullcontext()

    @staticmethod
    def wait_for_default(stream):
        pass

    @staticmethod
    def default_waits_for(stream):
        pass

    @staticmethod
    def new_pool(device):
        return CheckedPool()

    @classmethod
    def new_graph(cls):
        return cls.graph()

    @classmethod
    def capture(cls, stream, steps, pool):
        graph = super().capture(stream, steps, pool)
        graph.steps = steps  # what its replays run again
        return graph


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    # 45 training rows: batches of 4 leave a partial one of 1, batches of 8 one of 5
    path = write_synthetic_cache(tmp_path_factory.mktemp("graphs") / "voc.h5", train=45, val=20, test=24)
    data = LinearData.from_features(cache.load(path), torch.device("cpu"))
    # a hand-added text side, so that the losses that read one (vlpl, gpr) train here too
    similarity = torch.rand(data.num_train, data.num_classes, generator=torch.Generator().manual_seed(3)) * 0.3
    return dataclasses.replace(data, train_similarity=similarity.to(data.train_features.device))


def seed_run(name, data, fidelity="exact", lrs=(3e-1, 1e-2)):
    hparams = {**PHASES.get(name, {})}
    return SeedRun(name, hparams, 0, SeedGrid(list(lrs), [4, 8], EPOCHS), data, fidelity=fidelity)


def histories(run):
    return [(r.lr, r.batch_size, r.train_loss, r.val_map, r.test_map, r.diverged_epoch, r.stopped_epoch, r.best_epoch)
            for r in run.records]


def test_the_stand_in_refuses_a_capture_into_a_pool_whose_graphs_were_all_released():
    """What the allocator asserts (`CheckedPool`): a pool with a live graph takes another capture; one whose graphs
    are all gone does not; a fresh pool always does."""
    pool, steps = CheckedPool(), lambda: torch.ones(2).add_(1)
    first = ReplayChecked.capture(None, steps, pool)
    second = ReplayChecked.capture(None, steps, pool)  # the first is alive
    del first, second
    with pytest.raises(RuntimeError, match="use_count > 0"):
        ReplayChecked.capture(None, steps, pool)
    assert ReplayChecked.capture(None, steps, CheckedPool()).pool is not pool


# A head at an infinite lr: NaN from its first step in every loss and fidelity, so every stack stops a head at the
# end of epoch 1 and captures its graphs anew in epoch 2 (a finite absurd lr would leave the authors' eps-guarded
# logs finite). At lr 1, the authors' rules stop heads before the last epoch: `no_gain` (em, em_apl) and `drop` (the
# large-loss family, gr, gpr) on these 45 rows.
STOPPING_LRS = (1.0, 1e-2, math.inf)


@pytest.mark.parametrize("fidelity", ["exact", "authors"])
@pytest.mark.parametrize("name", losses.names())
def test_lockstep_replays_train_every_loss_as_the_eager_engine_does(name, fidelity, data):
    """Every loss in both fidelities, with heads stopping (diverged, and stopped early by the authors' rules): each
    stop makes its stack capture again, into the pool its earlier graphs shared, which the allocator allows only
    while one of them is alive (`CheckedPool`); and the replays give the eager engine's results bit for bit (the
    same rows in the same order, the same ops, in the same conditions: devices.head_conditions)."""
    eager = seed_run(name, data, fidelity, STOPPING_LRS)
    expected = [eager.run_epoch(epoch) for epoch in range(1, EPOCHS + 1)]
    graphed = seed_run(name, data, fidelity, STOPPING_LRS)
    together = Lockstep([graphed], unroll=2, backend=ReplayChecked)
    got = []
    for epoch in range(1, EPOCHS + 1):
        together.train_epoch(epoch)
        got.append(graphed.score(epoch))
    assert got == expected
    assert histories(graphed) == histories(eager)
    # the stops this test is for happened, and the graphs after them were captured and replayed
    for stack in graphed.stacks:
        assert [r.diverged_epoch for r in stack.records] == [None, None, 1]
    rule = losses.get(name).authors_early_stop if fidelity == "authors" else None
    early = {r.stopped_epoch for r in graphed.records} - {None, EPOCHS}
    assert bool(early) == bool(rule), early
    assert all(captured.captures > (2 if captured.stack.drop_last else 3) for captured in together.stacks)


@pytest.mark.parametrize("name", ["an", "role"])
def test_lockstep_replays_weight_decay_heads_as_the_eager_engine_does(name, data):
    """`--wd`: the decay's term is part of the captured step, and replays bit for bit."""
    def run():
        return SeedRun(name, {}, 0, SeedGrid([3e-1, 1e-2], [4, 8], EPOCHS, [0.0, 0.5]), data)

    eager = run()
    expected = [eager.run_epoch(epoch) for epoch in range(1, EPOCHS + 1)]
    graphed = run()
    together = Lockstep([graphed], unroll=2, backend=ReplayChecked)
    got = []
    for epoch in range(1, EPOCHS + 1):
        together.train_epoch(epoch)
        got.append(graphed.score(epoch))
    assert got == expected and {line["wd"] for lines in got for line in lines} == {0.0, 0.5}
    assert histories(graphed) == histories(eager)


def test_lockstep_captures_each_shape_once_and_recaptures_when_a_head_stops(data):
    """Early stopping (--fidelity authors) freezes a head's columns: the graphs that baked them in are captured
    anew, and nothing else is."""
    ReplayChecked.captured = ReplayChecked.replayed = 0
    runs = [seed_run("an", data), seed_run("em_apl", data, fidelity="authors"), seed_run("role", data)]
    together = Lockstep(runs, unroll=2, backend=ReplayChecked)
    for epoch in range(1, EPOCHS + 1):
        together.train_epoch(epoch)
        for run in runs:
            run.score(epoch)
    # per stack: (full, 2 steps) and (full, 1 step) graphs, and a partial-batch one from epoch 2 (not for em_apl
    # under the authors' rules, whose loaders drop it); after each epoch in which a head stopped, its stack's again
    stacks = [stack for run in runs for stack in run.stacks]
    shapes = {stack: 2 if stack.drop_last else 3 for stack in stacks}
    stops = {stack: {r.stopped_epoch or r.diverged_epoch for r in stack.records} - {None, EPOCHS} for stack in stacks}
    assert any(stops.values()) and all(stack.records[0].loss == "em_apl" for stack in stacks if stops[stack])
    assert ReplayChecked.captured == sum(shapes[stack] * (1 + len(stops[stack])) for stack in stacks)
    assert [captured.captures for captured in together.stacks] == [shapes[s] * (1 + len(stops[s])) for s in stacks]
    assert ReplayChecked.replayed >= 2 * ReplayChecked.captured  # replayed far more often than captured
    # a stack's graphs replay one after another on its stream and share its pool; stacks, concurrent, do not
    assert all({graph.pool for graph in captured.graphs.values()} == {captured.pool} for captured in together.stacks)
    assert len({captured.pool for captured in together.stacks}) == len(together.stacks)


def test_graphs_are_captured_anew_once_after_a_head_stops_and_not_in_later_epochs(data):
    """The head at lr 1e38 diverges in epoch 1: its columns are frozen from epoch 2, so each stack captures its
    graphs again in epoch 2, and then never again (the stopped heads have not changed)."""
    epochs = 5
    run = SeedRun("an", {}, 0, SeedGrid([1e-2, 1e38], [4, 8], epochs), data)
    together = Lockstep([run], unroll=2, backend=ReplayChecked)
    per_epoch = []
    for epoch in range(1, epochs + 1):
        before = sum(captured.captures for captured in together.stacks)
        together.train_epoch(epoch)
        run.score(epoch)
        per_epoch.append(sum(captured.captures for captured in together.stacks) - before)
    assert [(r.lr, r.diverged_epoch) for r in run.records] == [(1e-2, None), (1e38, 1)] * 2
    assert run.records[0].best_epoch is not None  # the other head trained on
    # per stack (45 rows, batches of 4 and 8, 2 steps a graph): in epoch 1 the (full, 2 steps) and (full, 1 step)
    # graphs, the partial batch running eagerly once; in epoch 2 all three again; none after
    assert per_epoch == [2 * 2, 2 * 3, 0, 0, 0]


def test_scoring_an_epoch_reads_the_device_once_and_keeps_best_heads_there_until_the_end(data):
    """Between epochs every stack's APs, diverged heads and mean losses come to the host in one copy (one wait for
    the GPU per run and epoch, devices.to_host), and a new best head is copied on the device, not to the host."""
    run = SeedRun("an", {}, 0, SeedGrid([3e-1, 1e-2], [4, 8], 2), data)
    run._train(1)
    lines, recorder = record(lambda: run.score(1))
    reads = [read.split(" at ")[0] for read in recorder.forbidden]
    assert [read for read in reads if read != "Tensor.numpy"] == ["Tensor.cpu"]  # .numpy(): of CPU tensors only
    assert len(lines) == 4 and all(r.best_epoch == 1 and r.best_state is not None for r in run.records)
    assert {r.best_state["head"]["weight"].device for r in run.records} == {data.train_features.device}
    assert all(r.best_state["head"]["weight"].device.type == "cpu" for r in run.host_records())


def test_to_host_gives_every_value_dtype_and_shape_back():
    tensors = [torch.tensor([[0.1, float("nan")]], dtype=torch.float64), torch.tensor([1.5e-7, 3.0]),
               torch.tensor([True, False]), torch.tensor([7, -2])]
    for given in (tensors, tensors[1:]):  # through float64, and through float32 when nothing is wider
        for tensor, array in zip(given, to_host(given)):
            assert array.dtype == tensor.numpy().dtype and np.array_equal(array, tensor.numpy(), equal_nan=True)


class RefusingGraph(CheckedGraph):
    """A capture that fails as CUDA's does at an op that syncs: while the stream captures, the op raises."""

    def capture_begin(self, pool) -> None:
        pool.capture_into(self)
        self.recording = ExitStack()
        self.recording.enter_context(RaisesAt("aten.mm.out"))  # the logits' product (into their buffer)

    def capture_end(self) -> None:
        self.recording.close()


class RefusesCapture(ReplayChecked):
    graph = RefusingGraph


class RaisesAt(TorchDispatchMode):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.op):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")
        return func(*args, **(kwargs or {}))


def test_a_step_that_cannot_be_captured_stops_the_run_naming_the_loss_the_line_and_the_way_out(data):
    """No silent fallback to eager training (graphs.py says why): one line with the loss, the reason, where in the
    package the capture failed, and --no-graphs."""
    graphed = seed_run("an", data)
    together = Lockstep([graphed], unroll=2, backend=RefusesCapture)
    with pytest.raises(SpmlError) as stopped:
        together.train_epoch(1)  # the second full batch of the epoch is captured
    message = str(stopped.value)
    assert "\n" not in message
    assert message.startswith("linear: the an step cannot be captured as a CUDA graph (CUDA error: operation not"
                              " permitted when stream is capturing at linear/head_matrix.py:")
    assert "torch.mm(features, self.params[0], out=flat)" in message
    assert message.endswith("rerun with --no-graphs, which launches each step eagerly (slower, the same results)")


class RefusedPool(CheckedPool):
    def capture_into(self, graph) -> None:
        raise RuntimeError(ALLOCATOR_REFUSAL + "\nmore detail")


class RefusesPool(ReplayChecked):
    @staticmethod
    def new_pool(device):
        return RefusedPool()


def test_a_capture_the_allocator_refuses_stops_the_run_blaming_the_pool_not_the_step(data):
    """A capture that cannot begin (torch's allocator refusing the pool, as it did on the first GPU run when a
    stack's graphs were all released) ran no op of the step: the line says so, instead of blaming the loss."""
    together = Lockstep([seed_run("em", data, "authors")], unroll=2, backend=RefusesPool)
    with pytest.raises(SpmlError) as stopped:
        together.train_epoch(1)
    message = str(stopped.value)
    assert "\n" not in message and "step cannot be captured" not in message
    assert message.startswith(f"linear: a CUDA graph capture of the em stack (batch 4) could not begin"
                              f" ({ALLOCATOR_REFUSAL}): torch refused the graphs' memory pool or stream before any op"
                              " of the step ran, a fault of spml-cache's graph bookkeeping (linear/graphs.py), not of"
                              " the loss; rerun with --no-graphs")


def test_run_linear_in_lockstep_writes_what_the_eager_run_writes(tmp_path, monkeypatch):
    """`run_linear`'s GPU route (jobs.py `_in_lockstep`: every job at once, progress per epoch, parts kept) on the
    CPU, with the replay-checking stand-in for CUDA graphs."""
    import functools

    from linear_support import quiet

    from spml_cache.linear import jobs, run_linear

    path = write_synthetic_cache(tmp_path / "voc.h5", train=45, val=20, test=24)
    from spml_cache.observation import parse_rules

    grid = dict(losses=["an", "role", "em_apl"], lrs=[1e-2, 1e-3], batch_sizes=[4, 8], epochs=3, seeds=2,
                hparams={"em_apl.warmup": 1}, console=quiet(), observe=parse_rules("single,entry:0.5"))
    eager = run_linear(cache=path, out=tmp_path / "eager", **grid)
    monkeypatch.setattr(jobs, "graphs_available", lambda device: True)
    monkeypatch.setattr(jobs, "Lockstep", functools.partial(Lockstep, backend=ReplayChecked))
    together = run_linear(cache=path, out=tmp_path / "lockstep", **grid)

    def without_seconds(results):
        return {name: {key: value for key, value in entry.items() if key != "seconds"}
                for name, entry in results["losses"].items()}

    assert without_seconds(together.results) == without_seconds(eager.results)
    assert not (together.run_dir / "jobs").exists()  # every part was kept, then the run finished
    lines = sorted((together.run_dir / "metrics.jsonl").read_text().splitlines())
    assert lines == sorted((eager.run_dir / "metrics.jsonl").read_text().splitlines())
