"""Tiny synthetic caches for the stage-two tests, written through `cache.write` in the real HDF5 format."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from rich.console import Console

from spml_cache import cache
from spml_cache.protocol import expected_positives, observe_labels


def synthetic_split(rng: np.random.Generator, rows: int, classes: int, dim: int, directions: np.ndarray,
                    noise: float) -> tuple[np.ndarray, np.ndarray]:
    """Labels with 1-3 positives per row; features = sum of the positive classes' directions + noise."""
    labels = np.zeros((rows, classes), dtype=np.uint8)
    for row in range(rows):
        labels[row, rng.choice(classes, size=rng.integers(1, 4), replace=False)] = 1
    features = labels @ directions + noise * rng.standard_normal((rows, dim))
    return features.astype(np.float32), labels


def write_synthetic_cache(path: Path, *, train: int = 96, val: int = 32, test: int = 48, classes: int = 5,
                          dim: int = 16, noise: float = 1.0, dataset: str = "voc", seed: int = 0) -> Path:
    """A complete cache whose labels are learnable from the features (single positives drawn as the protocol does)."""
    rng = np.random.default_rng(seed)
    directions = rng.standard_normal((classes, dim))
    splits = {}
    for name, rows in (("train", train), ("val", val), ("test", test)):
        features, labels = synthetic_split(rng, rows, classes, dim, directions, noise)
        split = {"features": features, "labels": labels, "ids": [f"{name}/{i:05d}.jpg" for i in range(rows)]}
        if name != "test":
            split["observed"] = observe_labels(labels)
        splits[name] = split
    names = [f"class{c}" for c in range(classes)]
    attrs = {
        "dataset": dataset, "classes": json.dumps(names), "num_classes": classes, "backbone": "resnet50",
        "weights": "none", "resolution": 448, "feature_dim": dim, "split_seed": 1200, "val_frac": 0.2,
        "observe_seed": 1200, "num_pos": 1, "num_neg": 0,
        "expected_positives": expected_positives(np.concatenate([splits["train"]["labels"], splits["val"]["labels"]])),
    }
    return cache.write(path, attrs=attrs, **splits)


def reordering_step(rows: int, classes: int) -> float:
    """The least change of mAP (points, 0-100) that two adjacent scores of one class swapping or tying make, over
    `rows` rows and `classes` classes: a positive at rank r moving past (or tying with) the score after it changes
    its class's AP by i / (P r (r + 1)), with i >= 1 positives at or above it, P <= rows positives and r < rows,
    so by at least 1 / (rows^2 (rows - 1)), and the mAP by that over `classes`.

    Why the tests that compare a head in a stack of K with the same head alone (or in a sweep, an lr group, a
    class block) use it: the two run their elementwise ops at other places of other shapes, and ATen's AVX2 /
    AVX-512 kernels round a tensor's last elements (a scalar loop) otherwise than the rest, so the heads agree
    to float32 rounding, not bit for bit. Their scores then rank alike unless two of them are within that
    rounding (continuous synthetic scores are ~1e-2 apart), and equal rankings give mAPs equal to float64's
    rounding. A mAP tolerance below this step asserts exactly that: the same ranking of every class's scores,
    whatever the CPU's vector instructions; and with it, the same best epochs and selection."""
    return 100 / (classes * rows * rows * (rows - 1))


def quiet() -> Console:
    """A console that swallows the live table: tests read the run directory instead."""
    return Console(file=io.StringIO())


def interrupted_run(out: Path, cache_path: Path, monkeypatch, parts: int, **grid) -> Path:
    """A `run_linear` stopped by Ctrl-C right after its `parts`-th part was kept; returns its run directory."""
    import pytest

    from spml_cache.linear import run_linear
    from spml_cache.linear.parts import KeptParts
    from spml_cache.runtime.errors import Interrupted

    keep, kept = KeptParts.keep, []

    def stopped_after(self, *args):
        keep(self, *args)
        kept.append(args)
        if len(kept) == parts:
            raise KeyboardInterrupt

    monkeypatch.setattr(KeptParts, "keep", stopped_after)
    with pytest.raises(Interrupted):
        run_linear(cache=cache_path, out=out, console=quiet(), **grid)
    monkeypatch.setattr(KeptParts, "keep", keep)
    (run_dir,) = (Path(out) / "voc").iterdir()
    return run_dir


def add_text_side(path: Path, *, grid: int | None = None, width: int = 6, seed: int = 0) -> Path:
    """Hand-add a CLIP cache's text side to a cache (the contract of docs/internals.md, "The text side"): class
    text embeddings and, per split, image embeddings that lean towards the image's classes (and a crop grid's)."""
    import h5py

    from spml_cache.cache.reading import file_checksum

    rng = np.random.default_rng(seed)

    def unit(array: np.ndarray) -> np.ndarray:
        return (array / np.linalg.norm(array, axis=-1, keepdims=True)).astype(np.float32)

    with h5py.File(path, "r+") as file:
        classes = int(file.attrs["num_classes"])
        text = unit(rng.standard_normal((classes, width)))
        file.create_group("text").create_dataset("embeddings", data=text)
        file["text"].attrs["templates"] = json.dumps(["a photo of a {}."])
        file.attrs["backbone"] = "clip:ViT-B-16/openai"
        for split in ("train", "val", "test"):
            labels = file[split]["labels"][...].astype(np.float32)
            file[split].create_dataset("image_embeddings",
                                       data=unit(labels @ text + 0.5 * rng.standard_normal((len(labels), width))))
            if grid:
                crops = labels[:, None, :] @ text + rng.standard_normal((len(labels), grid * grid, width))
                file[split].create_dataset("crop_embeddings", data=unit(crops))
                file[split]["crop_embeddings"].attrs["grid"] = grid
        file.attrs["content_hash"] = file_checksum(file)  # sealed again, as extract seals a CLIP cache
    return path
