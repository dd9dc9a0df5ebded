"""What a broken install looks like when a command starts, said as one line with the fix.

A torchvision built for another torch than the one installed (what a half-done CPU-only install leaves: PyPI's
torchvision beside a torch from PyTorch's CPU index, or one upgraded without the other) fails as soon as it is
imported, with torch's `RuntimeError: operator torchvision::nms does not exist`. Each torch 2.M release has one
torchvision, 0.(M + 15) (torch 2.4 / torchvision 0.19, ..., torch 2.14 / torchvision 0.29), so the fix can name the
pair: the torchvision of the torch that is there, from the index that torch came from (PyTorch's own index of the
build its local label names, `+cpu`, `+cu130`, ...; PyPI for a torch without one).

The fix uninstalls torchvision first: where only the builds differ (a `+cpu` torch beside PyPI's CUDA torchvision
of the same release), `pip install 'torchvision==0.28.*'` finds the installed 0.28.0 satisfying the pin (a local
label never fails a version match) and changes nothing. torch itself stays, pinned on the line so that pip keeps
it (tests/test_install.py runs both lines against a package index of two builds).
"""

from __future__ import annotations

import re
from importlib import metadata

from spml_cache.runtime.errors import SpmlError

PYTORCH_INDEX = "https://download.pytorch.org/whl"
CPU_INDEX = f"{PYTORCH_INDEX}/cpu"
TORCHVISION_MINOR_OFFSET = 15  # torchvision 0.(M + 15) goes with torch 2.M


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def matching_pair(torch_version: str) -> str:
    """The pip commands that put this torch's own torchvision beside it, the installed one removed first (or, for a
    torch this rule does not cover, the advice to take both from one release)."""
    found = re.match(r"2\.(\d+)\.(\d+)(?:\+([\w.]+))?$", torch_version)
    if not found:
        return "install torch and torchvision of one release together (pytorch.org lists the pairs)"
    minor, patch, build = int(found.group(1)), found.group(2), found.group(3)
    index = f" --index-url {PYTORCH_INDEX}/{build}" if build else ""
    return ("python -m pip uninstall -y torchvision && python -m pip install"
            f" torch==2.{minor}.{patch} 'torchvision==0.{minor + TORCHVISION_MINOR_OFFSET}.*'{index}")


def mismatched_torchvision(err: BaseException) -> SpmlError | None:
    """`err` as one line with the fix when it is torchvision's import failing for want of its own torch; else None."""
    if not (isinstance(err, RuntimeError) and re.search(r"operator torchvision::\w+ does not exist", str(err))):
        return None
    torch_version = _version("torch") or "?"
    torchvision_version = _version("torchvision") or "?"
    return SpmlError(f"torchvision {torchvision_version} does not fit the installed torch {torch_version} ({err}):"
                     f" install the matching pair: {matching_pair(torch_version)}")
