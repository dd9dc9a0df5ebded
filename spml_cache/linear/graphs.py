"""Stage two on a GPU: each stack's training step captured once as a CUDA graph and replayed, every stack of a
run advancing together, each on its own CUDA stream.

Eagerly, a step is 30-120 small kernels, each launched from Python: on an H100 the GPU waits on the launches
(1.2-5.4 ms a step at batch 8; replayed as a graph, 0.1-0.24 ms). So here a stack's step reads its batch's rows
from a static copy of the epoch's order at a cursor on the device (`order[cursor : cursor + B]`, the cursor
advanced inside the step), which lets one graph of `UNROLL` consecutive steps replay all through an epoch, and
one more graph each for the leftover full steps and the last, partial batch. What a step reads that changes
between steps or epochs is a device tensor updated in place (the loss contract, docs/internals.md "Graph-safe
steps"); the Python counters a step advances are kept by `HeadStack.step_counts`.

A graph is captured the second time its batch shape comes up (the first runs eagerly on the stack's stream:
the warm-up that lazy initialisations need) and again only when something it baked in changes: when a head stops
(the frozen columns). Per-epoch work (`start_epoch`, scoring, the divergence check, selection bookkeeping) runs
eagerly between epochs. The eager path (`SeedRun.run_epoch`) stays for the CPU and for `--no-graphs`; both give
the same selection and logits up to float tolerance (tests/test_cuda_graphs.py).

A stack's graphs share one memory pool of torch's caching allocator for the whole run. The allocator counts a
pool's live graphs (`use_count`: a capture into the pool adds one, a graph destroyed takes its one away) and asserts
that a capture into a pool it still holds finds one alive (`beginAllocateToPool`, CUDACachingAllocator.cpp: "it->
second->use_count > 0"); a pool whose graphs are all gone stays in its books, its memory cached, until
`empty_cache` frees it. So when a head stops, the stack's old graphs are kept until the first graph of the new
generation has been captured into the pool (`CapturedStack.retired`), then released: the pool always has a live
graph when a capture begins, and the new generation reuses the old one's memory. (A fresh pool per generation
would also satisfy the allocator, but each dead pool's memory would stay reserved until `empty_cache`, and the
allocator does not free cached blocks to make room while a capture is under way: a run whose heads stop in many
epochs could run out of memory mid-capture.)

A capture that fails stops the run with one line naming its cause. One that cannot begin (the allocator refusing
the stack's pool, or the stream) is this module's fault, not the step's: the line says so. One that fails in the
step (an op that syncs with the host, even inside an ATen kernel) names the loss, the line of code and
`--no-graphs`. Neither falls back to eager training: a capture that fails can leave torch's caching allocator
believing a capture is still under way (torch <= 2.11), after which every later capture fails and memory may be
handed out wrongly; and a silent fallback would hide a step several times slower.

The steps run under `devices.head_conditions`, as the eager loop's do: on the CPU (the tests' stand-in for CUDA
graphs) a replay gives the eager step's bits on any x86 CPU, whatever its vector instructions.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from spml_cache.linear.adam_kernel import fused_adam_available
from spml_cache.linear.engine import HeadStack, SeedRun
from spml_cache.runtime.devices import head_conditions
from spml_cache.runtime.errors import SpmlError, check_stop

UNROLL = 8  # full steps per graph: one launch where eight would each cost a Python round trip


class CudaGraphs:
    """What `CapturedStack` needs of CUDA: streams, and graphs captured on them. (A test hands it a stand-in
    that runs on the CPU and checks every replay against its capture, tests/test_linear_graphs.py.)"""

    @staticmethod
    def new_stream(device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device)

    @staticmethod
    def on(stream: torch.cuda.Stream):
        return torch.cuda.stream(stream)

    @staticmethod
    def wait_for_default(stream: torch.cuda.Stream) -> None:
        """`stream` waits for the work queued so far on the device's default stream."""
        stream.wait_stream(torch.cuda.default_stream(stream.device))

    @staticmethod
    def default_waits_for(stream: torch.cuda.Stream) -> None:
        torch.cuda.default_stream(stream.device).wait_stream(stream)

    @staticmethod
    def new_pool(device: torch.device):
        """A memory pool for the graphs of one stack (`capture`)."""
        with torch.cuda.device(device):
            return torch.cuda.graph_pool_handle()

    @staticmethod
    def new_graph() -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    @classmethod
    def capture(cls, stream: torch.cuda.Stream, steps: Callable[[], None], pool) -> torch.cuda.CUDAGraph:
        """The graph of `steps()`, captured on `stream` (capturing runs nothing), its temporaries in `pool`; a
        capture that cannot begin raises `CaptureNotBegun`, one that fails in `steps()` the step's error.

        Begun and ended here rather than by `torch.cuda.graph`, which first synchronises the whole device and
        empties the allocator's cache to make room for the graph: at every one of a run's hundreds of captures,
        a wait for every stream's queued replays, for memory a step's small temporaries do not need. `pool` is
        shared by the graphs of one stack only: they replay one after another on its stream, so one's
        temporaries may reuse another's; the graphs of different stacks replay at the same time on their own
        streams and must not (a pool for all stacks would let them overwrite each other's temporaries)."""
        graph = cls.new_graph()
        with cls.on(stream):
            try:
                graph.capture_begin(pool=pool)
            except RuntimeError as error:  # nothing of the step ran: the allocator (its pool) or the stream refused
                raise CaptureNotBegun(error_line(error)) from error
            try:
                steps()
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the capture is void already; the step's error is the news
                    graph.capture_end()
                raise
            graph.capture_end()
        return graph


