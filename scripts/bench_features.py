"""What a multi-layer (`--features last4`) cache costs next to the pooled one, per backbone: its width and bytes
per image, `extract`'s time end to end, and stage two's time on features of that width; as JSON under
docs/benchmarks/.

For each backbone and feature kind: `spml_cache.extract.extract` on `--images` VOC-like JPEGs (random weights,
`--resolution` unless the backbone fixes its own, e.g. torchvision's ViTs at 224), timed over its extraction loop
(model loading excluded); the cache's bytes per image (file size over rows); then `linear` on a synthetic cache
of that width (`--rows` training rows, VOC's 20 classes, one loss, the papers' four lrs and two batch sizes,
`--epochs` epochs), timed from the command's start to its results; and the trunk alone, pooled and last4
interleaved (`--trunk-repeats` forward passes of one batch each, one thread, the median per image): the figure
that says what the kind itself costs, which the end-to-end times (decoding included) blur. The kinds of a backbone are measured in turn,
`--repeats` times, and each figure is the fastest of its repeats: on a shared machine the other jobs' load comes
and goes, and alternating keeps it from landing on one kind.

Examples:
    python scripts/bench_features.py                        # the CPU defaults: small, under a minute each
    python scripts/bench_features.py --device cuda --images 2000 --resolution 224 --rows 5000 --epochs 5
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(REPO / "scripts"))

from bench_extract import device_name, write_images  # noqa: E402

from spml_cache import backbones, cache  # noqa: E402
from spml_cache.backbones.checkpoints import RandomWeightsWarning  # noqa: E402
from spml_cache.extract import extract  # noqa: E402
from spml_cache.linear import run_linear  # noqa: E402
from spml_cache.protocol import observe_labels  # noqa: E402

BACKBONES = ("resnet50", "convnext_tiny", "vit_b_16", "timm:vit_small_patch16_224", "clip:ViT-B-16")
FIXED_SIDE = {"vit_b_16": 224}  # torchvision's ViTs take their own input size only
CLASSES = 20


def synthetic_cache(path: Path, width: int, rows: int, seed: int = 0) -> Path:
    """A complete cache of `rows` training, a quarter as many val and test rows, `width`-d Gaussian features."""
    rng = np.random.default_rng(seed)
    splits = {}
    for name, count in (("train", rows), ("val", rows // 4), ("test", rows // 4)):
        labels = (rng.random((count, CLASSES)) < 0.08).astype(np.uint8)
        labels[np.arange(count), rng.integers(0, CLASSES, count)] = 1
        split = {"features": rng.standard_normal((count, width), dtype=np.float32), "labels": labels,
                 "ids": [f"{name}/{i}.jpg" for i in range(count)]}
        if name != "test":
            split["observed"] = observe_labels(labels)
        splits[name] = split
    attrs = {"dataset": "voc", "classes": json.dumps([f"c{i}" for i in range(CLASSES)]), "num_classes": CLASSES,
             "backbone": "synthetic", "weights": "none", "resolution": 0, "feature_dim": width, "split_seed": 1200,
             "val_frac": 0.2, "observe_seed": 1200, "num_pos": 1, "num_neg": 0, "expected_positives": 1.5}
    return cache.write(path, attrs=attrs, **splits)


def fastest(runs: list[dict]) -> dict:
    """One kind's repeats as one row: the fastest extraction and the fastest linear run, each time listed."""
    best = dict(min(runs, key=lambda run: run["extract_s"]))
    best["linear_s"] = min(run["linear_s"] for run in runs)
    best["extract_s_each"] = [run["extract_s"] for run in runs]
    best["linear_s_each"] = [run["linear_s"] for run in runs]
    return best


@torch.inference_mode()
def trunk_seconds(backbone: str, side: int, args) -> dict[str, float]:
    """Per kind, the median seconds per image of the trunk alone on one batch, the kinds interleaved."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RandomWeightsWarning)
            trunks = {kind: backbones.build(backbones.describe(backbone, "none", side, features=kind)).eval()
                      .requires_grad_(False).to(memory_format=torch.channels_last) for kind in backbones.FEATURES}
        described = backbones.describe(backbone, "none", side)
        batch = torch.randn(args.batch_size, 3, described.preprocess.resolution, described.preprocess.resolution)
        batch = batch.contiguous(memory_format=torch.channels_last)
        times = {kind: [] for kind in trunks}
        for repeat in range(args.trunk_repeats + 1):  # the first pass of each is a warm-up
            for kind, trunk in trunks.items():
                start = time.perf_counter()
                trunk(batch)
                if repeat:
                    times[kind].append((time.perf_counter() - start) / len(batch))
        return {kind: round(float(np.median(values)), 4) for kind, values in times.items()}
    finally:
        torch.set_num_threads(threads)


def measure_one(backbone: str, kind: str, folder: Path, args) -> dict:
    side = FIXED_SIDE.get(backbone, args.resolution)
    described = backbones.describe(backbone, "none", side, features=kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RandomWeightsWarning)
        report = extract("csv", folder, out=folder / f"{described.slug}.h5", backbone=backbone, weights="none",
                         resolution=side, features=kind, batch_size=args.batch_size, workers=0, device=args.device,
                         force=True)
    rows = sum(report.counts.values())
    linear_cache = synthetic_cache(folder / f"linear-{described.feature_dim}.h5", described.feature_dim, args.rows)
    start = time.perf_counter()
    run_linear(cache=linear_cache, losses=args.loss, epochs=args.epochs, device=args.device, out=folder / "runs",
               console=Console(file=io.StringIO()))
    linear_s = time.perf_counter() - start
    return {"backbone": backbone, "features": kind, "resolution": side, "feature_dim": described.feature_dim,
            "row_width": described.row_width, "feature_bytes_per_image": 4 * described.row_width,
            "file_bytes_per_image": round(report.path.stat().st_size / rows), "extract_images": report.extracted,
            "extract_s": round(report.seconds, 2), "extract_images_per_s": round(report.images_per_s, 2),
            "linear_rows": args.rows, "linear_epochs": args.epochs, "linear_heads": 8, "linear_s": round(linear_s, 2)}


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbones", default=",".join(BACKBONES))
    parser.add_argument("--images", type=int, default=40)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1000, help="training rows of stage two's synthetic cache")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--loss", default="an")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--trunk-repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=None, help="default docs/benchmarks/features-<device>.json")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_images(folder, args.images, unique=min(args.images, 16))
        for backbone in args.backbones.split(","):
            runs = {kind: [] for kind in backbones.FEATURES}
            for _ in range(args.repeats):
                for kind in backbones.FEATURES:
                    runs[kind].append(measure_one(backbone, kind, folder, args))
            trunk = trunk_seconds(backbone, FIXED_SIDE.get(backbone, args.resolution), args)
            for kind in backbones.FEATURES:
                results.append({**fastest(runs[kind]), "trunk_s_per_image_1_thread": trunk[kind]})
                print(json.dumps(results[-1]), flush=True)
    device = torch.device(args.device)
    named = "cpu" if device.type == "cpu" else "gpu"
    path = args.json or REPO / "docs" / "benchmarks" / f"features-{named}.json"
    path.write_text(json.dumps({
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": device_name(device),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
        "args": {key: str(value) for key, value in vars(args).items()}, "results": results,
    }, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
