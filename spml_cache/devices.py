"""Resolve `--device auto|cpu|cuda|cuda:N` once, at the boundary; how many reader processes a device wants."""

from __future__ import annotations

import os

import torch

from spml_cache.errors import SpmlError


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
