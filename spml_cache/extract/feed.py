"""Stage one's input side on a GPU: a background thread turns the loader's file bytes into normalised batches
on a CUDA stream of its own, while the main thread runs the trunk on the compute stream.

Why a thread: torchvision's nvjpeg decode blocks the calling thread until its batch is decoded (it synchronises
its own stream), and resizing launches dozens of small kernels; done in the main thread, both leave the GPU idle
between batches. Here the thread decodes, resizes and normalises batch i+1 while the GPU runs the trunk on
batch i and the main thread writes batch i-1 (writer.py).

Hand-over, per batch (`FedBatch`): the thread waits for a free input slot (a preallocated `[rows, 3, R, R]`
buffer in the trunk's dtype, channels_last), makes its stream wait on the slot's `consumed` event (the trunk's
last read of it), writes the normalised images into it, pads it to the full batch when asked (repeating the
last good image, so cuDNN sees one input shape for the whole run), records `ready` and queues the batch. The
main thread makes the compute stream wait on `ready`, runs the trunk, records `consumed` and gives the slot
back. Slots are only ever written after both events are in place, so no tensor is read and written at once
across the two streams; the resized uint8 images also travel with the batch (the writer's fp32 recompute
needs them) and are marked as used on the compute stream (`record_stream`) before the thread's stream could
reuse their memory.

Errors: a bad image (`on_bad_image="fail"`) travels as the batch's `error`, so the main thread raises the
same one-line error as without the thread; any exception in the thread is raised again in the main thread.
`close()` (always called) stops the thread; the thread never touches the cache file.

The same class runs on the CPU without streams or events, which is how the CPU tests exercise it; the CPU
extraction itself does not use it (its loader workers decode, and the trunk is the limit there).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import numpy as np
import torch

from spml_cache.images import normalise

DEPTH = 2  # batches decoded ahead of the trunk
POLL_S = 0.1  # how often a blocked thread looks whether it was told to stop
THREAD_NAME = "spml-extract-feed"


class _Done:
    """A CUDA event's interface for the CPU, where work is done when the call returns."""

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@dataclass
class InputSlot:
    inputs: torch.Tensor  # [rows, 3, R, R] in the trunk's dtype, channels_last
    ready: object  # recorded on the feed stream once the inputs are written
    consumed: object  # recorded on the compute stream once the trunk has read them


@dataclass
class FedBatch:
    split: str
    rows: np.ndarray
    bad: np.ndarray  # rows whose image could not be read or decoded
    images: torch.Tensor | None  # the good rows' resized uint8 images (None if none), for the fp32 recompute
    num_good: int
    slot: InputSlot | None  # inputs[:num_good] are the good rows; up to `rows` more are padding when padded
    error: tuple[int, str] | None  # (position in the batch, reason) of a bad image that stops the run
    padded: bool = False

    @property
    def inputs(self) -> torch.Tensor:
        """What the trunk runs on: the good rows, and the padding when the batch was padded."""
        return self.slot.inputs if self.padded else self.slot.inputs[: self.num_good]


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


class Feed:
    """Iterate to get `FedBatch`es in the loader's order; call `release(batch)` once the trunk is queued on its
    inputs, and `close()` when done (see the module docstring)."""

    def __init__(self, loader, to_images, *, device: torch.device, dtype: torch.dtype, rows: int, resolution: int,
                 pad: bool, normalise=normalise) -> None:  # fmt: skip
        """`to_images(blobs, bad)` -> (resized uint8 batch of the good images or None, error), on `device`;
        `normalise(batch, dtype)`: the backbone's (ImageNet mean and std unless given)."""
        self.to_images, self.device, self.dtype, self.pad = to_images, device, dtype, pad
        self.normalise = normalise
        on_gpu = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if on_gpu else None
        new_event = torch.cuda.Event if on_gpu else _Done
        self.free: queue.Queue[InputSlot] = queue.Queue()
        # DEPTH queued, one being filled, one the trunk is being queued on: the thread never waits on the GPU
        with torch.inference_mode():
            for _ in range(DEPTH + 2):
                shape = (rows, 3, resolution, resolution)
                inputs = torch.empty(shape, dtype=dtype, device=device, memory_format=torch.channels_last)
                if on_gpu:  # allocated on the compute stream, written on the feed stream
                    inputs.record_stream(self.stream)
                self.free.put(InputSlot(inputs, new_event(), new_event()))
        self.ready: queue.Queue = queue.Queue(maxsize=DEPTH)
        self.stop = threading.Event()
        # Started here, in the main thread: the loader's worker processes get its signal handling.
        self.batches = iter(loader)
        self.thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self.thread.start()

    # --- main thread -------------------------------------------------------------------------------------

    def __iter__(self):
        while True:
            item = self.ready.get()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.error
            if item.slot is not None and self.stream is not None:
                item.slot.ready.wait(torch.cuda.current_stream(self.device))
                if item.images is not None:
                    item.images.record_stream(torch.cuda.current_stream(self.device))
            yield item

    def release(self, batch: FedBatch) -> None:
        """The trunk's work on `batch.inputs` is queued: the slot may be refilled once the GPU gets past it."""
        if batch.slot is not None:
            if self.stream is not None:
                batch.slot.consumed.record(torch.cuda.current_stream(self.device))
            self.free.put(batch.slot)
            batch.slot = None

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread. One blocked on the loader (a file that will not read) is left to end with the
        process after `timeout_s`: it is a daemon, and stops at its next step."""
        self.stop.set()
        self.thread.join(timeout_s)
        if not self.thread.is_alive():
            self.batches = None  # shuts the loader's workers down
        while True:  # drop what was queued, images and all
            try:
                self.ready.get_nowait()
            except queue.Empty:
                break

    # --- the thread ---------------------------------------------------------------------------------------

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.ready.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                pass
        return False

    def _free_slot(self) -> InputSlot | None:
        while not self.stop.is_set():
            try:
                return self.free.get(timeout=POLL_S)
            except queue.Empty:
                pass
        return None

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                if self.stream is None:
                    self._feed()
                else:
                    with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                        self._feed()
            self._put(_END)
        except BaseException as error:  # noqa: BLE001 (raised again in the main thread)
            self._put(_Failed(error))

    def _feed(self) -> None:
        for split, rows, blobs, bad, error in self.batches:
            if self.stop.is_set():
                return
            images = None
            if error is None:  # `decode_jpegs` drains this thread's stream (the feed stream) before nvjpeg writes
                images, error = self.to_images(blobs, bad)
            batch = FedBatch(split, rows, bad, images, 0 if images is None else len(images), None, error)
            if images is not None:
                batch.slot = self._fill(images)
                if batch.slot is None:
                    return
                batch.padded = self.pad
            if not self._put(batch) or error is not None:
                return

    def _fill(self, images: torch.Tensor) -> InputSlot | None:
        slot = self._free_slot()
        if slot is None:
            return None
        if self.stream is not None:
            slot.consumed.wait(self.stream)  # no-op until the slot has been used once
        count = len(images)
        slot.inputs[:count].copy_(self.normalise(images, self.dtype))
        if self.pad and count < len(slot.inputs):
            rest = slot.inputs[count:]
            rest.copy_(slot.inputs[count - 1 : count].expand_as(rest))
        slot.ready.record(self.stream)
        return slot
