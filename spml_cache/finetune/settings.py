"""Stage three's settings: what the user gave (`FinetuneOptions`) resolved into what a run trains with, each option
as given, else the interrupted run's own (`--resume`), else the linear head's, the loss's recipe, the cache's or
the trunk's (each option's declaration names which), else its default; everything checked before the run
directory exists.

`FinetuneSettings` is what defines a run's results: its options, resolved, which its config.json keeps whole and
a resumed run compares; and the loss's hyperparameters resolved from them. `Setup` adds what the run reads (the
cache, the image rows, the head it starts from, the trunk's description); the model is built where the run starts
(`model.initial_model`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from spml_cache import backbones, cache, losses, runs
from spml_cache.backbones.preprocess import Preprocess
from spml_cache.finetune import start as linear_init
from spml_cache.finetune.images import usable_rows
from spml_cache.finetune.labels import loss_observed
from spml_cache.finetune.parallel import Processes, check_batch_split
from spml_cache.images import recorded_decode, resolve_decode
from spml_cache.labels import take
from spml_cache.observation import result_key, split_key
from spml_cache.options import FinetuneOptions, refuse_differences
from spml_cache.options.records import rerun
from spml_cache.protocol import check_val_split
from spml_cache.runtime.errors import SpmlError
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


@dataclass(frozen=True)
class FinetuneSettings:
    """What a fine-tuning run trains with: its options resolved (each a value; config.json keeps them whole) and the
    loss's hyperparameters resolved from them (every key the loss takes, None where the loss derives it)."""

    options: FinetuneOptions
    hparams: dict

    @property
    def key(self) -> str:
        """The run's result key: the loss, or `loss@rule` (observation.result_key), as `--loss` names it."""
        return self.options.loss

    @property
    def loss(self) -> str:
        return split_key(self.options.loss)[0]

    @property
    def rule(self) -> str:
        """The observation rule of the training labels: the linear head's (`--loss loss@rule`)."""
        return split_key(self.options.loss)[1]

    @property
    def seeds(self) -> list[int]:
        return list(range(self.options.seeds))


@dataclass(frozen=True, kw_only=True)
class Setup:
    """Everything resolved and validated before anything is written; `initial`, the model every config starts
    from a copy of, is built where the run starts (`model.initial_model`)."""

    settings: FinetuneSettings
    features: cache.FeatureSet
    root: Path  # the folder the cache's ids are relative to
    rows: dict[str, np.ndarray]  # the cache rows used per split (all, or those whose image exists)
    start: runs.LinearHead | None
    trunk: backbones.Description  # the cache's backbone with the run's weights and resolution
    processes: Processes
    workers: int
    notes: list[str]
    initial: nn.Module | None = None  # on the CPU, once built

    @property
    def preprocess(self) -> Preprocess:
        """The backbone's own preprocessing (the papers' R x R squash for ResNet-50) at the run's resolution."""
        return self.trunk.preprocess


@dataclass(frozen=True)
class Resumed:
    """An interrupted fine-tuning run (`--resume RUN`): the options its config.json says it took."""

    run_dir: Path
    options: FinetuneOptions
    root: Path  # the image root it read
    cache_id: str

    @classmethod
    def read(cls, run_dir: Path) -> "Resumed":
        """The interrupted run's options (`stored_options`), its image root and its cache's id."""
        config = runs.open_for_resume(run_dir, "finetune")
        options = stored_options(config, Path(run_dir) / "config.json")
        return cls(Path(run_dir), options, Path(config["root"]), config["cache_id"])


def stored_options(config: dict, file: Path) -> FinetuneOptions:
    """The options a fine-tuning run took, as its config.json (`file`) keeps them: each under its own name, or under
    `options` in a run's from before (older still: its rule apart from its loss, its seeds as a list, no decoder).
    A value its declaration refuses is the file's (edited or damaged), named by its key."""
    nested = "options" in config
    stored = config["options"] if nested else config
    if nested and isinstance(stored, dict):
        stored = dict(stored)
        if "rule" in stored:  # a run from before the rule went with the loss (`loss@rule`)
            stored["loss"] = result_key(stored["loss"], stored.pop("rule"))
        if stored.get("decode") is None:  # a run from before --decode: nvjpeg on a GPU, the CPU's elsewhere
            stored["decode"] = "gpu" if str(config.get("device")).startswith("cuda") else "cpu"
    return FinetuneOptions.from_stored(stored, file, "options." if nested else "")


def rerun_options(config: Path, resume: Path | None, given: FinetuneOptions) -> tuple[FinetuneOptions, Path, str]:
    """`--config RUN/config.json`: that run's options, each option given in its place, the image root it read, and
    the line saying so. What the record derived from an option given anew is left to derive again: its dataset
    from another `--cache`, its cache from another `--from` or `--dataset`, its head from `--init imagenet`, its
    loss's hyperparameters from another `--loss`."""
    file, record = runs.open_record(config, resume, "finetune")
    options, line = rerun(stored_options(record, file), given, file, clears={
        "cache": ("dataset",), "dataset": ("cache",), "from_run": ("cache", "dataset"), "init": ("from_run",),
        "loss": ("hparams",)})
    return options, Path(record["root"]), line


