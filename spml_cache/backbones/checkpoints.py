"""Weights files for every backbone family: where a named checkpoint is cached and how it is fetched (once,
never offline), reading a `.pth` safely, and the provenance a cache records for a local file."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import re
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from spml_cache.runtime.errors import SpmlError

DOWNLOAD_TIMEOUT_S = 20.0
# The last way out of every "weights not here" error: features from a random trunk still run the whole pipeline.
WEIGHTS_NONE = "or --weights none (random features, to try the pipeline)"


@contextmanager
def hub_fetch(where: list[str]):
    """Around a fetch from the Hugging Face hub (timm's, open_clip's): huggingface_hub's own lines quiet (an
    unreachable hub logs each of its retries, ten "Retrying in 8s [Retry 4/5]" and as many tracebacks' first lines
    before the one error), and `where` given what the error line should add: that HF_HUB_OFFLINE is set, or how
    long the hub was tried and that SPML_OFFLINE=1 stops at once."""
    hub = logging.getLogger("huggingface_hub")
    level, started = hub.level, time.monotonic()
    hub.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        hub.setLevel(level)
        where[:] = [" with HF_HUB_OFFLINE set" if os.environ.get("HF_HUB_OFFLINE") else
                    f" after {time.monotonic() - started:.0f} s of the hub's retries (SPML_OFFLINE=1 stops at once)"]


class RandomWeightsWarning(UserWarning):
    """`--weights none`: the features come from a randomly initialised network."""


def _sha256(path: Path) -> str:
    stat = path.stat()
    return _sha256_of(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    """Cached per file version: provenance is asked for before and while loading the same file."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_checkpoint(url: str, what: str, other_way: str) -> Path:
    """The file `url` names under `$TORCH_HOME/hub/checkpoints`, downloaded only when absent (not with
    SPML_OFFLINE); when missing and not fetched, one line naming the file to place there, or `other_way`."""
    path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)
    if path.is_file():
        return path
    way_out = (
        f"{what} are not cached (expected {path}; the cache folder is TORCH_HOME="
        f"{os.environ.get('TORCH_HOME', '~/.cache/torch')})"
    )
    fix = f"copy {path.name} there, {other_way}, {WEIGHTS_NONE}"
    if os.environ.get("SPML_OFFLINE"):
        raise SpmlError(f"{way_out} and SPML_OFFLINE is set: {fix}")
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # an unreachable network must not hang the run
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        hash_prefix = re.search(r"-([a-f0-9]+)\.", path.name)
        # download_url_to_file writes a temporary file and moves it into place, so no half file is left.
        torch.hub.download_url_to_file(url, str(path), hash_prefix and hash_prefix.group(1))
    except (OSError, RuntimeError, ValueError) as err:
        reason = getattr(err, "reason", None) or err  # urllib's "<urlopen error ...>" wraps the reason
        raise SpmlError(f"{way_out} and could not be downloaded ({reason}): {fix}") from None
    finally:
        socket.setdefaulttimeout(previous)
    return path


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A `.pth` file's tensors (loaded with `weights_only=True`, unwrapped from a training checkpoint)."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle errors, zip errors, disallowed globals: all mean "not a weights file"
        text = str(err).strip()
        if "weights_only" in text or isinstance(err, pickle.UnpicklingError):
            # torch's own message advises weights_only=False, which would run whatever code the file holds
            problem = "it holds Python objects besides tensors, which are not loaded from a file"
        else:
            problem = f"{type(err).__name__}: {text.splitlines()[0][:160]}" if text else type(err).__name__
        raise SpmlError(f"--weights {path}: not a loadable PyTorch weights file ({problem}); save the ResNet-50's"
                        " weights with torch.save(model.state_dict(), PATH)") from None
    # Training checkpoints often wrap the weights one level down.
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
            loaded = loaded[key]
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise SpmlError(f"--weights {path}: not a state dict (a mapping of names to tensors); save model.state_dict()")
    return loaded


def file_provenance(path: Path) -> str:
    """What a cache records as the `weights` of a local file: `sha256:<hex>` of its bytes."""
    return f"sha256:{_sha256(Path(path))}"
