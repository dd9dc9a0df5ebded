"""What a CUDA graph would bake in, recorded on the CPU: the aten ops a piece of code runs, with their non-tensor
arguments, their tensors' shapes and dtypes, and where each tensor the code did not make itself lives.

A captured graph replays exactly that: the same kernels, with the same scalars, on the same memory. So code is
safe to capture once and replay when every run of it records the same trace, and none of its ops needs the host
(a sync) or makes a tensor from host data (a host-to-device copy), both of which a capture refuses.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Ops that wait on the device (a value read back, a data-dependent shape) or copy host data to it.
FORBIDDEN = {
    "aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.nonzero_static", "aten.masked_select",
    "aten.lift_fresh", "aten.lift_fresh_copy", "aten._unique", "aten._unique2", "aten.unique_dim",
    "aten.unique_consecutive",
}


def _op_name(func) -> str:
    return str(func.overloadpacket)


def _bool_index(func, args) -> bool:
    """`t[mask]` (and `t[mask] = v`): an index op with a boolean index runs a nonzero inside."""
    if _op_name(func) not in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"):
        return False
    indices = args[1] if len(args) > 1 else []
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or [])


class OpTrace(TorchDispatchMode):
    """Records `(op, arguments)` for every aten op run under it; `problems` lists the forbidden ones."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.problems: list[str] = []
        self._made: set[int] = set()  # storages the traced code produced: temporaries, new at every run

    def _describe(self, value):
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage().data_ptr()
            where = "made" if storage in self._made else (storage, value.storage_offset(), tuple(value.stride()))
            return ("tensor", tuple(value.shape), value.dtype, value.device.type, where)
        return repr(value)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        if name in FORBIDDEN or _bool_index(func, args):
            self.problems.append(name + (" with a boolean index" if _bool_index(func, args) else ""))
        flat, _ = tree_flatten((args, kwargs))
        self.ops.append((str(func), tuple(self._describe(value) for value in flat)))
        out = func(*args, **kwargs)
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._made.add(value.untyped_storage().data_ptr())
        return out


def trace(code) -> OpTrace:
    """Run `code()` under an `OpTrace` and return it."""
    recorder = OpTrace()
    with recorder:
        code()
    return recorder


def first_difference(expected: list[tuple], got: list[tuple]) -> str:
    """Where two traces part, for an assertion message."""
    for position, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return f"op {position}: captured {a}, replayed {b}"
    return f"captured {len(expected)} ops, replayed {len(got)}"
