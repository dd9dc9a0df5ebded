"""What each `--decode` choice costs: JPEG decoding rates on one device, as JSON under docs/benchmarks/.

- cpu: torchvision's CPU decoder (libjpeg-turbo), what each loader worker runs with `extract --decode cpu`: one
  thread, batches decoded image by image, alone and with the resize to R x R a worker does too; images/s per
  core (N workers on N free cores: about N times that);
- gpu (on a GPU): nvjpeg's batched decode, resize and normalise in this process, as extract's feed thread runs
  them (bench_extract.py's decode figure).

Writes VOC-sized JPEGs as bench_extract.py does (500x375 and 375x500, ~70 KB); `--unique` of them distinct.

    python scripts/bench_decode.py                  # 256 images at 448 px
    python scripts/bench_decode.py --device cuda    # and nvjpeg's rate
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torchvision

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import spml_cache  # noqa: E402
from bench_extract import decode_rate, device_name, slug, write_images  # noqa: E402
from spml_cache.backbones.preprocess import Preprocess  # noqa: E402
from spml_cache.images import decode_jpegs, decoder_version  # noqa: E402
from spml_cache.runtime.devices import resolve_device  # noqa: E402


def cpu_rates(blobs: list[bytes], resolution: int, batch_size: int) -> dict:
    """images/s of one thread: decoding alone, and decoding plus the resize (a loader worker's work)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    preprocess = Preprocess(resolution)
    batches = [blobs[i : i + batch_size] for i in range(0, len(blobs), batch_size)]
    try:
        rates = {}
        for name, work in (("decode", lambda batch: decode_jpegs(batch, "cpu")),
                           ("decode_resize", lambda batch: preprocess.images(decode_jpegs(batch, "cpu"), "cpu"))):
            work(batches[0])  # untimed: first-call costs
            start = time.perf_counter()
            for batch in batches:
                work(batch)
            rates[name] = round(len(blobs) / (time.perf_counter() - start), 1)
        return rates
    finally:
        torch.set_num_threads(threads)


def measure(args) -> dict:
    device = resolve_device(args.device)
    result = {
        "benchmark": "decode", "script": "scripts/bench_decode.py",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": {"type": device.type, "name": device_name(device),
                   "cpu": device_name(torch.device("cpu")), "cores": len(os.sched_getaffinity(0))},
        "versions": {"torch": torch.__version__, "torchvision": torchvision.__version__,
                     "spml_cache": spml_cache.__version__, "python": platform.python_version()},
        "settings": {"images": args.images, "unique_images": min(args.images, args.unique),
                     "resolution": args.resolution, "batch_size": args.batch_size},
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        paths = write_images(Path(tmp) / "data", args.images, min(args.images, args.unique))
        blobs = [path.read_bytes() for path in paths]
    result["images_kb"] = round(sum(map(len, blobs)) / len(blobs) / 1024, 1)
    cpu = cpu_rates(blobs, args.resolution, args.batch_size)
    result["cpu_one_thread"] = {"decoder": decoder_version("cpu"), "images_per_s": cpu}
    print(f"cpu, one thread ({result['device']['cpu']}): decode {cpu['decode']} img/s, decode + resize"
          f" {cpu['decode_resize']} img/s")
    if device.type == "cuda":
        rate = decode_rate(blobs, Preprocess(args.resolution), args.batch_size, device, torch.float16)
        result["gpu"] = {"decoder": decoder_version("gpu"), "decode_resize_normalise_images_per_s": round(rate, 1)}
        print(f"gpu ({result['device']['name']}): nvjpeg decode + resize + normalise {rate:.1f} img/s")
    return result


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=256, help="JPEGs to generate (default 256)")
    parser.add_argument("--unique", type=int, default=256, help="distinct images among them; the rest are copies")
    parser.add_argument("--resolution", type=int, default=448)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", type=Path, default=None, help="default docs/benchmarks/decode-<device>.json")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    result = measure(args)
    named = slug(torch.device(result["device"]["type"]), result["device"]["name"])
    path = args.json or REPO / "docs" / "benchmarks" / f"decode-{named}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
