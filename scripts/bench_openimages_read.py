"""Peak memory of reading OpenImages-scale labels and drawing the protocol on them, without a dense [N, C] matrix.

Writes a synthetic label set in the OpenImages V6 layout (class descriptions, trainable classes, the train and test
human-verified label CSVs; no images) under a temporary folder: `--images` training images (a tenth as many test
images), `--classes` trainable classes, about `--per-image` verified labels per image (60 % of them present).
Then, in a fresh process (so the figures are the reader's, not the generator's), reads the labels with
`datasets.openimages.read_labels` (the reader less its look for image files) and applies the protocol
(`protocol.apply_protocol`: the train/val split, the observed labels), taking the peak resident set size
(`resource.getrusage(...).ru_maxrss`) after the imports, after reading and after the protocol. Dense, the labels and
the mask alone would be 2 x N x C bytes.

Usage: python scripts/bench_openimages_read.py [--images 200000] [--classes 9605] [--per-image 8]
       [--json docs/benchmarks/openimages-read-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_linear import cpu_name  # noqa: E402

from spml_cache.runtime.memory import peak_resident as peak_rss  # noqa: E402


def generate(folder: Path, images: int, classes: int, per_image: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    names = [f"/m/{k:07x}" for k in range(classes)]
    (folder / "oidv6-class-descriptions.csv").write_text(
        "LabelName,DisplayName\n" + "".join(f"{n},Class {k}\n" for k, n in enumerate(names)))
    (folder / "oidv6-classes-trainable.txt").write_text("\n".join(names) + "\n")
    lines = 0
    for split, count in (("train", images), ("test", max(1, images // 10))):
        per = rng.poisson(per_image, size=count)
        image = np.repeat(np.arange(count), per)
        label = rng.integers(0, classes, size=len(image))
        present = rng.random(len(image)) < 0.6
        with open(folder / f"oidv6-{split}-annotations-human-imagelabels.csv", "w") as file:
            file.write("ImageID,Source,LabelName,Confidence\n")
            for start in range(0, len(image), 1 << 18):
                stop = start + (1 << 18)
                file.write("".join(f"{split[:2]}{i:014x},verification,{names[c]},{int(p)}\n" for i, c, p in
                                   zip(image[start:stop], label[start:stop], present[start:stop])))
        lines += len(image)
    return {"lines": lines}


def measure(folder: Path) -> dict:
    """In this process: the reader, then the protocol; peak RSS after each."""
    from spml_cache import protocol
    from spml_cache.datasets.base import LabeledImages
    from spml_cache.datasets.openimages import read_labels

    figures = {"peak_rss_after_imports": peak_rss()}
    started = time.perf_counter()
    classes, train, test, notes, _ = read_labels(folder)
    figures["read_seconds"] = round(time.perf_counter() - started, 2)
    figures["peak_rss_after_read"] = peak_rss()
    figures.update(train_images=len(train), test_images=len(test), classes=len(classes),
                   train_positives=train.labels.nnz, train_verified=train.mask.nnz, notes=notes,
                   label_bytes_sparse=sum(m.nbytes() for s in (train, test) for m in (s.labels, s.mask)))
    images = LabeledImages(dataset="openimages", root=folder, classes=classes, train=train, test=test, notes=notes)
    started = time.perf_counter()
    result = protocol.apply_protocol(images)
    figures["protocol_seconds"] = round(time.perf_counter() - started, 2)
    figures["peak_rss_after_protocol"] = peak_rss()
    figures["observed_entries"] = int(result.train.observed.nnz + result.val.observed.nnz)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=200_000)
    parser.add_argument("--classes", type=int, default=9605)
    parser.add_argument("--per-image", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--generate", type=Path, default=None, help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--measure", type=Path, default=None, help=argparse.SUPPRESS)  # another
    args = parser.parse_args()
    if args.generate is not None:
        started = time.perf_counter()
        generated = generate(args.generate, args.images, args.classes, args.per_image)
        print(json.dumps({**generated, "generate_seconds": round(time.perf_counter() - started, 1)}))
        return
    if args.measure is not None:
        print(json.dumps(measure(args.measure)))
        return
    folder = Path(tempfile.mkdtemp(prefix="bench-openimages-"))
    # Each step in a process of its own, this one staying small: Linux carries a process's peak RSS across
    # fork and exec, so a measuring child forked from a parent that had generated the files would report it.
    sizes = ["--images", str(args.images), "--classes", str(args.classes), "--per-image", str(args.per_image)]
    try:
        generated, figures = (json.loads(subprocess.run(
            [sys.executable, __file__, *sizes, step, str(folder)], check=True, capture_output=True, text=True,
        ).stdout.strip().splitlines()[-1]) for step in ("--generate", "--measure"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows = figures["train_images"] + figures["test_images"]
    report = {
        "what": "OpenImages-layout labels: read_labels (sparse labels and mask) then apply_protocol, peak RSS",
        "cpu": cpu_name(), "python": platform.python_version(), "numpy": np.__version__,
        "images": args.images, "classes": args.classes, "per_image": args.per_image, **generated, **figures,
        "dense_labels_and_mask_bytes": 2 * rows * args.classes,
        "peak_rss_increase_over_imports": figures["peak_rss_after_protocol"] - figures["peak_rss_after_imports"],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
