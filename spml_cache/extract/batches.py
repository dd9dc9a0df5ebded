"""Stage one's compute loop: the pending rows of a partial cache, batch by batch, through the loader (reading,
and on the CPU or with `--decode cpu` decoding, in worker processes), the trunk (on a GPU fed by feed.py's
thread) and the writer.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spml_cache import cache
from spml_cache.backbones.preprocess import Preprocess
from spml_cache.extract import writer
from spml_cache.extract.feed import Feed
from spml_cache.images import ImageDecodeError, decode_jpegs
from spml_cache.options.extract import PRECISION_DTYPES
from spml_cache.runtime.children import loader_worker_init
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.progress import progress_bar

PRECISIONS = {name: getattr(torch, dtype) for name, dtype in PRECISION_DTYPES.items()}


def decode_batch(blobs, bad: np.ndarray, device, preprocess: Preprocess, skip_bad: bool):
    """(resized (`preprocess.images`) uint8 batch of the good images or None, error) for one batch; flags undecodable ones in `bad`.

    `error` is (position in the batch, reason) for the first bad image when not `skip_bad`, else None.
    """
    good = [j for j in range(len(blobs)) if not bad[j]]
    try:
        decoded = decode_jpegs([blobs[j] for j in good], device, skip_bad=skip_bad)
    except ImageDecodeError as err:
        return None, (good[err.index], f"cannot be decoded ({err.reason})")
    images = []
    for j, image in zip(good, decoded):
        if image is None:
            bad[j] = True
        else:
            images.append(image)
    return (preprocess.images(images, device) if images else None), None


class ImageBatches(torch.utils.data.Dataset):
    """Item i is batch i: (split, rows, payload, bad, error); runs in the loader's worker processes.

    The payload is the raw file bytes when the batch is decoded on the GPU (plain `bytes` travel through
    the worker pipe; one shared-memory tensor per image would exhaust file descriptors), else the decoded
    and resized uint8 batch of the good images (decoding on the CPU is then spread over the workers, and
    uint8 keeps the shared memory a quarter of float32's).
    """

    def __init__(self, batches, paths: dict[str, list[Path]], preprocess: Preprocess, decode_here: bool,
                 skip_bad: bool):
        self.batches, self.paths, self.preprocess = batches, paths, preprocess
        self.decode_here, self.skip_bad = decode_here, skip_bad

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int):
        split, rows = self.batches[index]
        bad = np.zeros(len(rows), dtype=bool)
        blobs = []
        for j, row in enumerate(rows):
            try:
                blobs.append(self.paths[split][row].read_bytes())
            except OSError as err:
                if not self.skip_bad:
                    return split, rows, None, bad, (j, f"cannot be read ({err.strerror or err})")
                bad[j] = True
                blobs.append(None)
        if not self.decode_here:
            return split, rows, blobs, bad, None
        batch, error = decode_batch(blobs, bad, "cpu", self.preprocess, self.skip_bad)
        return split, rows, batch, bad, error


def _as_is(item):
    return item


def spread(pooled: torch.Tensor, bad: np.ndarray, device) -> torch.Tensor:
    """float32 [len(bad), width]: the good rows' trunk outputs in their places, zeros for the bad ones."""
    if not bad.any():
        return pooled
    features = torch.zeros((len(bad), pooled.shape[1]), dtype=torch.float32, device=device)
    if len(pooled):
        # Only with bad rows: an index copy to the GPU every batch would stall the pipeline.
        features[torch.from_numpy(np.flatnonzero(~bad)).to(device)] = pooled
    return features


def _autocast(device, dtype):
    return torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()


def pooled_rows(trunk, batch, bad: np.ndarray, device, dtype, pad_to: int = 0, *, preprocess: Preprocess,
                width: int) -> torch.Tensor:
    """float32 [len(bad), width]: the trunk's output rows of the good rows (from their resized uint8 images),
    zeros for the bad ones; with `pad_to`, the trunk runs on the batch padded to that many rows by repeating its
    last image, and only the good rows' outputs are kept."""
    with torch.inference_mode():
        if batch is None:
            return spread(torch.empty((0, width)), bad, device)
        inputs = batch.to(device, non_blocking=True)
        if pad_to > len(inputs):
            inputs = torch.cat([inputs, inputs[-1:].expand(pad_to - len(inputs), *inputs.shape[1:])])
        normalised = preprocess.normalise(inputs, dtype)
        with _autocast(device, dtype):
            pooled = writer.checked_rows(lambda: trunk(normalised), len(inputs), width)[: len(batch)]
        return spread(pooled, bad, device)


def fed_rows(trunk, fed, feed: Feed, device, dtype, width: int) -> torch.Tensor:
    """`pooled_rows` for a batch from the feed thread, whose inputs are already normalised (and padded)."""
    with torch.inference_mode():
        if fed.num_good == 0:
            return spread(torch.empty((0, width)), fed.bad, device)
        with _autocast(device, dtype):
            pooled = writer.checked_rows(lambda: trunk(fed.inputs), len(fed.inputs), width)[: fed.num_good]
        feed.release(fed)
        return spread(pooled, fed.bad, device)


def _bad_image(paths, partial, split, rows, error) -> SpmlError:
    position, reason = error
    return SpmlError(
        f"image {paths[split][rows[position]]} {reason}: replace it, or pass --on-bad-image skip"
        f" to leave it out (progress is kept in {cache.partial_path(partial.final)})"
    )


class _NoBar:
    """The progress of a run without a label (a few rows checked again): nothing shown."""

    def advance(self, count: int) -> None:
        pass


_NO_BAR = _NoBar()


@dataclass(frozen=True, kw_only=True)
class BatchRun:
    """How the trunk runs over the images: the backbone's `preprocess`, `width` (the columns of a trunk output
    row, `Description.row_width`), the batch size, reader processes, device, precision, whether a bad image is
    skipped, the progress bar's label, the backbone's name (for the error its failure is). `pad_batches` (every
    trunk input padded to the run's batch size) and `feed_thread` (decoding in the feed thread) are on by default
    on a GPU only; the tests turn them on for the CPU. `decode`: on a GPU, gpu (nvjpeg, the default) or cpu (the
    loader workers decode and resize as on the CPU); on the CPU, cpu."""

    preprocess: Preprocess
    width: int
    batch_size: int
    workers: int
    device: torch.device
    precision: str
    skip_bad: bool
    label: str  # "": no progress shown
    backbone: str
    pad_batches: bool | None = None
    feed_thread: bool | None = None
    decode: str | None = None  # None: gpu on a GPU


def _loader(batches, paths, run: BatchRun, feed_thread: bool):
    """The loader of the run's batches, and `to_images(payload, bad)` -> (the resized uint8 batch on the device or
    None, error) for what it yields. Its workers decode and resize on the CPU, unless nvjpeg decodes on the GPU
    or, in the CPU tests of the feed thread, the thread decodes; then they ship the files' bytes."""
    device, preprocess, skip_bad = run.device, run.preprocess, run.skip_bad
    workers_decode = run.decode == "cpu" if device.type == "cuda" else not feed_thread
    loader = torch.utils.data.DataLoader(
        ImageBatches(batches, paths, preprocess, decode_here=workers_decode, skip_bad=skip_bad),
        batch_size=None,
        num_workers=run.workers,
        collate_fn=_as_is,
        prefetch_factor=(2 if workers_decode else 4) if run.workers else None,  # bytes are light, images not
        worker_init_fn=loader_worker_init(),
    )
    if workers_decode:
        return loader, lambda batch, bad: (None if batch is None else batch.to(device), None)
    return loader, lambda blobs, bad: decode_batch(blobs, bad, device, preprocess, skip_bad)


def run_batches(partial, paths, trunk, run: BatchRun) -> int:
    """Extract every pending row of the partial cache; returns the number of rows computed. The backbone failing
    on a batch (raising, another width, non-finite features) is one line naming it, the rows done kept."""
    preprocess, width, batch_size, device = run.preprocess, run.width, run.batch_size, run.device
    batches = []
    for name in cache.SPLITS:
        pending = partial.pending(name)
        batches += [(name, pending[i : i + batch_size]) for i in range(0, len(pending), batch_size)]
    total = sum(len(rows) for _, rows in batches)
    on_gpu = device.type == "cuda"
    pad_batches = on_gpu if run.pad_batches is None else run.pad_batches
    feed_thread = on_gpu if run.feed_thread is None else run.feed_thread
    largest = max((len(rows) for _, rows in batches), default=1)  # the one shape: batch_size unless fewer rows
    pad_to = largest if pad_batches else 0
    loader, to_images = _loader(batches, paths, run, feed_thread)
    dtype = PRECISIONS[run.precision]
    rows_out = writer.RowWriter(partial, trunk, paths=paths, reduced=dtype != torch.float32, backbone=run.backbone,
                                normalise=preprocess.normalise)
    batch = None  # (split, rows) of the batch the trunk runs on
    with progress_bar(run.label, total=total, unit="img") if run.label else nullcontext(_NO_BAR) as bar:
        advance = lambda count: count and bar.advance(count)  # noqa: E731 (a plain bar reprints on 0)
        try:
            if feed_thread:
                feed = Feed(loader, to_images, device=device, dtype=dtype, rows=largest,
                            resolution=preprocess.resolution, pad=pad_batches,
                            normalise=preprocess.normalise)  # fmt: skip
                try:
                    for fed in feed:
                        batch = (fed.split, fed.rows)
                        if fed.error is not None:
                            raise _bad_image(paths, partial, fed.split, fed.rows, fed.error)
                        features = fed_rows(trunk, fed, feed, device, dtype, width)
                        advance(rows_out.put(fed.split, fed.rows, features, fed.bad, fed.images))
                finally:
                    feed.close()
            else:
                for split, rows, payload, bad, error in loader:
                    batch = (split, rows)
                    if on_gpu and error is None:
                        payload, error = to_images(payload, bad)
                    if error is not None:
                        raise _bad_image(paths, partial, split, rows, error)
                    features = pooled_rows(trunk, payload, bad, device, dtype, pad_to, preprocess=preprocess,
                                           width=width)
                    advance(rows_out.put(split, rows, features, bad, payload))
        except writer.TrunkFailed as failure:
            raise writer.backbone_failed(run.backbone, failure, paths[batch[0]][batch[1][0]], batch[0],
                                         partial) from None
        finally:
            advance(rows_out.flush())
    return total
