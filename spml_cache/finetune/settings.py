"""Stage three's settings: what the user gave (`FinetuneOptions`), the loss's recipe, the defaults, and the linear
head to start from; everything checked before the run directory exists.

`FinetuneSettings` is what defines a run's results: its options as taken (`FinetuneSettings.options`) are stored
in its config.json (`options`) and compared when a run is resumed. `Setup` adds what the run needs besides (the
cache, the image rows, the starting model).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from spml_cache import backbones, cache, losses, observation, runs
from spml_cache.backbones.preprocess import Preprocess
from spml_cache.finetune import start as linear_init
from spml_cache.finetune.images import usable_rows
from spml_cache.finetune.labels import loss_observed
from spml_cache.finetune.parallel import Processes, check_batch_split
from spml_cache.images import DECODERS, recorded_decoder, resolve_decode
from spml_cache.labels import take
from spml_cache.observation import DEFAULT_RULE, result_key, split_key
from spml_cache.options import FinetuneOptions, refuse_differences
from spml_cache.protocol import Fidelity, check_grid, check_val_split
from spml_cache.runtime.errors import SpmlError, closest
# The papers' per-loss fine-tuning recipes, for what the user leaves unset.
#  gr: Chen et al. (IJCAI 2024) Table 6 (batch, lr, epochs per dataset); its authors' code trains the head at 10x.
#  ll_*: Kim et al.'s code (the LL losses compared by Chen et al.) trains the head at 10x the lr.
#  em, em_apl: Zhou et al. (ECCV 2022) train 10 epochs; APL's per-dataset defaults assume T = 10.
# (Cole et al.'s "+LinearInit" rows: the paper says 5 epochs, their train.py runs 10; both modes take the
# protocol's 10, docs/fidelity.md.)
_GR = {"voc": (8, 1e-5, 8), "coco": (16, 1e-5, 8), "nus": (16, 1e-5, 10), "cub": (8, 5e-5, 10)}
RECIPES: dict[str, dict[str, dict]] = {
    "gr": {d: {"batch_sizes": [b], "lrs": [lr], "epochs": t, "head_lr_mult": 10.0} for d, (b, lr, t) in _GR.items()},
    **{name: {"*": {"head_lr_mult": 10.0}} for name in ("ll_r", "ll_ct", "ll_cp")},
    **{name: {"*": {"epochs": 10}} for name in ("em", "em_apl")},
}


@dataclass(frozen=True, kw_only=True)
class FinetuneSettings:
    """Every resolved option of a fine-tuning run (`options`: what `config.json` keeps of them)."""

    init: str  # best (LinearInit) or imagenet (a fresh head)
    loss: str
    dataset: str
    cache: str  # the cache file, resolved
    from_run: str | None  # the linear run the head comes from (init best)
    weights: str  # the trunk's initialisation
    resolution: int
    epochs: int
    lrs: list[float]
    batch_sizes: list[int]
    seeds: list[int]
    head_lr_mult: float
    skip_missing: bool
    hparams: dict  # the loss's hyperparameters, resolved
    fidelity: Fidelity
    rule: str = DEFAULT_RULE  # the observation rule of the training labels: the linear head's (`--loss loss@rule`)
    # gpu (nvjpeg) or cpu (libjpeg-turbo in the reader processes); None only in a run from before it was kept,
    # which decoded on its device (`Resumed.read` fills it in)
    decode: str | None = None

    @property
    def key(self) -> str:
        """The run's result key: the loss, or `loss@rule` (observation.result_key)."""
        return result_key(self.loss, self.rule)

    def options(self) -> FinetuneOptions:
        """The options that resolve to these settings again: what config.json keeps (`options`) and a resumed run
        reads back."""
        return FinetuneOptions(
            init=self.init, from_run=self.from_run and Path(self.from_run), cache=Path(self.cache),
            dataset=self.dataset, loss=self.key, weights=self.weights, resolution=self.resolution, epochs=self.epochs,
            lrs=self.lrs, batch_sizes=self.batch_sizes, seeds=len(self.seeds), head_lr_mult=self.head_lr_mult,
            skip_missing=self.skip_missing, hparams={key: value for key, value in self.hparams.items()
                                                     if value is not None}, fidelity=self.fidelity,
            decode=self.decode)

    def grid(self) -> runs.Grid:
        return runs.Grid(losses=[self.loss], lrs=self.lrs, batch_sizes=self.batch_sizes, epochs=self.epochs,
                         seeds=self.seeds, hparams={self.loss: self.hparams}, val_labels="clean",
                         fidelity=self.fidelity)


class FineTuneModel(nn.Module):
    """The backbone's trunk (to its pooled vector, 2048-d for ResNet-50) and the linear head: logits `[B, C]`."""

    def __init__(self, trunk: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.trunk, self.head = trunk, head

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(images))


