"""Stage-one throughput on one device: end to end, decoding alone and the trunk alone, and their ratio; the trunk
in each precision and layout on offer with its deviation from fp32; all of it as JSON under docs/benchmarks/.

Writes VOC-sized JPEGs (500x375 and 375x500, smooth content plus noise, ~50-100 KB like photos; `--unique` of
them distinct, the rest copies under other names) as a CSV dataset in a temporary folder, then measures:

- end to end: `spml_cache.extract.extract` on them (read, decode, resize, normalise, ResNet-50, HDF5 write),
  timed over the extraction loop (model loading excluded), twice: the first run pays cuDNN's autotuning and
  nvjpeg's start, the second is the steady state a large dataset sees;
- decode: decoding, resizing and normalising batches whose bytes are already in memory, in this process (with
  nvjpeg on a GPU), as extract's feed thread does;
- trunk: the trunk alone on a batch of those images already on the device, in extract's own precision and
  layout (the ratio's denominator), and in every variant of `--variants` (fp32/fp16/bf16, channels_last or
  not; with `--compile`, torch.compile'd too, its compile time counted apart), each with its largest deviation
  from fp32 features of the same batch: max over rows of max |f - f32| / max |f32| (fp32 with TF32 off).

`--decode cpu` runs the end-to-end extractions with the loader workers decoding and resizing (extract's
`--decode cpu`: the CPU's pixels); the decode figure stays this process's (scripts/bench_decode.py gives the CPU
decoder's rate per core).

`--backbone NAME` measures any registered backbone (extract's `--backbone`: resnet50 by default, timm:NAME,
clip:ARCH/TAG, ...) at its own preprocessing and resolution unless `--resolution` is given.

Examples:
    python scripts/bench_extract.py                     # a GPU: 10,000 images at 448 px, batch 64
    python scripts/bench_extract.py --images 96 --resolution 224 --batch-size 16 --trunk-batches 2   # a CPU
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import re
import sys
import tempfile
import time
import warnings
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torchvision
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import spml_cache  # noqa: E402
from spml_cache import backbones  # noqa: E402
from spml_cache.backbones.checkpoints import RandomWeightsWarning
from spml_cache.extract import PRECISIONS, extract  # noqa: E402
from spml_cache.images import decode_jpegs
from spml_cache.runtime.devices import resolve_device  # noqa: E402

VARIANTS = ("fp32", "fp32-cl", "fp16", "fp16-cl", "bf16", "bf16-cl")  # -cl: channels_last


def write_images(folder: Path, count: int, unique: int, seed: int = 0) -> list[Path]:
    """VOC-like JPEGs plus labels.csv (one class per image, 20% test) so `extract csv` reads them."""
    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True)
    lines, paths, blobs = ["path,labels,split"], [], []
    for k in range(count):
        path = folder / "images" / f"{k:05d}.jpg"
        if k < unique:
            height, width = (375, 500) if k % 3 else (500, 375)
            y, x = np.mgrid[0:height, 0:width]
            base = 128 + 60 * np.sin(x / rng.uniform(20, 80))[..., None] * np.cos(y / rng.uniform(20, 80))[..., None]
            pixels = base + rng.normal(0, 12, size=(height, width, 3)) + rng.uniform(-40, 40, size=3)
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, quality=90)
            blobs.append(path.read_bytes())
        else:
            path.write_bytes(blobs[k % unique])
        paths.append(path)
        lines.append(f"images/{k:05d}.jpg,class{k % 5},{'test' if k % 5 == 0 else 'train'}")
    (folder / "labels.csv").write_text("\n".join(lines) + "\n")
    return paths


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def slug(device: torch.device, name: str) -> str:
    return "cpu" if device.type == "cpu" else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def decode_rate(blobs: list[bytes], preprocess, batch_size: int, device: torch.device, dtype) -> float:
    """images/s of decode + resize + normalise from bytes in memory (one untimed batch first: nvjpeg's start);
    `preprocess`: the backbone's (backbones.preprocess.Preprocess)."""
    batches = [blobs[i : i + batch_size] for i in range(0, len(blobs), batch_size)]
    preprocess(decode_jpegs(batches[0], device), device, dtype)
    sync(device)
    start = time.perf_counter()
    for batch in batches:
        preprocess(decode_jpegs(batch, device), device, dtype)
    sync(device)
    return len(blobs) / (time.perf_counter() - start)


def run_trunk(trunk, batch: torch.Tensor, dtype, channels_last: bool, repeats: int, device) -> dict:
    """The trunk on `batch` (normalised float32 NCHW): features of the first call, its seconds, then images/s."""
    inputs = batch.to(dtype)
    if channels_last:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    with torch.inference_mode(), autocast:
        sync(device)
        start = time.perf_counter()
        features = trunk(inputs).float()
        sync(device)
        first = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(repeats):
            trunk(inputs)
        sync(device)
        rate = repeats * len(batch) / (time.perf_counter() - start)
    return {"features": features.cpu().numpy(), "first_call_s": first, "images_per_s": rate}


def deviation(features: np.ndarray, reference: np.ndarray) -> tuple[float | None, int]:
    """(max over finite rows of max |f - ref| / max |ref|, rows not finite in either)."""
    finite = np.isfinite(features).all(axis=1) & np.isfinite(reference).all(axis=1)
    if not finite.any():
        return None, int((~finite).sum())
    got, ref = features[finite], reference[finite]
    scale = np.maximum(np.abs(ref).max(axis=1), 1e-12)
    return float((np.abs(got - ref).max(axis=1) / scale).max()), int((~finite).sum())


def trunk_variants(trunk, batch, names, repeats, device, compile_mode) -> list[dict]:
    """Each variant's speed and deviation from fp32 (TF32 off) on the same batch."""
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        reference = run_trunk(trunk, batch, torch.float32, False, 0, device)["features"]
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    plans = [(name, False) for name in names]
    if compile_mode:
        plans += [(name, True) for name in names if name.endswith("-cl")]
    rows = []
    for name, compiled in plans:
        precision, channels_last = name.split("-")[0], name.endswith("-cl")
        model = copy.deepcopy(trunk).to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        compile_s = None
        if compiled:
            start = time.perf_counter()
            model = torch.compile(model, mode=compile_mode)
            compile_s = time.perf_counter() - start  # the real compile happens in the first call, counted there
        result = run_trunk(model, batch, PRECISIONS[precision], channels_last, repeats, device)
        if compiled:
            compile_s += result["first_call_s"]
        max_dev, nonfinite = deviation(result["features"], reference)
        rows.append({
            "variant": name + ("-compiled" if compiled else ""), "precision": precision,
            "channels_last": channels_last, "compiled": compiled, "images_per_s": round(result["images_per_s"], 2),
            "first_call_s": round(result["first_call_s"], 3), "compile_s": compile_s and round(compile_s, 2),
            "max_relative_deviation": max_dev, "nonfinite_rows": nonfinite,
        })  # fmt: skip
        print(f"  trunk {rows[-1]['variant']}: {result['images_per_s']:.1f} img/s, max relative deviation {max_dev}")
    return rows


def end_to_end(folder, out, args, precision, **internal) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RandomWeightsWarning)
        report = extract(
            "csv", folder, out=out, backbone=args.backbone, weights=args.weights, resolution=args.resolution,
            batch_size=args.batch_size,
            workers=args.workers, device=args.device, precision=precision, decode=args.decode, force=True, **internal,
        )  # fmt: skip
    return {"images": report.extracted, "seconds": round(report.seconds, 3),
            "images_per_s": round(report.images_per_s, 2)}  # fmt: skip


