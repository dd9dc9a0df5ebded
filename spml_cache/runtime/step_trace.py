"""What a CUDA graph would bake in, recorded on the CPU: the aten ops a piece of code runs, with their non-tensor
arguments, their tensors' shapes and dtypes, and where each tensor comes from (an input of the step, a tensor
the step made, or state read from memory at an address).

A captured graph replays exactly that: the same kernels, with the same scalars, on the same memory. So code is
safe to capture once and replay when every run of it records the same trace, and none of its ops waits on the
device (a sync) or makes a tensor from host data (a host-to-device copy), both of which a capture refuses.
Used by `spml-cache check-loss` (losses/contract.py: anyone's loss held to the built-ins' rule), and through
tests/trace_support.py by tests/test_losses_graph_safe.py (every loss's step) and tests/test_linear_graphs.py (the
engine's).

Some ATen kernels read a tensor argument on the host themselves (`index_fill_` and `masked_fill_` with a tensor
value call `.item()` on it): on a GPU a sync, which a capture refuses. A dispatch mode does not see such a call
(it is made below the mode), so they are caught twice: by op and overload (`SYNCING_OVERLOADS`), and, for any
other kernel, by routing the CPU's `_local_scalar_dense` (what `.item()` runs) through the recorder while it
records (`KernelHostReads`).
"""

from __future__ import annotations

import os
import traceback
from contextlib import ExitStack

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# an op that waits for the device, makes a tensor from host data, or has a shape that depends on the data
FORBIDDEN_OPS = {
    "aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal",
    "aten.nonzero", "aten.nonzero_static", "aten.nonzero_numpy", "aten.argwhere", "aten.masked_select",
    "aten.lift", "aten.lift_fresh", "aten.lift_fresh_copy",
    "aten.unique", "aten._unique", "aten._unique2", "aten.unique_dim", "aten.unique_consecutive",
    "aten.unique_dim_consecutive", "aten.bincount", "aten.repeat_interleave",
    "aten.histc", "aten.masked_scatter", "aten.masked_scatter_",  # their CUDA kernels read a count on the host
}
# overloads whose kernel reads a tensor argument on the host (ATen calls `.item()` on the value: a sync on a GPU)
SYNCING_OVERLOADS = {
    "aten.index_fill.int_Tensor", "aten.index_fill_.int_Tensor", "aten.index_fill.Dimname_Tensor",
    "aten.index_fill_.Dimname_Tensor", "aten.masked_fill.Tensor", "aten.masked_fill_.Tensor",
}
# ops whose CPU kernel reads a value on the host where their CUDA kernel does not: linalg_lu_solve's pivot range
# checks are the CPU's alone ("simple sanity checks here for the CPU version", ATen's BatchLinearAlgebraKernel.cpp),
# and the CPU's fused Adam reads each step count with `.item()` where the CUDA kernel reads it on the device (what
# makes `Adam(fused=True)` capturable)
CPU_ONLY_HOST_READS = {"aten.linalg_lu_solve.default", "aten._fused_adam_.default"}
INDEXING_OPS = {"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl", "aten._index_put_impl_"}
# Python-level reads of device values, which on the CPU reach no aten op at all
FORBIDDEN_METHODS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "__array__"}


PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # spml_cache/


def where_in_the_package() -> str:
    """Where the op was called. In code outside the package (a loss plugin's file, under check-loss) its innermost
    line alone, `file.py:8 (the line)`, the path as short as the current folder allows: the line to change. Else
    the package's own calling lines, innermost first (at most `PACKAGE_FRAMES`)."""
    frames = [f for f in reversed(traceback.extract_stack()[:-1])
              if f.filename.endswith(".py") and not _library(f.filename) and f.filename != __file__]
    outside = [f for f in frames if not os.path.abspath(f.filename).startswith(PACKAGE + os.sep)]
    if outside:
        return f"{_short(outside[0].filename)}:{outside[0].lineno} ({outside[0].line})"
    return " <- ".join(f"{os.path.relpath(f.filename, os.path.dirname(PACKAGE))}:{f.lineno} {f.line}"
                       for f in frames[:PACKAGE_FRAMES]) or "?"


PACKAGE_FRAMES = 4


def _short(filename: str) -> str:
    """`filename` relative to the current folder where it lies below it, else as it is."""
    relative = os.path.relpath(filename)
    return filename if relative.startswith("..") else relative


def flat(value) -> list:
    """The leaves of an op's nested arguments or results."""
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in flat(item)]
    return [value]


def _library(filename: str) -> bool:
    """A file of Python's or of an installed library (torch's dispatch, pytest), not the code being checked."""
    return any(part in filename for part in ("site-packages", "dist-packages", "/lib/python", "<"))


