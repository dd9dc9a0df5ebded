"""Resolve `--device auto|cpu|cuda|cuda:N` once, at the boundary; how many reader processes a device wants; small
tensors to the host in one copy; on the CPU, the conditions stage two's heads train and score in (`head_conditions`:
one thread, denormals flushed while they train)."""

from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np
import torch

from spml_cache.runtime.errors import SpmlError


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` is the first CUDA GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SpmlError(f"--device {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpmlError(f"--device {name}: no CUDA GPU is visible to PyTorch; use --device cpu")
    return device


def default_workers(device: torch.device) -> int:
    """Image reader processes: on a GPU enough to keep nvjpeg fed; on the CPU few, as the trunk needs the cores
    more than decoding does."""
    cores = os.cpu_count() or 1
    return min(8, cores) if device.type == "cuda" else min(4, cores // 4)


def to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Small device tensors as numpy arrays of their own dtypes and shapes, through one copy (one wait for the
    device instead of one each); exact for bool, integers below 2^24 and floats up to float64."""
    wide = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    flat = torch.cat([t.detach().reshape(-1).to(wide) for t in tensors]).cpu().numpy()
    arrays, start = [], 0
    for t in tensors:
        dtype = np.dtype(str(t.dtype).removeprefix("torch."))  # float32, float64, bool, int64, ...
        arrays.append(flat[start : start + t.numel()].reshape(tuple(t.shape)).astype(dtype))
        start += t.numel()
    return arrays


@contextmanager
def head_conditions(device: torch.device, *, training: bool = True):
    """The conditions in which stage two's heads train (and, `training=False`, are scored) on the CPU, set here
    only: one intra-op thread (`single_threaded`), and denormals flushed while they train (`flushing_denormals`).

    Both change the arithmetic, not only the speed: an op split over two threads adds its parts in another order
    (and ATen's AVX2 / AVX-512 kernels and MKL cut their work by the thread count), and a flushed denormal is a
    zero. The same step gives the same bits only under the same conditions, so the eager loop
    (`SeedRun.run_epoch`), the lockstep loop (`graphs.Lockstep`) and scoring all enter this, and a replay equals
    the eager step on any x86 CPU (tests/test_linear_graphs.py). Scoring does not flush: a flushed sigmoid would
    tie the lowest scores (below ~1e-38), which the GPU's does not."""
    with single_threaded(device):
        if not training:
            yield
            return
        with flushing_denormals(device):
            yield


@contextmanager
def single_threaded(device: torch.device):
    """On the CPU, one intra-op thread while heads train and score.

    Each step's tensors are a few hundred KB: splitting an op across threads costs more than it saves, and on
    a busy machine waiting threads slow every op down by an order of magnitude (measured: 30x on 2 shared
    cores). Training the stacks in parallel threads does not pay either: a step is ~50 small ops, and
    their dispatch holds the GIL.
    """
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextmanager
def flushing_denormals(device: torch.device):
    """Saturated heads make gradients denormal, which x86 handles ~10x slower unless they are flushed to zero
    (values below ~1e-38; the flag belongs to the calling thread)."""
    flushing = device.type == "cpu" and torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if flushing:
            torch.set_flush_denormal(False)
