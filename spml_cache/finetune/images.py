"""Stage three's images: the cache's rows on disk, the batches of one or several processes (their collectives are
in parallel.py), and the device-side preprocessing and augmentation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from spml_cache import datasets
from spml_cache.backbones.preprocess import Preprocess
from spml_cache.datasets.base import find_missing
from spml_cache.images import decode_jpegs
from spml_cache.runtime.children import loader_worker_init
from spml_cache.runtime.errors import SpmlError

EVAL_BATCH_SIZE = 32
MISSING_SHOWN = 3


# --- images on disk --------------------------------------------------------------------------------------


def usable_rows(dataset: str, root: Path, ids: dict[str, list[str]], skip_missing: bool) -> tuple[Path, dict, str]:
    """The folder the ids are relative to (the dataset's layout at `root` or `root/<dataset>`), the rows per
    split whose image exists there, and a note on those left out; missing images are refused unless skipped."""
    if dataset in datasets.names():
        try:
            found = datasets.resolve_root(dataset, root)
            root = found.parent if found.is_file() else found  # a CSV root: ids are relative to its folder
        except SpmlError:
            pass  # annotations elsewhere or gone: the images may still be under root; the count below decides
    gone = {split: set(find_missing(root, split_ids)) for split, split_ids in ids.items()}
    rows = {split: np.array([r for r, i in enumerate(split_ids) if i not in gone[split]], dtype=np.int64)
            for split, split_ids in ids.items()}
    missing = [i for split, split_ids in ids.items() for i in split_ids if i in gone[split]]
    if not missing:
        return root, rows, ""
    shown = ", ".join(missing[:MISSING_SHOWN]) + (", ..." if len(missing) > MISSING_SHOWN else "")
    total = sum(map(len, ids.values()))
    if len(missing) == total:  # a wrong folder, not a few lost files: --skip-missing would leave nothing
        where = "does not exist" if not root.exists() else f"holds none of the cache's {total} images (e.g. {missing[0]})"
        raise SpmlError(f"the image root {root} {where}: pass --root DIR, the folder the cache was extracted from"
                        f" (its {dataset} images)")
    described = f"{len(missing)} of {total} images are missing under {root} ({shown})"
    if not skip_missing:
        raise SpmlError(f"{described}: pass --root DIR where the images are, or leave them out with --skip-missing")
    if any(len(split_rows) == 0 for split_rows in rows.values()):
        raise SpmlError(f"{described}, and a split has none left: check --root")
    return root, rows, f"skipping: {described}"


class ImageFiles(Dataset):
    """Item `row` is (row, the file's bytes) or, with `decode` cpu (libjpeg-turbo in the reader processes), (row,
    the decoded uint8 image); with gpu, nvjpeg decodes the bytes on the device.

    Workers only read (and, for cpu, decode); resizing, flipping and normalising happen on the device.
    """

    def __init__(self, root: Path, ids: list[str], decode: str) -> None:
        self.paths = [root / i for i in ids]
        self.in_workers = decode == "cpu"

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, row: int):
        blob = torch.from_numpy(np.fromfile(self.paths[row], dtype=np.uint8))
        if self.in_workers:
            return row, decode_jpegs([blob], "cpu")[0]
        return row, blob


def _collate(items: list) -> tuple[list[int], list[torch.Tensor]]:
    return [row for row, _ in items], [image for _, image in items]


class EpochBatches(Sampler):
    """Training batches: a permutation of `rows` per epoch, cut into global batches of `batch_size` (a trailing
    partial batch is dropped, as the reference's training loader does); a process takes its contiguous share
    of each. `flips[row]` says whether the row's image is mirrored this epoch."""

    def __init__(self, rows: np.ndarray, num_rows_total: int, batch_size: int, seed: int, rank: int, world: int):
        self.rows, self.num_rows_total = torch.as_tensor(rows, dtype=torch.long), num_rows_total
        self.batch_size, self.share = batch_size, batch_size // world
        self.seed, self.rank = seed, rank
        self.set_epoch(1)

    def set_epoch(self, epoch: int) -> None:
        # (seed, epoch) alone decide the epoch's order and flips, so a resumed run redraws them exactly.
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        self.order = self.rows[torch.randperm(len(self.rows), generator=generator)]
        self.flips = torch.rand(self.num_rows_total, generator=generator) < 0.5

    def __len__(self) -> int:
        return len(self.rows) // self.batch_size

    def __iter__(self):
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            mine = start + self.rank * self.share
            yield self.order[mine : mine + self.share].tolist()


class ShardBatches(Sampler):
    """Evaluation batches: this process's contiguous shard of `rows`, in order."""

    def __init__(self, rows: np.ndarray, rank: int, world: int, batch_size: int = EVAL_BATCH_SIZE):
        bounds = np.linspace(0, len(rows), world + 1).round().astype(int)
        self.rows = [int(r) for r in rows[bounds[rank] : bounds[rank + 1]]]
        self.counts = np.diff(bounds).tolist()
        self.batch_size = batch_size

    def __len__(self) -> int:
        return -(-len(self.rows) // self.batch_size)

    def __iter__(self):
        for start in range(0, len(self.rows), self.batch_size):
            yield self.rows[start : start + self.batch_size]


def loader(files: ImageFiles, batches: Sampler, workers: int) -> DataLoader:
    return DataLoader(files, batch_sampler=batches, num_workers=workers, collate_fn=_collate,
                      persistent_workers=workers > 0, worker_init_fn=loader_worker_init())


def model_input(images: list[torch.Tensor], preprocess: Preprocess | int, device: torch.device,
                flips: torch.Tensor | None = None):
    """Decode (when given bytes) and preprocess on the device (the backbone's `preprocess`; a side R: the papers'
    R x R squash); mirror the rows where `flips` is set."""
    if images and images[0].dim() == 1:
        images = decode_jpegs(images, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    preprocess = Preprocess(preprocess) if isinstance(preprocess, int) else preprocess
    batch = preprocess(images, device, dtype)
    if flips is not None:
        # Mirroring commutes with the resize and the per-channel normalisation, so it can come last (with a
        # centre crop, up to the one-pixel shift of a crop whose margins differ by one).
        mask = flips.to(device).view(-1, 1, 1, 1)
        batch = torch.where(mask, batch.flip(-1), batch).contiguous(memory_format=torch.channels_last)
    return batch
