"""Stage-one throughput: images/s end to end from JPEG files, of decoding alone, and of the backbone alone.

Writes VOC-sized JPEGs (500x375 and 375x500, smooth content plus noise, ~50-100 KB like photos) into a
temporary folder as a CSV dataset, then measures at each resolution:

- end to end: `spml_cache.extract.extract` on them (read, decode, resize, normalise, ResNet-50, HDF5 write),
  timed over the extraction loop (model loading excluded);
- decode + resize: the loader's work alone, in this process (on the GPU with nvjpeg when the device is one);
- backbone: the trunk alone on a random batch already on the device, after a warm-up.

Example: python scripts/bench_extract.py --images 64 --resolutions 448 224 --batch-size 16
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from spml_cache import backbone  # noqa: E402
from spml_cache.devices import resolve_device  # noqa: E402
from spml_cache.extract import PRECISIONS, extract  # noqa: E402


def write_images(folder: Path, count: int, seed: int = 0) -> list[Path]:
    """VOC-like JPEGs plus labels.csv (one class per image, 20% test) so `extract csv` reads them."""
    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True)
    lines, paths = ["path,labels,split"], []
    for k in range(count):
        height, width = (375, 500) if k % 3 else (500, 375)
        y, x = np.mgrid[0:height, 0:width]
        base = 128 + 60 * np.sin(x / rng.uniform(20, 80))[..., None] * np.cos(y / rng.uniform(20, 80))[..., None]
        pixels = base + rng.normal(0, 12, size=(height, width, 3)) + rng.uniform(-40, 40, size=3)
        path = folder / "images" / f"{k:05d}.jpg"
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, quality=90)
        paths.append(path)
        lines.append(f"images/{k:05d}.jpg,class{k % 5},{'test' if k % 5 == 0 else 'train'}")
    (folder / "labels.csv").write_text("\n".join(lines) + "\n")
    return paths


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_decode(paths: list[Path], resolution: int, batch_size: int, device: torch.device, dtype) -> float:
    """images/s of reading, decoding, resizing and normalising (what the loader does), in this process."""
    start = time.perf_counter()
    for begin in range(0, len(paths), batch_size):
        blobs = [path.read_bytes() for path in paths[begin : begin + batch_size]]
        backbone.preprocess(backbone.decode_jpegs(blobs, device), resolution, device, dtype)
    sync(device)
    return len(paths) / (time.perf_counter() - start)


def time_backbone(trunk, resolution: int, batch_size: int, batches: int, device: torch.device, dtype) -> float:
    """images/s of the trunk alone on a batch already on the device (after one warm-up pass)."""
    batch = torch.randn(batch_size, 3, resolution, resolution, device=device).to(dtype)
    batch = batch.contiguous(memory_format=torch.channels_last)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    with torch.inference_mode(), autocast:
        trunk(batch)
        sync(device)
        start = time.perf_counter()
        for _ in range(batches):
            trunk(batch)
        sync(device)
    return batches * batch_size / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=512, help="JPEGs to generate (the CPU needs few)")
    parser.add_argument("--resolutions", type=int, nargs="+", default=[448, 224])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--backbone-batches", type=int, default=10, help="timed batches of the backbone alone")
    parser.add_argument("--workers", type=int, default=None, help="loader processes (default: extract's)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="auto", choices=["auto", *PRECISIONS])
    args = parser.parse_args()

    device = resolve_device(args.device)
    precision = args.precision if args.precision != "auto" else ("fp16" if device.type == "cuda" else "fp32")
    dtype = PRECISIONS[precision]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {name}; precision {precision}; batch {args.batch_size}; torch {torch.__version__}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", backbone.RandomWeightsWarning)
        trunk, _ = backbone.build_trunk("none")  # speed does not depend on the weights' values
    trunk = trunk.eval().requires_grad_(False).to(device, memory_format=torch.channels_last)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-extract-") as tmp:
        folder = Path(tmp) / "data"
        paths = write_images(folder, args.images)
        size_kb = sum(path.stat().st_size for path in paths) / len(paths) / 1024
        print(f"{len(paths)} JPEGs, mean {size_kb:.0f} KB")
        for resolution in args.resolutions:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", backbone.RandomWeightsWarning)
                report = extract(
                    "csv", folder, out=Path(tmp) / f"cache-{resolution}.h5", weights="none", resolution=resolution,
                    batch_size=args.batch_size, workers=args.workers, device=args.device, precision=precision,
                )  # fmt: skip
            rows.append(("end to end (extract)", resolution, report.extracted, report.images_per_s))
            decode_rate = time_decode(paths, resolution, args.batch_size, device, dtype)
            rows.append(("decode + resize", resolution, len(paths), decode_rate))
            count = args.backbone_batches * args.batch_size
            trunk_rate = time_backbone(trunk, resolution, args.batch_size, args.backbone_batches, device, dtype)
            rows.append(("backbone alone", resolution, count, trunk_rate))
    print("\n| stage | R | images | images/s |\n|---|---|---|---|")
    for stage, resolution, count, rate in rows:
        print(f"| {stage} | {resolution} | {count} | {rate:.1f} |")


if __name__ == "__main__":
    main()