def measure(args) -> dict:
    device = resolve_device(args.device)
    precision = args.precision if args.precision != "auto" else ("fp16" if device.type == "cuda" else "fp32")
    dtype = PRECISIONS[precision]
    name = device_name(device)
    images = args.images or (10_000 if device.type == "cuda" else 64)
    described = backbones.describe(args.backbone, args.weights, args.resolution)
    resolution = described.resolution
    print(f"device: {name}; {args.backbone}, {images} images at {resolution} px, batch {args.batch_size}, {precision}")
    torch.backends.cudnn.benchmark = True  # as extract sets it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RandomWeightsWarning)
        trunk, provenance = backbones.build(described), described.provenance
    trunk = trunk.eval().requires_grad_(False).to(device)
    result = {
        "benchmark": "extract", "script": "scripts/bench_extract.py",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": {"type": device.type, "name": name, "threads": torch.get_num_threads()},
        "versions": {"torch": torch.__version__, "torchvision": torchvision.__version__,
                     "spml_cache": spml_cache.__version__, "python": platform.python_version()},
        "settings": {"backbone": described.backbone, "feature_dim": described.feature_dim,
                     "preprocess": described.preprocess.describe(),
                     "images": images, "unique_images": min(images, args.unique), "resolution": resolution,
                     "batch_size": args.batch_size, "workers": args.workers, "precision": precision,
                     "decode": args.decode or ("gpu" if device.type == "cuda" else "cpu"),
                     "weights": provenance, "trunk_batches": args.trunk_batches, "compile": args.compile},
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-extract-") as tmp:
        folder = Path(tmp) / "data"
        start = time.perf_counter()
        paths = write_images(folder, images, min(images, args.unique))
        result["images"] = {"generate_s": round(time.perf_counter() - start, 1),
                            "mean_kb": round(sum(p.stat().st_size for p in paths) / len(paths) / 1024, 1)}  # fmt: skip
        runs = [end_to_end(folder, Path(tmp) / f"run{k}.h5", args, precision) for k in (1, 2)]
        result["end_to_end"] = {"first": runs[0], "warm": runs[1]}
        print(f"  end to end: {runs[0]['images_per_s']} img/s first run, {runs[1]['images_per_s']} warm")
        if args.baseline:  # the path before padding and the feed thread, for a before/after on one device
            result["end_to_end"]["unpadded_no_feed_thread"] = end_to_end(
                folder, Path(tmp) / "baseline.h5", args, precision, pad_batches=False, feed_thread=False
            )
        blobs = [path.read_bytes() for path in paths]
        decode = decode_rate(blobs, described.preprocess, args.batch_size, device, dtype)
        result["decode"] = {"images": len(blobs), "images_per_s": round(decode, 2)}
        print(f"  decode + resize + normalise: {decode:.1f} img/s")
        batch = described.preprocess(decode_jpegs(blobs[: args.batch_size], device), device).contiguous()
        if len(batch) < args.batch_size:
            batch = batch.repeat((args.batch_size + len(batch) - 1) // len(batch), 1, 1, 1)[: args.batch_size]
    alone = run_trunk(copy.deepcopy(trunk).to(memory_format=torch.channels_last), batch, dtype, True,
                      args.trunk_batches, device)  # fmt: skip
    result["trunk"] = {"precision": precision, "channels_last": True, "images_per_s": round(alone["images_per_s"], 2),
                       "first_call_s": round(alone["first_call_s"], 3)}  # fmt: skip
    ratio = {key: round(run["images_per_s"] / alone["images_per_s"], 3) for key, run in zip(("first", "warm"), runs)}
    result["ratio_end_to_end_to_trunk"] = ratio
    print(f"  trunk alone: {alone['images_per_s']:.1f} img/s; end to end / trunk: {ratio}")
    names = [name for name in args.variants.split(",") if name]
    result["trunk_variants"] = trunk_variants(trunk, batch, names, args.trunk_batches, device, args.compile)
    return result


def write_json(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=0, help="JPEGs to generate (default 10000 on a GPU, 64 on a CPU)")
    parser.add_argument("--unique", type=int, default=256, help="distinct images among them; the rest are copies")
    parser.add_argument("--backbone", default=backbones.DEFAULT, help="as extract's --backbone (default resnet50)")
    parser.add_argument("--resolution", type=int, default=None, help="default: the backbone's own (448 for resnet50)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--trunk-batches", type=int, default=20, help="timed batches per trunk measurement")
    parser.add_argument("--workers", type=int, default=None, help="loader processes (default: extract's)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="auto", choices=["auto", *PRECISIONS])
    parser.add_argument("--decode", default=None, choices=["gpu", "cpu"],
                        help="as extract's --decode, for the end-to-end runs (default: gpu on a GPU)")
    parser.add_argument("--weights", default="none", help="none (random; speed does not depend on it) or a .pth")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                        help="also time torch.compile (mode: default, max-autotune, ...) of each -cl variant")
    parser.add_argument("--baseline", action="store_true", help="also time extract without padding or feed thread")
    parser.add_argument("--json", type=Path, default=None, help="default docs/benchmarks/extract-<device>.json")
    args = parser.parse_args(argv)
    unknown = [name for name in args.variants.split(",") if name and name not in VARIANTS]
    if unknown:
        parser.error(f"--variants {','.join(unknown)}: use some of {','.join(VARIANTS)}")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    result = measure(args)
    device = result["device"]
    named = slug(torch.device(device["type"]), device["name"])
    backbone_name = result.get("settings", {}).get("backbone", backbones.DEFAULT)
    named += "" if backbone_name == backbones.DEFAULT else f"-{backbones.slug(backbone_name)}"
    default = REPO / "docs" / "benchmarks" / f"extract-{named}.json"
    path = args.json or default
    print(f"wrote {write_json(result, path)}")


if __name__ == "__main__":
    main()