@dataclass(kw_only=True)
class Setup:
    """Everything resolved and validated before anything is written."""

    settings: FinetuneSettings
    features: cache.FeatureSet
    root: Path  # the folder the cache's ids are relative to
    rows: dict[str, np.ndarray]  # the cache rows used per split (all, or those whose image exists)
    start: runs.LinearHead | None
    initial: FineTuneModel  # on the CPU; every config starts from a copy
    processes: Processes
    workers: int
    notes: list[str]
    preprocess: Preprocess | None = None  # the backbone's own; None: the papers' R x R squash at the resolution

    def __post_init__(self) -> None:
        if self.preprocess is None:
            self.preprocess = Preprocess(self.settings.resolution)


@dataclass(frozen=True)
class Resumed:
    """An interrupted fine-tuning run (`--resume RUN`): the options its config.json says it took."""

    run_dir: Path
    options: FinetuneOptions
    root: Path  # the image root it read
    cache_id: str

    @classmethod
    def read(cls, run_dir: Path) -> "Resumed":
        config = runs.open_for_resume(run_dir, "finetune")
        stored = dict(config["options"])
        if "rule" in stored:  # a run from before the rule went with the loss (`loss@rule`)
            stored["loss"] = result_key(stored["loss"], stored.pop("rule"))
        if stored.get("decode") is None:  # a run from before --decode: nvjpeg on a GPU, the CPU's decoder elsewhere
            stored["decode"] = "gpu" if str(config.get("device")).startswith("cuda") else "cpu"
        return cls(Path(run_dir), FinetuneOptions.from_stored(stored), Path(config["root"]), config["cache_id"])


def resolve(options: FinetuneOptions, resumed: Resumed | None, *, root: Path | None, out: Path,
            cache_dir: Path | None, processes: Processes, workers: int) -> Setup:
    """The settings (the options given, else the loss's recipe, the cache or the default), the cache, the
    starting head and model, checked before anything is written. With `resumed`, the options given must equal
    that run's settings."""
    if resumed is not None:
        refuse_differences(resumed.run_dir, options.differences(resumed.options))
        options, root = resumed.options.filled_from(options), root if root is not None else resumed.root
    features, start = _starting_point(options, out, cache_dir)
    # what goes on, or starts from a linear head, must read the very same arrays
    unverified = cache.verify(features) if resumed is not None or start is not None else None
    if resumed is not None and cache.cache_id(features.attrs) != resumed.cache_id:
        raise SpmlError(f"--resume {resumed.run_dir}: {features.path} was rebuilt since that run began;"
                        " start a new run")
    decode, mismatch = _decode(options.decode, features, processes.device, resumed)
    settings = _settings(options, features, start, processes, decode)
    notes = [describe_start(start, settings)] + ([unverified] if unverified else []) + ([mismatch] if mismatch else [])
    if root is None:
        raise SpmlError("no image root: pass --root DIR (where the cache was extracted from) or set SPML_DATA")
    ids = {split: getattr(features, split).ids for split in cache.SPLITS}
    image_root, rows, skipped = usable_rows(features.dataset, Path(root), ids, settings.skip_missing)
    notes += [skipped] if skipped else []
    check_val_split(take(features.val.labels, rows["val"]), str(features.path))
    described = linear_init.trunk_backbone(features.attrs, settings.weights, settings.resolution)
    trunk = backbones.build(described)
    provenance = described.provenance
    if start is not None and provenance != features.attrs.get("weights"):
        notes.append(f"note: {features.path} was extracted with weights {features.attrs.get('weights')} but the trunk"
                     f" starts from {provenance}, so the start is not the linear stage's model (see --weights)")
    head = nn.Linear(described.feature_dim, len(features.classes))
    if start is not None:
        head.weight.data.copy_(start.weight)
        head.bias.data.copy_(start.bias)
    if settings.weights == "none":
        notes.append("note: the trunk is random (--weights none): training moves its BatchNorm statistics, and with"
                     " them the random features the head was fitted to, so mAP can fall below epoch 0's whatever the"
                     " loss does")
    model = FineTuneModel(trunk, head)
    return Setup(settings=settings, features=features, root=image_root, rows=rows, start=start, initial=model,
                 processes=processes, workers=workers, notes=notes, preprocess=described.preprocess)


def _misspelt(name: str) -> bool:
    """A name that is no built-in loss but close to one (a plugin's name is known only once a run recorded it)."""
    return name not in losses.names() and closest(name, losses.names()) is not None


def _starting_point(options: FinetuneOptions, out: Path, cache_dir: Path | None):
    """The cache fine-tuning reads and, for LinearInit, the linear head it starts from (checked to fit)."""
    best = options.value("init") == "best"
    if options.loss is not None and not best:
        losses.get(split_key(options.loss)[0])  # a misspelt name fails here, with a suggestion
    if not best and options.from_run is not None:
        raise SpmlError("--from RUN names a linear run to start from: it goes with --init best, not --init imagenet")
    features = cache.load(options.cache) if options.cache is not None else None
    start = None
    if best:
        dataset = features.dataset if features is not None else options.dataset
        try:
            start = linear_init.choose_head(options.from_run, options.loss, dataset,
                                            cache.cache_id(features.attrs) if features is not None else None, out)
        except SpmlError:
            if options.loss is not None and _misspelt(split_key(options.loss)[0]):
                losses.get(split_key(options.loss)[0])  # said as a misspelling, with its suggestion, not as "no run"
            raise
    elif options.loss is None:
        raise SpmlError("--loss NAME is needed with --init imagenet (spml-cache losses lists the names)")
    if features is None:
        features = cache.load((start and start.cache) or cache.find_cache(None, options.dataset, cache_dir))
    if options.dataset is not None and options.dataset != features.dataset:
        raise SpmlError(f"--dataset {options.dataset} but {features.path} holds {features.dataset}:"
                        " drop one of them")
    if start is not None:
        linear_init.check_head(start, features)
    rule = start.rule if start is not None else split_key(options.loss)[1]
    return observation.with_rule(features, observation.parse_rule(rule, flag="--loss")), start


