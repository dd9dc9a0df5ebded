"""Benchmark stage three: training images per second of end-to-end fine-tuning on the device present.

Times `spml_cache.finetune.train_step`, the step `spml-cache finetune` runs: decode JPEGs (nvjpeg on a GPU;
`--no-decode` starts from decoded images), resize to R x R, flip and normalise on the device, ResNet-50
forward and backward (channels_last; bf16 autocast on a GPU, float32 on a CPU), the loss, one Adam step.
Images are synthetic JPEGs of 500 x 375 (a typical VOC size); the trunk has random weights, which does not
change the arithmetic. Reading files is left out: the loader's workers do it in parallel.

Usage: python scripts/bench_finetune.py [--resolution 448] [--batch-size 16] [--steps 20] [--warmup 5]
       [--loss an] [--device auto] [--no-decode]
Example (a CPU, small): python scripts/bench_finetune.py --resolution 64 --batch-size 8 --steps 4 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spml_cache import losses  # noqa: E402
from spml_cache.backbones.checkpoints import RandomWeightsWarning
from spml_cache.backbones.resnet50 import FEATURE_DIM, build_trunk
from spml_cache.finetune import parallel  # noqa: E402
from spml_cache.finetune import FineTuneModel, Training, make_optimizer, train_step  # noqa: E402
from spml_cache.images import decode_jpegs
from spml_cache.runtime.devices import resolve_device  # noqa: E402

NUM_CLASSES = 20
NUM_TRAIN = 1024
IMAGE_SIZE = (375, 500)  # height, width


def synthetic_jpegs(count: int, seed: int = 0) -> list[torch.Tensor]:
    """Smooth random images (JPEG-compressible like photos), encoded once."""
    generator = torch.Generator().manual_seed(seed)
    blobs = []
    for _ in range(count):
        coarse = torch.rand(1, 3, 12, 16, generator=generator) * 255
        image = torch.nn.functional.interpolate(coarse, size=IMAGE_SIZE, mode="bilinear")[0].to(torch.uint8)
        blobs.append(torchvision.io.encode_jpeg(image, quality=90))
    return blobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=448)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--loss", default="an")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--no-decode", action="store_true", help="start from decoded images")
    args = parser.parse_args()

    device = resolve_device(args.device)
    processes = parallel.Processes(device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RandomWeightsWarning)
        trunk, _ = build_trunk("none")
    head = torch.nn.Linear(FEATURE_DIM, NUM_CLASSES)
    model = FineTuneModel(trunk, head).to(device, memory_format=torch.channels_last)  # as finetune does
    model.train()
    observed = torch.zeros(NUM_TRAIN, NUM_CLASSES, dtype=torch.int8)
    observed[torch.arange(NUM_TRAIN), torch.arange(NUM_TRAIN) % NUM_CLASSES] = 1
    loss_fn = losses.build(args.loss, num_classes=NUM_CLASSES, dataset="voc", num_heads=1, train_observed=observed)
    loss_fn = loss_fn.to(device)
    training = Training(model=model, trainer=model, loss_fn=loss_fn, optimizer=make_optimizer(model, loss_fn, lr=1e-5),
                        preprocess=args.resolution, processes=processes)
    observed, labels = observed.to(device), observed.to(device).clamp(min=0).to(torch.uint8)

    blobs = synthetic_jpegs(args.batch_size)
    images = blobs if not args.no_decode else decode_jpegs(blobs, "cpu")
    flips = torch.rand(args.batch_size, generator=torch.Generator().manual_seed(1)) < 0.5

    def step(number: int) -> None:
        index = (torch.arange(args.batch_size) + number * args.batch_size) % NUM_TRAIN
        index = index.to(device)
        train_step(training, images, flips, observed[index], labels[index], index)

    for number in range(args.warmup):
        step(number)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for number in range(args.steps):
        step(number)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    print(json.dumps({
        "device": str(device), "device_name": name, "resolution": args.resolution, "batch_size": args.batch_size,
        "precision": "bf16 autocast" if device.type == "cuda" else "float32", "decode": not args.no_decode,
        "loss": args.loss, "steps": args.steps, "images_per_s": round(args.steps * args.batch_size / seconds, 2),
        "ms_per_step": round(1000 * seconds / args.steps, 1), "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
