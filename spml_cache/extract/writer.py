"""Stage one's rows on their way into the partial cache: one batch behind through pinned memory on a GPU, and
never with a non-finite feature.

On an H100, fp16 (the GPU default) and bf16 extraction wrote whole rows of inf/NaN (a random-weights trunk at
448 px: 64 rows in fp16, 203 in bf16; none in fp32). It is not range overflow: the same trunk's activations stay
below ~600 on these images, and CPU fp16/bf16 autocast gives none; the GPU-side cause is not found yet. Whatever
the cause, one such row poisons every later stage. So every batch gets a per-row finite mask, reduced on the
device and copied to the host beside the features, behind the same event: the check adds no host sync of its
own. Only a batch that has non-finite rows pays one more, when those rows are recomputed in fp32 from the
batch's resized images, which stay alive until the batch lands. A row still non-finite in fp32 is treated as a
bad image: an error naming the file, or with `--on-bad-image skip` a row flagged `bad`, which finalisation
leaves out.

The pinned host buffers the rows come back through are a ring of two, taken in turn: with the writer one batch
behind, the batch before the one being queued has always landed by then, so two are enough, and pinning fresh
memory every batch (a driver call that can stall the GPU) is left to the first two batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spml_cache import cache
from spml_cache.images import normalise
from spml_cache.runtime.errors import SpmlError


def _pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


@dataclass
class HostSlot:
    """One pinned pair of buffers: features float32 [rows, D] and the finite mask bool [rows]."""

    features: torch.Tensor | None = None
    finite: torch.Tensor | None = None
    ready: object = None  # the event that says the copies into it are done; made on first use
    in_use: bool = False  # handed out and its batch not yet written


class HostRing:
    """Pinned host buffers reused in turn; a slot goes out again only once its batch is written and its event
    has completed (`give_back`), and taking one still out is a bug the ring refuses rather than a race.

    `allocate(shape, dtype)` and `new_event()` are parameters so the ring's logic can be tested on the CPU.
    """

    def __init__(self, size: int = 2, *, allocate=_pinned, new_event=None) -> None:
        self.slots = [HostSlot() for _ in range(size)]
        self.allocate = allocate
        self.new_event = new_event or torch.cuda.Event
        self.turn = 0

    def take(self, rows: int, dim: int) -> HostSlot:
        slot = self.slots[self.turn]
        if slot.in_use:
            raise RuntimeError("the pinned host buffer of an earlier batch is still in flight (a writer bug)")
        if slot.features is None or slot.features.shape[0] < rows or slot.features.shape[1] != dim:
            slot.features = self.allocate((rows, dim), torch.float32)
            slot.finite = self.allocate((rows,), torch.bool)
        if slot.ready is None:
            slot.ready = self.new_event()
        slot.in_use = True
        self.turn = (self.turn + 1) % len(self.slots)
        return slot

    def give_back(self, slot: HostSlot) -> None:
        if not slot.ready.query():
            raise RuntimeError("a pinned host buffer was given back before its copies completed (a writer bug)")
        slot.in_use = False


@dataclass
class _Batch:
    split: str
    rows: np.ndarray
    bad: np.ndarray
    images: torch.Tensor | None  # the good rows' resized uint8 images, for the fp32 recompute
    features: torch.Tensor  # float32 [B, D], on the host once `ready` has passed
    finite: torch.Tensor  # bool [B], likewise
    ready: torch.cuda.Event | None  # None on the CPU, where everything is there at once
    slot: HostSlot | None = None  # the ring's buffers `features` and `finite` live in, on a GPU


class RowWriter:
    """Writes feature rows into the partial cache after checking they are finite (see the module docstring)."""

    def __init__(
        self, partial: cache.PartialCache, trunk, *, paths: dict[str, list[Path]], reduced: bool, skip_bad: bool,
        normalise=normalise,
    ) -> None:
        self.partial, self.trunk, self.paths = partial, trunk, paths
        self.normalise = normalise  # the backbone's, for the fp32 recompute from the resized uint8 images
        self.reduced = reduced  # features come from fp16/bf16 autocast, so fp32 may still give finite ones
        self.skip_bad = skip_bad
        self.pending: _Batch | None = None
        self.ring = HostRing()
        self.left_out: dict[str, list[str]] = {split: [] for split in cache.SPLITS}  # non-finite even in fp32

    def put(self, split: str, rows: np.ndarray, features: torch.Tensor, bad: np.ndarray, images) -> int:
        """Queue one batch (`images`: what the features were computed from); returns the rows written now."""
        with torch.inference_mode():
            finite = torch.isfinite(features).all(dim=1)  # bad rows are zeros, hence finite
        if features.device.type != "cuda":
            return self._land(_Batch(split, rows, bad, images, features, finite, None))
        slot = self.ring.take(len(rows), features.shape[1])
        host, host_finite = slot.features[: len(rows)], slot.finite[: len(rows)]
        host.copy_(features, non_blocking=True)
        host_finite.copy_(finite, non_blocking=True)
        slot.ready.record(torch.cuda.current_stream(features.device))  # the features' GPU, which may not be cuda:0
        written = self.flush()
        self.pending = _Batch(split, rows, bad, images, host, host_finite, slot.ready, slot)
        return written

    def flush(self) -> int:
        if self.pending is None:
            return 0
        batch, self.pending = self.pending, None
        batch.ready.synchronize()
        written = self._land(batch)
        if batch.slot is not None:  # only now: _land read the rows straight out of the pinned buffers
            self.ring.give_back(batch.slot)
        return written

    def _land(self, batch: _Batch) -> int:
        features, bad, recomputed = batch.features.numpy(), batch.bad, None
        broken = np.flatnonzero(~batch.finite.numpy())
        if len(broken):
            features, bad = features.copy(), bad.copy()  # the loader's and the trunk's arrays stay as they were
            if self.reduced:
                fresh = self._in_fp32(batch, broken)
                rescued = np.isfinite(fresh).all(axis=1)
                features[broken[rescued]] = fresh[rescued]
                recomputed = np.zeros(len(bad), dtype=bool)
                recomputed[broken[rescued]] = True
                broken = broken[~rescued]
            if len(broken):
                if not self.skip_bad:
                    raise SpmlError(
                        f"image {self.paths[batch.split][batch.rows[broken[0]]]}: its features are not finite"
                        " (NaN or inf) even in fp32: check the --weights, replace the image, or pass"
                        " --on-bad-image skip to leave it out"
                        f" (progress is kept in {cache.partial_path(self.partial.final)})"
                    )
                features[broken], bad[broken] = 0.0, True
                ids = self.partial.file[batch.split]["ids"].asstr()
                self.left_out[batch.split] += [ids[batch.rows[j]] for j in broken]
        self.partial.write_rows(batch.split, batch.rows, features, bad, recomputed)
        return len(batch.rows)

    def _in_fp32(self, batch: _Batch, broken: np.ndarray) -> np.ndarray:
        """float32 [len(broken), D] on the host: the trunk on just those rows' images, without autocast."""
        places = np.cumsum(~batch.bad)[broken] - 1  # a row's place among the good images the batch holds
        device = batch.images.device
        with torch.inference_mode(), torch.autocast(device.type, enabled=False):
            images = batch.images[torch.from_numpy(places).to(device)]
            return self.trunk(self.normalise(images, torch.float32)).float().cpu().numpy()


def notes(recomputed: dict[str, int], left_out: dict[str, list[str]], precision: str) -> list[str]:
    """The report's lines about rows that were not finite: recomputed ones (over resumed runs), dropped ones."""
    lines = []
    if any(recomputed.values()):
        per_split = ", ".join(f"{split} {count}" for split, count in recomputed.items() if count)
        lines.append(
            f"{sum(recomputed.values())} images gave non-finite features in {precision} and were recomputed in fp32"
            f" ({per_split}; the cache's recomputed_fp32 attr); --precision fp32 computes every row in fp32"
        )
    dropped = [image_id for ids in left_out.values() for image_id in ids]
    if dropped:
        shown = ", ".join(dropped[:5]) + (" ..." if len(dropped) > 5 else "")
        lines.append(f"{len(dropped)} of the images left out have features that are not finite even in fp32: {shown}")
    return lines