class CaptureNotBegun(RuntimeError):
    """`capture_begin` refused: the caching allocator (the pool) or the stream, before any op of the step."""


class CapturedStack:
    """One stack's steps as CUDA graphs on its own stream, reading rows from the run's static `order`."""

    def __init__(self, stack: HeadStack, order: torch.Tensor, run: SeedRun, unroll: int = UNROLL,
                 backend=CudaGraphs) -> None:
        if not stack.heads.fused:
            raise RuntimeError("captured steps need torch's fused Adam kernel (it reads the step count on the device)")
        device = order.device
        self.stack, self.order, self.run, self.unroll, self.backend = stack, order, run, unroll, backend
        self.stream = backend.new_stream(device)
        self.pool = backend.new_pool(device)  # this stack's graphs' temporaries (CudaGraphs.capture)
        self.cursor = torch.zeros((), dtype=torch.long, device=device)  # where the next full batch starts
        self.offsets = torch.arange(stack.batch_size, device=device)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        # the previous generation's graphs, released once a graph of this one holds the pool (module docstring)
        self.retired: list[torch.cuda.CUDAGraph] = []
        self.warm: set[str] = set()  # batch shapes ("full", "partial") that have run once eagerly
        self.captured_for: torch.Tensor | None = None  # the `stopped` the graphs baked in
        self.captures = 0  # graphs captured so far (for tests and benchmarks)

    def _rows(self, kind: str) -> torch.Tensor:
        size = self.stack.batch_size
        if kind == "partial":  # the last N mod B rows: one fixed place in `order`
            return self.order[len(self.order) - len(self.order) % size :]
        rows = self.order.index_select(0, self.offsets + self.cursor)
        self.cursor += size
        return rows

    def _steps(self, kind: str, count: int) -> None:
        for _ in range(count):
            self.stack.train_step(self._rows(kind), self.run.data)

    def begin_epoch(self, epoch: int) -> None:
        """`start_epoch` on this stack's stream, after the default stream's work (the order, the scoring)."""
        self.backend.wait_for_default(self.stream)
        with self.backend.on(self.stream):
            self.cursor.zero_()
            self.stack.start_epoch(epoch, self.run.epochs, self.order, self.run.data)
        # The stack makes `stopped` (and `frozen`) anew exactly when a head has stopped (its columns are frozen now):
        # the graphs read the old ones. Otherwise they stay, and so do the graphs.
        if self.stack.stopped is not self.captured_for:
            self.retired += self.graphs.values()  # never replayed again, but the pool's last users until a capture
            self.graphs.clear()
            self.captured_for = self.stack.stopped

    def epoch_steps(self) -> Iterator[None]:
        """Queue this epoch's steps, a graph launch at a time (a generator: the caller interleaves stacks)."""
        size, rows = self.stack.batch_size, len(self.order)
        full = rows // size
        chunks = [("full", self.unroll)] * (full // self.unroll) + [("full", 1)] * (full % self.unroll)
        if rows % size and not self.stack.drop_last:
            chunks.append(("partial", 1))
        for kind, count in chunks:
            with self.backend.on(self.stream):
                self._launch(kind, count)
            yield

    def _launch(self, kind: str, count: int) -> None:
        graph = self.graphs.get((kind, count))
        if graph is None and kind in self.warm:
            graph = self._capture(kind, count)
        if graph is None:
            self._steps(kind, count)
            self.warm.add(kind)
            return
        graph.replay()
        self.stack.count_steps(count)

    def _capture(self, kind: str, count: int):
        """A graph of `count` steps of one shape; a step that cannot be captured stops the run (module docstring)."""

        def steps() -> None:  # leaves the Python step counters as it found them, as a replay does (it runs no Python)
            counts = self.stack.step_counts()
            try:
                self._steps(kind, count)
            finally:
                self.stack.set_step_counts(counts)

        loss, size = self.stack.records[0].loss, self.stack.batch_size
        try:
            graph = self.backend.capture(self.stream, steps, self.pool)
        except CaptureNotBegun as error:
            raise SpmlError(f"linear: a CUDA graph capture of the {loss} stack (batch {size}) could not begin"
                            f" ({error}): torch refused the graphs' memory pool or stream before any op of the step"
                            " ran, a fault of spml-cache's graph bookkeeping (linear/graphs.py), not of the loss;"
                            " rerun with --no-graphs, which launches each step eagerly (slower, the same results),"
                            " and report it") from error
        except RuntimeError as error:  # an op that syncs with the host: capturing runs nothing, nothing to undo
            raise SpmlError(f"linear: the {loss} step cannot be captured as a CUDA graph ({error_line(error)}"
                            f"{failing_line(error)}): rerun with --no-graphs, which launches each step eagerly"
                            " (slower, the same results)") from error
        self.graphs[(kind, count)] = graph
        self.retired.clear()  # the pool has a live graph of this generation now
        self.captures += 1
        return graph

    def end_epoch(self) -> None:
        with self.backend.on(self.stream):
            self.stack.end_epoch()
        self.backend.default_waits_for(self.stream)


class Lockstep:
    """Every stack of several runs (losses x seeds) trained together: an epoch of all of them, then their scoring."""

    def __init__(self, runs: list[SeedRun], unroll: int = UNROLL, backend=CudaGraphs) -> None:
        self.runs = runs
        self.orders = [torch.empty_like(run.permutations[0]) for run in runs]  # the epoch's order, at a fixed place
        self.stacks = [CapturedStack(stack, order, run, unroll, backend) for run, order in zip(runs, self.orders)
                       for stack in run.stacks]

    def train_epoch(self, epoch: int) -> None:
        """Train epoch `epoch` (1-indexed) of every stack; the caller then scores each run (`SeedRun.score`)."""
        with head_conditions(self.orders[0].device):  # the eager loop's (SeedRun._train): the same bits
            for run, order in zip(self.runs, self.orders):
                order.copy_(run.permutations[epoch - 1])
            for captured in self.stacks:
                captured.begin_epoch(epoch)
            # One graph launch of each stack in turn, so that every stream has work queued while Python launches more.
            feeds = [captured.epoch_steps() for captured in self.stacks if bool(captured.stack.active.any())]
            while feeds:
                check_stop()  # a safe point between graph launches (errors.stops_deferred)
                feeds = [feed for feed in feeds if next(feed, False) is None]
            for captured in self.stacks:
                captured.end_epoch()


def error_line(error: BaseException) -> str:
    """The first line of `error`'s message (at most 200 characters), or its type's name."""
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def failing_line(error: BaseException) -> str:
    """`" at linear/adam.py:181 <code>"`: the innermost line of this package outside this module that `error`
    passed through (the op that could not be captured), or "" (an error raised when the capture ended)."""
    package, here = Path(__file__).resolve().parents[1], Path(__file__).resolve()
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        path = Path(frame.filename).resolve()
        if package in path.parents and path != here:
            return f" at {path.relative_to(package).as_posix()}:{frame.lineno} {(frame.line or '').strip()}"
    return ""


def graphs_available(device: torch.device) -> bool:
    """CUDA graphs need a CUDA device and torch's fused Adam kernel there (it reads the step count on the
    device); a CUDA device without the kernel says so in one warning line."""
    if device.type != "cuda":
        return False
    if fused_adam_available(device):
        return True
    warnings.warn(f"linear: CUDA graphs are off: torch {torch.__version__}'s fused Adam kernel does not run on {device};"
                  " every stack trains eagerly, one after another (slower, the same results)", stacklevel=2)
    return False