def _decode(given: str | None, features: cache.FeatureSet, device: torch.device,
            resumed: Resumed | None) -> tuple[str, str | None]:
    """--decode (gpu or cpu), else the decoder that made the cache where this device runs it, so that epoch 0 is the
    linear head on the very same pixels; and the one line that says when it cannot be matched. A cache whose
    decoder is unknown (imported features) gets the device's default: gpu on a GPU."""
    if resumed is not None and given == "gpu" and device.type != "cuda":
        raise SpmlError(f"--resume {resumed.run_dir}: that run decodes its images with nvjpeg, which needs a GPU, and"
                        f" this process runs on {device}: resume it on a GPU")
    if given is not None:
        return resolve_decode(given, device), None
    decoder = recorded_decoder(features.attrs)
    recorded = {name: choice for choice, name in DECODERS.items()}.get(decoder)
    if recorded == "gpu" and device.type != "cuda":
        return "cpu", (f"warning: {features.path} was decoded with nvjpeg, which needs a GPU: decoding with"
                       f" libjpeg-turbo on {device}, so epoch 0 is not exactly the linear head (docs/fidelity.md)")
    return resolve_decode(recorded, device), None


def _settings(options: FinetuneOptions, features: cache.FeatureSet, start: runs.LinearHead | None,
              processes: Processes, decode: str) -> FinetuneSettings:
    """Each setting: given, else the loss's recipe (for the cache's dataset), else the default; `decode` resolved
    by `_decode`."""
    loss, rule = (start.loss, start.rule) if start is not None else split_key(options.loss)
    recipe = {**RECIPES.get(loss, {}).get("*", {}), **RECIPES.get(loss, {}).get(features.dataset, {})}

    def chosen(name: str, default=None):
        """Given (checked by its declaration), else the recipe's, else `default` or the declared default."""
        given = getattr(options, name)
        return given if given is not None else recipe.get(name, options.value(name) if default is None else default)

    lrs, batch_sizes = check_grid(chosen("lrs"), chosen("batch_sizes"))
    check_batch_split(batch_sizes, processes)
    epochs, resolution = chosen("epochs"), chosen("resolution", int(features.attrs["resolution"]))
    head_lr_mult = chosen("head_lr_mult")
    # the linear head's values, then --hp; resolved as the linear stage does
    given = losses.Overrides.given([loss], options.hparams or {})[loss]
    reads_text = losses.get(loss).needs_similarity
    features.require_text_side([loss] if reads_text else [])
    hparams = losses.resolve_hparams(
        loss, {**(start.hparams if start else {}), **given}, num_classes=len(features.classes),
        dataset=features.dataset,
        train_observed=loss_observed(loss, features.train.observed),
        expected_positives=features.attrs.get("expected_positives"),
        **(features.train_similarities() if reads_text else {}),
    )
    return FinetuneSettings(
        init="best" if start is not None else "imagenet", loss=loss, dataset=features.dataset,
        cache=str(Path(features.path).resolve()), from_run=start and str(start.run.resolve()),
        weights=_weights(features.attrs, chosen("weights", linear_init.default_weights(features.attrs)), resolution),
        resolution=resolution, epochs=epochs,
        lrs=lrs, batch_sizes=batch_sizes, seeds=list(range(options.value("seeds"))), head_lr_mult=head_lr_mult,
        skip_missing=options.value("skip_missing"), hparams=hparams, fidelity=options.value("fidelity"), rule=rule,
        decode=decode,
    )


def _weights(cache_attrs: dict, weights: str | None, resolution: int) -> str:
    """The trunk's weights as the backbone names them (None: its default); refuses a backbone not fine-tuned here."""
    return linear_init.trunk_backbone(cache_attrs, weights, resolution).weights


def describe_start(head: runs.LinearHead | None, settings: FinetuneSettings) -> str:
    """The first line a fine-tuning run prints: where it starts from."""
    if head is None:
        return f"ImageNet init: a fresh {settings.loss} head on the {settings.weights} trunk ({settings.cache})"
    described = ", ".join(f"{key.replace('_', ' ')} {value:g}" for key, value in head.settings.items()
                          if value is not None)
    val = f", val mAP {head.val_map:.2f}" if head.val_map is not None else ""
    return f"LinearInit from {head.run}: the {head.loss} head ({described}{val})"
