"""`spml-cache demo`'s options (`demo.run_demo`): how big the demo is (`DemoSizes`: hidden flags, which the tests make
small) and where it runs (`DemoPlacement`), declared like the stages' so that the command line is built from them
and a bad size is refused, in one line naming its flag, before any work; and `spml-cache make-demo-data`'s
(`DemoData`: the generated dataset alone, `sc.make_demo_data`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from spml_cache.options.declared import Options, Placement, at_least, option
from spml_cache.options.linear import BATCH_SIZES, LRS
from spml_cache.protocol import GRID_BATCH_SIZES, GRID_LRS, LINEAR_EPOCHS

# Sized by measurement (docs/benchmarks.md): a few minutes on 2 CPU cores. With a random trunk the linear
# probes score the same at 64 px as at 128 px, and extraction is 2.7x faster.
DEMO_TRAIN = 400  # VOC `train` images: our train + val (80 / 20)
DEMO_TEST = 200
DEMO_SIZE = 128  # pixels of the drawn images
DEMO_RESOLUTION = 64  # the trunk's input size


@dataclass(frozen=True, kw_only=True)
class DemoSizes(Options):
    """How big the demo is: its images (count, side), the cache's resolution and stage two's grid. The defaults are
    measured to finish in a couple of minutes on two CPU cores; the tests make it smaller."""

    num_train: int = option(DEMO_TRAIN, "Images in VOC's train set (our train + val).", flag="--train", hidden=True,
                            check=at_least(1))
    num_test: int = option(DEMO_TEST, "Images in VOC's val set (our test split).", flag="--test", hidden=True,
                           check=at_least(1))
    size: int = option(DEMO_SIZE, "Image side in pixels.", hidden=True, check=at_least(1))
    resolution: int = option(DEMO_RESOLUTION, "The trunk's input side.", hidden=True, check=at_least(1))
    epochs: int = option(LINEAR_EPOCHS, "Stage two's epochs.", hidden=True, check=at_least(1))
    lrs: Sequence[float] = option(tuple(GRID_LRS), "Stage two's learning rates.", flag="--lr", kind=float, many=True,
                                  hidden=True, check=LRS)
    batch_sizes: Sequence[int] = option(tuple(GRID_BATCH_SIZES), "Stage two's batch sizes.", flag="--batch-size",
                                        kind=int, many=True, hidden=True, check=BATCH_SIZES)


@dataclass(frozen=True, kw_only=True)
class DemoPlacement(Placement):
    """Where the demo writes and runs."""

    out: Path = option(Path("demo"), "Folder for the demo's data, cache, runs and plots.")
    device: str = option("auto", "auto, cpu, cuda or cuda:N.")


@dataclass(frozen=True, kw_only=True)
class DemoData(Options):
    """`spml-cache make-demo-data`: a small synthetic dataset in the real PASCAL VOC 2012 layout, where to write it
    and how big."""

    folder: Path = option(help="Where to write the dataset (it will hold VOCdevkit/).", kind=Path, argument=True)
    num_train: int = option(DEMO_TRAIN, "Images in VOC's train set (our train + val).", flag="--train",
                            check=at_least(1))
    num_test: int = option(DEMO_TEST, "Images in VOC's val set (our test split).", flag="--test", check=at_least(1))
    size: int = option(DEMO_SIZE, "Image side in pixels.", check=at_least(16, "smaller is too small to draw on"))
    seed: int = option(0, "Random seed of the drawing.")
    overwrite: bool = option(False, "Replace an existing FOLDER/VOCdevkit.", switch=True)