def resolve(options: FinetuneOptions, resumed: Resumed | None, *, root: Path | None, out: Path,
            cache_dir: Path | None, processes: Processes, workers: int) -> Setup:
    """The settings (the options given, else the linear head's, the loss's recipe, the cache's or the trunk's, else
    the default), the cache, the starting head and the trunk's description, checked before anything is written.
    With `resumed`, the options given must equal that run's settings."""
    if resumed is not None:
        refuse_differences(resumed.run_dir, options.differences(resumed.options))
        options, root = resumed.options.filled_from(options), root if root is not None else resumed.root
    features, start = linear_init.starting_point(options, out, cache_dir)
    # what goes on, or starts from a linear head, must read the very same arrays
    unverified = cache.verify(features) if resumed is not None or start is not None else None
    if resumed is not None and cache.cache_id(features.attrs) != resumed.cache_id:
        raise SpmlError(f"--resume {resumed.run_dir}: {features.path} was rebuilt since that run began;"
                        " start a new run")
    decode, mismatch = _decode(options.decode, features, processes.device, resumed)
    settings, trunk = _settings(options, features, start, decode)
    check_batch_split(settings.options.batch_sizes, processes)
    notes = [describe_start(start, settings)] + ([unverified] if unverified else []) + ([mismatch] if mismatch else [])
    if root is None:
        raise SpmlError("no image root: pass --root DIR (where the cache was extracted from) or set SPML_DATA")
    ids = {split: getattr(features, split).ids for split in cache.SPLITS}
    image_root, rows, skipped = usable_rows(features.dataset, Path(root), ids, settings.options.skip_missing)
    notes += [skipped] if skipped else []
    check_val_split(take(features.val.labels, rows["val"]), str(features.path))
    return Setup(settings=settings, features=features, root=image_root, rows=rows, start=start, trunk=trunk,
                 processes=processes, workers=workers, notes=notes + _trunk_notes(start, trunk, features))


def _trunk_notes(start: runs.LinearHead | None, trunk: backbones.Description, features: cache.FeatureSet) -> list[str]:
    """What the trunk's weights mean for the run: a start that is not the linear stage's model, a random trunk."""
    notes = []
    if start is not None and trunk.provenance != features.attrs.get("weights"):
        notes.append(f"note: {features.path} was extracted with weights {features.attrs.get('weights')} but the trunk"
                     f" starts from {trunk.provenance}, so the start is not the linear stage's model (see --weights)")
    if trunk.weights == "none":
        notes.append("note: the trunk is random (--weights none): training moves its BatchNorm statistics, and with"
                     " them the random features the head was fitted to, so mAP can fall below epoch 0's whatever the"
                     " loss does")
    return notes


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
    recorded = recorded_decode(features.attrs)
    if recorded == "gpu" and device.type != "cuda":
        return "cpu", (f"warning: {features.path} was decoded with nvjpeg, which needs a GPU: decoding with"
                       f" libjpeg-turbo on {device}, so epoch 0 is not exactly the linear head (docs/fidelity.md)")
    return resolve_decode(recorded, device), None


def _settings(options: FinetuneOptions, features: cache.FeatureSet, start: runs.LinearHead | None,
              decode: str) -> tuple[FinetuneSettings, backbones.Description]:
    """The options resolved (`Options.resolved`, from the sources their declarations name: the head it starts
    from, the loss's recipe for the cache's dataset, the cache, the trunk that made it) and the loss's
    hyperparameters: the linear head's values, then --hp, resolved as the linear stage does; and the trunk."""
    loss, rule = (start.loss, start.rule) if start is not None else split_key(options.loss)
    recipe = {**RECIPES.get(loss, {}).get("*", {}), **RECIPES.get(loss, {}).get(features.dataset, {})}
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
    options = options.resolved(
        start={"loss": result_key(loss, rule), "from_run": start and start.run}, recipe=recipe,
        cache={"cache": features.path, "dataset": features.dataset, "resolution": int(features.attrs["resolution"]),
               "decode": decode},
        losses={"hparams": {key: value for key, value in hparams.items() if value is not None}})
    trunk = linear_init.trunk_backbone(features.attrs, options.weights, options.resolution)
    return FinetuneSettings(options.resolved(trunk={"weights": trunk.weights}), hparams), trunk


def describe_start(head: runs.LinearHead | None, settings: FinetuneSettings) -> str:
    """The first line a fine-tuning run prints: where it starts from."""
    if head is None:
        options = settings.options
        return (f"ImageNet init: a fresh {settings.loss} head on the {options.weights} trunk"
                f" ({Path(options.cache).resolve()})")
    described = ", ".join(f"{key.replace('_', ' ')} {value:g}" for key, value in head.settings.items()
                          if value is not None)
    val = f", val mAP {head.val_map:.2f}" if head.val_map is not None else ""
    return f"LinearInit from {head.run}: the {head.loss} head ({described}{val})"