class StepRecorder(TorchDispatchMode):
    """Each aten op run under it as (op, arguments), in `trace`; the forbidden ones, with where in the package
    they were called, in `forbidden`. `inputs` and `state_names` name tensors by their storage in the trace."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # no torch.compile here: spares the test importing dynamo (seconds)
        return False

    def __init__(self, inputs: dict[str, torch.Tensor] | None = None, state_names: dict[int, str] | None = None):
        super().__init__()
        self.inputs = {t.untyped_storage().data_ptr(): name for name, t in (inputs or {}).items()}
        self.state_names = state_names or {}
        self.made: set[int] = set()
        self.trace: list[tuple] = []
        self.forbidden: list[str] = []

    def describe(self, value):
        if isinstance(value, (list, tuple)):
            return tuple(self.describe(item) for item in value)
        if isinstance(value, dict):
            return tuple((key, self.describe(item)) for key, item in value.items())
        if not isinstance(value, torch.Tensor):
            return repr(value)
        ptr = value.untyped_storage().data_ptr()
        if ptr in self.inputs:
            origin = ("input", self.inputs[ptr])
        elif ptr in self.made:
            origin = ("made",)
        else:  # the same memory in every run, or a captured graph reads a stale copy
            origin = ("state", self.state_names.get(ptr, "?"), ptr, value.storage_offset(), tuple(value.stride()))
        return (*origin, tuple(value.shape), str(value.dtype))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = func.overloadpacket._qualified_op_name.replace("::", ".")
        bool_index = op in INDEXING_OPS and any(
            isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in flat(args[1])
        )
        if op in FORBIDDEN_OPS or bool_index:
            self.forbidden.append(f"{func}{' with a boolean index' if bool_index else ''} at {where_in_the_package()}")
        elif str(func) in SYNCING_OVERLOADS:
            self.forbidden.append(f"{func} (its kernel reads the tensor value on the host) at {where_in_the_package()}")
        self.trace.append((str(func), self.describe(args), self.describe(kwargs)))
        out = func(*args, **kwargs)
        self.made.update(t.untyped_storage().data_ptr() for t in flat(out) if isinstance(t, torch.Tensor))
        return out


class HostReads(TorchFunctionMode):
    """Tensor methods that copy a value to the host (`.item()`, `bool(t)`, `.tolist()`, ...)."""

    def __init__(self, forbidden: list[str]):
        super().__init__()
        self.forbidden = forbidden

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in FORBIDDEN_METHODS:
            self.forbidden.append(f"Tensor.{func.__name__} at {where_in_the_package()}")
        return func(*args, **(kwargs or {}))


class KernelHostReads:
    """While entered, every `.item()` on a CPU tensor, a kernel's own included, is listed in `forbidden`: the CPU
    kernel of `aten._local_scalar_dense` is replaced by one that lists the call and reads the value (`tolist`,
    which does not dispatch). Leaving restores ATen's kernel."""

    def __init__(self, recorder: StepRecorder):
        self.recorder = recorder
        self.library = None

    def _read(self, tensor: torch.Tensor):
        running = self.recorder.trace[-1][0] if self.recorder.trace else "?"  # the op whose kernel is running
        if running not in CPU_ONLY_HOST_READS:
            self.recorder.forbidden.append(f"aten._local_scalar_dense (a host read) inside {running} at {where_in_the_package()}")
        return tensor.tolist()

    def __enter__(self):
        self.library = torch.library.Library("aten", "IMPL")
        self.library.impl("_local_scalar_dense", self._read, "CPU")
        return self

    def __exit__(self, *exc_info) -> None:
        self.library._destroy()
        self.library = None


def record(code, inputs: dict[str, torch.Tensor] | None = None, state_names: dict[int, str] | None = None):
    """Run `code()` under a `StepRecorder` (and `HostReads`, `KernelHostReads`); returns its value and the
    recorder."""
    recorder = StepRecorder(inputs, state_names)
    with ExitStack() as recording:
        recording.enter_context(KernelHostReads(recorder))
        recording.enter_context(HostReads(recorder.forbidden))
        recording.enter_context(recorder)
        value = code()
    return value, recorder


def first_difference(first: list, other: list, names: tuple[str, str] = ("first", "later")) -> str:
    """Where two traces part, for an assertion message."""
    for position, (a, b) in enumerate(zip(first, other)):
        if a != b:
            return f"op {position}:\n  {names[0]}: {a}\n  {names[1]}: {b}"
    return f"{len(first)} ops against {len(other)}"
