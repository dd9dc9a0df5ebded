"""Stage one's rows on their way into the partial cache: one batch behind through pinned memory on a GPU, and
never with a non-finite feature.

On an H100, fp16 (the GPU default) and bf16 extraction wrote whole rows of inf/NaN (a random-weights trunk at
448 px: 64 rows in fp16, 203 in bf16; none in fp32). It is not range overflow: the same trunk's activations stay
below ~600 on these images, and CPU fp16/bf16 autocast gives none; the GPU-side cause is not found yet. Whatever
the cause, one such row poisons every later stage. So every batch gets a per-row finite mask, reduced on the
device and copied to the host beside the features, behind the same event: the check adds no host sync of its
own. Only a batch that has non-finite rows pays one more, when those rows are recomputed in fp32 from the
batch's resized images, which stay alive until the batch lands. A row still non-finite in fp32 is the
backbone's fault, not the image's (a decoded image is finite; a network that maps it to NaN in fp32 has broken
weights or code): an error naming the backbone, whatever `--on-bad-image` says, never a row left out as if its
image were bad (a backbone that gives NaN for every image would otherwise seal a cache of no rows).

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


class TrunkFailed(Exception):
    """The backbone's own code raised, or gave rows of another width, on a batch (`run_batches` names the
    backbone and the batch)."""


class RowWriter:
    """Writes feature rows into the partial cache after checking they are finite (see the module docstring)."""

    def __init__(
        self, partial: cache.PartialCache, trunk, *, paths: dict[str, list[Path]], reduced: bool, backbone: str,
        normalise=normalise,
    ) -> None:
        self.partial, self.trunk, self.paths = partial, trunk, paths
        self.normalise = normalise  # the backbone's, for the fp32 recompute from the resized uint8 images
        self.reduced = reduced  # features come from fp16/bf16 autocast, so fp32 may still give finite ones
        self.backbone = backbone  # its name, for the error a non-finite row is
        self.pending: _Batch | None = None
        self.ring = HostRing()

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
            features = features.copy()  # the trunk's array stays as it was
            if self.reduced:
                fresh = self._in_fp32(batch, broken)
                rescued = np.isfinite(fresh).all(axis=1)
                features[broken[rescued]] = fresh[rescued]
                recomputed = np.zeros(len(bad), dtype=bool)
                recomputed[broken[rescued]] = True
                broken = broken[~rescued]
            if len(broken):
                raise SpmlError(self._not_finite(batch, broken))
        self.partial.write_rows(batch.split, batch.rows, features, bad, recomputed)
        return len(batch.rows)

    def _not_finite(self, batch: _Batch, broken: np.ndarray) -> str:
        first = self.paths[batch.split][batch.rows[broken[0]]]
        others = f" and {len(broken) - 1} more of its batch" if len(broken) > 1 else ""
        return (f"backbone {self.backbone} gave features that are not finite (NaN or inf) for image {first}{others}"
                f"{', in fp32 too' if self.reduced else ''}: the backbone is at fault, not the images: check its"
                f" --weights or its code (the rows done are kept in {cache.partial_path(self.partial.final)})")

    def _in_fp32(self, batch: _Batch, broken: np.ndarray) -> np.ndarray:
        """float32 [len(broken), D] on the host: the trunk on just those rows' images, without autocast."""
        places = np.cumsum(~batch.bad)[broken] - 1  # a row's place among the good images the batch holds
        device = batch.images.device
        with torch.inference_mode(), torch.autocast(device.type, enabled=False):
            images = batch.images[torch.from_numpy(places).to(device)]
            normalised = self.normalise(images, torch.float32)
            try:
                rows = checked_rows(lambda: self.trunk(normalised), len(broken), batch.features.shape[1])
            except TrunkFailed as failure:  # this batch's, not the one the trunk runs on now (one behind)
                raise backbone_failed(self.backbone, failure, self.paths[batch.split][batch.rows[broken[0]]],
                                      batch.split, self.partial) from None
        return rows.cpu().numpy()


def backbone_failed(backbone: str, failure: TrunkFailed, first: Path, split: str, partial) -> SpmlError:
    """The one line a backbone failing on a batch is: what it did, on which images, and the rows kept."""
    return SpmlError(f"backbone {backbone} failed on a batch of {split} images (the first: {first}): it {failure};"
                     f" fix it, then run the command again (the {partial.num_done()} images done are kept in"
                     f" {cache.partial_path(partial.final)}, and go on with the fixed code where it gives the last"
                     " of them the same features)")


def checked_rows(call, rows: int, width: int) -> torch.Tensor:
    """`call()`, the trunk on `rows` images, checked to give [rows, width]; what its own code raises (or another
    shape) is `TrunkFailed`."""
    try:
        out = call()
    except (SpmlError, MemoryError, torch.OutOfMemoryError):  # memory: a batch too large, not the backbone's fault
        raise
    except Exception as err:  # the backbone's own code: a plugin's, or a library's on this input
        said = str(err).splitlines()[0] if str(err).strip() else ""
        raise TrunkFailed(f"raised {type(err).__name__}" + (f": {said}" if said else "")) from err
    if not isinstance(out, torch.Tensor):
        raise TrunkFailed(f"returned a {type(out).__name__}, not a tensor [{rows}, {width}]")
    if out.shape != (rows, width):
        width_only = out.ndim == 2 and out.shape[0] == rows
        raise TrunkFailed(f"returned rows of width {out.shape[1]}, not its {width}" if width_only else
                          f"returned a tensor {list(out.shape)}, not [{rows}, {width}]")
    return out.float()


def notes(recomputed: dict[str, int], precision: str) -> list[str]:
    """The report's lines about rows that were not finite in reduced precision, recomputed in fp32 (over resumed
    runs)."""
    lines = []
    if any(recomputed.values()):
        per_split = ", ".join(f"{split} {count}" for split, count in recomputed.items() if count)
        lines.append(
            f"{sum(recomputed.values())} images gave non-finite features in {precision} and were recomputed in fp32"
            f" ({per_split}; the cache's recomputed_fp32 attr); --precision fp32 computes every row in fp32"
        )
    return lines
