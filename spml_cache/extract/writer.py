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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spml_cache import cache
from spml_cache.backbone import normalise
from spml_cache.errors import SpmlError


@dataclass
class _Batch:
    split: str
    rows: np.ndarray
    bad: np.ndarray
    images: torch.Tensor | None  # the good rows' resized uint8 images, for the fp32 recompute
    features: torch.Tensor  # float32 [B, D], on the host once `ready` has passed
    finite: torch.Tensor  # bool [B], likewise
    ready: torch.cuda.Event | None  # None on the CPU, where everything is there at once


class RowWriter:
    """Writes feature rows into the partial cache after checking they are finite (see the module docstring)."""

    def __init__(
        self, partial: cache.PartialCache, trunk, *, paths: dict[str, list[Path]], reduced: bool, skip_bad: bool
    ) -> None:
        self.partial, self.trunk, self.paths = partial, trunk, paths
        self.reduced = reduced  # features come from fp16/bf16 autocast, so fp32 may still give finite ones
        self.skip_bad = skip_bad
        self.pending: _Batch | None = None
        self.left_out: dict[str, list[str]] = {split: [] for split in cache.SPLITS}  # non-finite even in fp32

    def put(self, split: str, rows: np.ndarray, features: torch.Tensor, bad: np.ndarray, images) -> int:
        """Queue one batch (`images`: what the features were computed from); returns the rows written now."""
        with torch.inference_mode():
            finite = torch.isfinite(features).all(dim=1)  # bad rows are zeros, hence finite
        if features.device.type != "cuda":
            return self._land(_Batch(split, rows, bad, images, features, finite, None))
        host = torch.empty(features.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(features, non_blocking=True)
        host_finite = torch.empty(finite.shape, dtype=torch.bool, pin_memory=True)
        host_finite.copy_(finite, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(features.device))  # the features' GPU, which may not be cuda:0
        written = self.flush()
        self.pending = _Batch(split, rows, bad, images, host, host_finite, ready)
        return written

    def flush(self) -> int:
        if self.pending is None:
            return 0
        batch, self.pending = self.pending, None
        batch.ready.synchronize()
        return self._land(batch)

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
            return self.trunk(normalise(images, torch.float32)).float().cpu().numpy()


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
