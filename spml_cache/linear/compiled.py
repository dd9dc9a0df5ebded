"""`linear --compile`: a stack's training step compiled by torch.compile, where the run takes enough steps to pay
the compile back.

What is compiled is the step's arithmetic between the gathered batch and Adam (`HeadStack.gradients`): the
logits, the loss's value and gradient in closed form, the heads' gradient and the epoch's loss sum, which
inductor fuses into a few loops. The batch's gathers, the fused Adam update (torch's own kernel, whatever the
path: inside a compiled graph torch 2.14's functionalisation refuses `_fused_adam_` on the heads' buffers) and the
Python counters stay eager; so does the last, partial batch of an epoch (another shape: another
compile, for one step an epoch) and the step of a loss without a closed form (autograd cannot run inside a
compiled graph without breaking it). A compiled step rounds differently from the eager one (fused loops, other
vector math): the same heads up to float rounding, a placement like `--workers` (docs/benchmarks.md, "--compile").

A compile costs seconds (inductor generates and builds C++ on the CPU) and saves little per step, most for the
losses with many elementwise terms (measured: docs/benchmarks.md, "`linear --compile`"): a stack is compiled only
when it takes at least `MIN_STEPS` full steps in the run.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import time
from dataclasses import dataclass

import torch

from spml_cache.runtime.errors import SpmlError, stops_at_once, unknown_name

# Full steps a stack takes in the run (epochs x full batches per epoch) below which its step is left eager: what
# pays a process's first compile back in the best case measured (docs/benchmarks.md, "`linear --compile`"), so
# that the papers' VOC grid stays eager and COCO's is compiled.
MIN_STEPS = 100_000
# torch.compile's backend: inductor, unless this names another, e.g. aot_eager (to check a compiled run's plumbing
# and results without generating code, as the tests do: worker processes inherit it); such a backend compiles in
# a fraction of a second and every closed-form stack is compiled, whatever its step count
BACKEND_VARIABLE = "SPML_COMPILE_BACKEND"


def backend_name() -> str:
    """`BACKEND_VARIABLE`'s backend, checked to be one torch.compile knows (in one line naming the variable, at
    the run's plan: a worker meeting it would fail the run's first loss, as if the loss were at fault), or
    inductor."""
    name = os.environ.get(BACKEND_VARIABLE) or "inductor"
    if name != "inductor":
        _check_backend(name)
    return name


@functools.cache
def _check_backend(name: str) -> None:
    known = torch._dynamo.list_backends(exclude_tags=())  # the debugging ones too: aot_eager, eager
    if name not in known:
        raise SpmlError(f"{BACKEND_VARIABLE}={name}: {unknown_name('torch.compile backend', name, known)}; unset it"
                        " for inductor, the default, or name one of torch._dynamo.list_backends(exclude_tags=())"
                        " (aot_eager checks a compiled run without generating code)")


def full_steps(epochs: int, rows: int, batch_size: int) -> int:
    """The full steps a stack of `batch_size` takes over `rows` training rows in `epochs` (what `pays` judges)."""
    return epochs * (rows // batch_size)


def pays(steps: int) -> bool:
    """Whether a stack taking `steps` full steps in the run pays its compile back (`MIN_STEPS`, inductor's)."""
    return steps >= MIN_STEPS or backend_name() != "inductor"


@dataclass
class CompileTime:
    """The seconds the compiles of one loss's steps took in one job, and how many graphs they made."""

    loss: str
    seconds: float = 0.0
    graphs: int = 0

    def line(self) -> str:
        graphs = f" ({self.graphs} graphs)" if self.graphs > 1 else ""
        return f"compiled the {self.loss} step in {self.seconds:.1f} s{graphs}"


class CompiledStep:
    """`stack.gradients` compiled (torch.compile, static shapes): a call that compiles (the first, or one whose
    guards fail) adds its wall time to `time`."""

    def __init__(self, stack, time: CompileTime) -> None:
        _allow_a_graph_per_stack()
        self.time, self.graphs = time, 0
        self.function = torch.compile(stack.gradients, backend=self._backend, dynamic=False)
        self.chosen = torch._dynamo.lookup_backend(backend_name())

    def _backend(self, graph, example_inputs):
        self.graphs += 1
        return self.chosen(graph, example_inputs)

    def __call__(self, batch, rows: torch.Tensor) -> tuple:
        graphs, start = self.graphs, time.perf_counter()
        # A compile takes seconds with no safe point inside: a stop (Ctrl-C, SIGTERM) interrupts it where it is, as
        # it would any step; the job it is in is dropped and trained again by --resume.
        with stops_at_once():
            params = self.function(batch, rows)
        if self.graphs != graphs:
            self.time.seconds += time.perf_counter() - start
            self.time.graphs += self.graphs - graphs
        return params


def _allow_a_graph_per_stack() -> None:
    """Dynamo keeps the graphs of one Python function together, at most `recompile_limit` (8) of them, then runs it
    eagerly: every stack's step is `HeadStack.gradients`, one graph per (loss, batch size), so `--loss all` needs
    ~60. Inductor builds in this process (`compile_threads` 1): no pool of compile workers to outlive it."""
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), 256))
    config.accumulated_recompile_limit = max(getattr(config, "accumulated_recompile_limit", 0), 1024)
    # imported here: inductor's import costs a second, paid with --compile alone
    importlib.import_module("torch._inductor.config").compile_threads = 1
    # Inductor's C++ build imports torch's extension helper, which warns "No CUDA runtime is found" where a CUDA
    # toolkit is installed without a GPU: the first line a CPU run printed, about nothing the run uses.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
