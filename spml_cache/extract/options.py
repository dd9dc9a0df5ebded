"""`spml-cache extract`'s options, typed: each declared once, with its default and its check, and checked when
the object is built, by the command line and the Python API alike (`extract(dataset, root, **options)`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spml_cache import backbones
from spml_cache.cache.csr import DEFAULT_FORMAT, resolve_format
from spml_cache.extract.batches import PRECISIONS
from spml_cache.images import check_decode
from spml_cache.observation import Rule
from spml_cache.runtime.errors import SpmlError

BAD_IMAGE_POLICIES = ("fail", "skip")


@dataclass(frozen=True)
class ExtractOptions:
    """What to extract, and how (docs/internals.md, "extract"): the flags of `spml-cache extract`."""

    dataset: str
    root: Path
    out: Path | None = None  # None: $SPML_CACHE or ./cache, <dataset>-<backbone>-<R>.h5
    backbone: str = backbones.DEFAULT
    weights: str | None = None  # None: the backbone's default
    resolution: int | None = None  # None: the backbone's own
    clip_features: str = backbones.DEFAULT_CLIP_FEATURES
    prompts: str = backbones.DEFAULT_PROMPTS
    crops: int = 0
    features: str = backbones.DEFAULT_FEATURES  # pooled or last4 (backbones/layers.py); the kind names the cache
    batch_size: int = 64
    workers: int | None = None  # None: the device's default reader processes
    device: str = "auto"
    precision: str = "auto"  # fp16 on a GPU, fp32 on the CPU
    decode: str | None = None  # gpu (nvjpeg) or cpu (libjpeg-turbo, in the loader workers); None: gpu on a GPU
    limit: int | None = None  # None: every image
    dry_run: bool = False
    force: bool = False
    on_bad_image: str = "fail"
    skip_missing: bool = False
    observe: tuple[Rule, ...] | None = None  # rules whose masks to store beside single's (extract/rules.py)
    labels: str | None = None  # auto, dense or sparse; None: DEFAULT_FORMAT
    # internal (no flag): None is on for a GPU, off for the CPU; the tests force them on the CPU to show that the
    # cache does not depend on them
    pad_batches: bool | None = None
    feed_thread: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        object.__setattr__(self, "labels", DEFAULT_FORMAT if self.labels is None else self.labels)
        object.__setattr__(self, "observe", None if self.observe is None else tuple(self.observe))
        resolve_format(self.labels, 0)  # refuses anything but auto, dense and sparse, naming --labels
        if self.resolution is not None and not 32 <= self.resolution <= 2048:
            raise SpmlError(f"--resolution {self.resolution}: use a side between 32 and 2048 pixels (the papers use"
                            " 448)")
        if self.features not in backbones.FEATURES:
            raise SpmlError(f"--features {self.features}: use pooled (the pooled vector) or last4 (the last four"
                            " blocks or stages, concatenated)")
        if self.batch_size < 1:
            raise SpmlError(f"--batch-size {self.batch_size}: use at least 1")
        if self.workers is not None and self.workers < 0:
            raise SpmlError(f"--workers {self.workers}: use 0 (load in the main process) or more")
        if self.precision not in ("auto", *PRECISIONS):
            raise SpmlError(f"--precision {self.precision}: use auto, fp32, fp16 or bf16")
        check_decode(self.decode)
        if self.limit is not None and self.limit < 1:
            raise SpmlError(f"--limit {self.limit}: use at least 1 image per split (or leave it out for all)")
        if self.on_bad_image not in BAD_IMAGE_POLICIES:
            raise SpmlError(f"--on-bad-image {self.on_bad_image}: use fail or skip")
