"""Stage three's settings: what the user gave, the loss's recipe, the defaults, and the linear head to start from;
everything checked before the run directory exists.

`FinetuneSettings` is what defines a run's results: stored in its config.json (`options`) and compared when a run
is resumed. `Setup` adds what the run needs besides (the cache, the image rows, the starting model).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from spml_cache import backbone, cache, losses, runs
from spml_cache.errors import SpmlError
from spml_cache.losses.base import FIDELITIES
from spml_cache.finetune import checkpoints
from spml_cache.finetune.images import usable_rows
from spml_cache.finetune.parallel import Processes, check_batch_split
from spml_cache.protocol import FINETUNE_EPOCHS, GRID_BATCH_SIZES, check_grid

DEFAULT_LRS = (1e-5, 1e-4)
# The papers' per-loss fine-tuning recipes, for what the user leaves unset.
#  gr: Chen et al. (IJCAI 2024) Table 6 (batch, lr, epochs per dataset); its authors' code trains the head at 10x.
#  ll_*: Kim et al.'s code (the LL losses compared by Chen et al.) trains the head at 10x the lr.
#  em, em_apl: Zhou et al. (ECCV 2022) train 10 epochs; APL's per-dataset defaults assume T = 10.
COLE_LINEAR_INIT_EPOCHS = 5
_GR = {"voc": (8, 1e-5, 8), "coco": (16, 1e-5, 8), "nus": (16, 1e-5, 10), "cub": (8, 5e-5, 10)}
RECIPES: dict[str, dict[str, dict]] = {
    "gr": {d: {"batch_sizes": [b], "lrs": [lr], "epochs": t, "head_lr_mult": 10.0} for d, (b, lr, t) in _GR.items()},
    **{name: {"*": {"head_lr_mult": 10.0}} for name in ("ll_r", "ll_ct", "ll_cp")},
    **{name: {"*": {"epochs": 10}} for name in ("em", "em_apl")},
}


@dataclass(frozen=True)
class FinetuneSettings:
    """Every resolved option of a fine-tuning run (what `config.json` keeps under `options`)."""

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
    fidelity: str = "exact"  # or "authors": the authors' code's numerics and rules (docs/fidelity.md)

    def as_dict(self) -> dict:
        return asdict(self)


class FineTuneModel(nn.Module):
    """The ResNet-50 trunk (to the pooled 2048-d vector) and the linear head: logits `[B, C]`."""

    def __init__(self, trunk: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.trunk, self.head = trunk, head

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(images))


@dataclass
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


def resolve(given: dict, overrides: dict, stored: dict | None, root: Path | None, out: Path,
            cache_dir: Path | None, processes: Processes, workers: int) -> Setup:
    """`given`: the options the caller set (None left out), `overrides`: the loss hyperparameters given
    (`{key: value}`); `stored`: the config of the run being resumed, whose options the given ones must equal."""
    if stored is not None:
        checkpoints.same_as_stored(given, overrides, stored)
        given = dict(stored["options"])
        root = root if root is not None else Path(stored["root"])
    settings, features, start = _resolve_settings(given, overrides, out, cache_dir, processes)
    if stored is not None and cache.cache_id(features.attrs) != stored["cache_id"]:
        raise SpmlError(f"--resume {stored['run_dir']}: {features.path} was rebuilt since that run began;"
                        " start a new run")
    notes = [checkpoints.describe_start(start, settings)]
    if root is None:
        raise SpmlError("no image root: pass --root DIR (where the cache was extracted from) or set SPML_DATA")
    ids = {split: getattr(features, split).ids for split in cache.SPLITS}
    image_root, rows, skipped = usable_rows(features.dataset, Path(root), ids, settings.skip_missing)
    notes += [skipped] if skipped else []
    trunk, provenance = backbone.build_trunk(settings.weights)
    if start is not None and provenance != features.attrs.get("weights"):
        notes.append(f"note: {features.path} was extracted with weights {features.attrs.get('weights')} but the trunk"
                     f" starts from {provenance}, so the start is not the linear stage's model (see --weights)")
    head = nn.Linear(backbone.FEATURE_DIM, len(features.classes))
    if start is not None:
        head.weight.data.copy_(start.weight)
        head.bias.data.copy_(start.bias)
    model = FineTuneModel(trunk, head)
    return Setup(settings, features, image_root, rows, start, model, processes, workers, notes)


def _resolve_settings(given: dict, overrides: dict, out: Path, cache_dir: Path | None, processes: Processes):
    """Every option's value (given, else the loss's recipe, else the default), the cache, the starting head."""
    options = {"init": "best", **given}
    if options.get("fidelity", "exact") not in FIDELITIES:
        raise SpmlError(f"--fidelity {options['fidelity']!r}: use {' or '.join(FIDELITIES)} (docs/fidelity.md)")
    if options["init"] not in ("best", "imagenet"):
        raise SpmlError(f"--init {options['init']}: use best (LinearInit) or imagenet (a fresh head)")
    if options["init"] == "imagenet" and options.get("from_run") is not None:
        raise SpmlError("--from RUN names a linear run to start from: it goes with --init best, not --init imagenet")
    features = cache.load(options["cache"]) if options.get("cache") is not None else None
    start = _choose_head(options, features, out) if options["init"] == "best" else None
    if start is not None:
        options.update(from_run=str(start.run.resolve()), loss=start.loss)
    if options.get("loss") is None:
        raise SpmlError("--loss NAME is needed with --init imagenet (spml-cache losses lists the names)")
    if features is None:
        features = cache.load((start and start.cache) or cache.find_cache(None, options.get("dataset"), cache_dir))
    if options.get("dataset", features.dataset) != features.dataset:
        raise SpmlError(f"--dataset {options['dataset']} but {features.path} holds {features.dataset}:"
                        " drop one of them")
    options.update(cache=str(Path(features.path).resolve()), dataset=features.dataset)
    if start is not None:
        checkpoints.check_head(start, len(features.classes), len(features.train), features.path)
    recipe = RECIPES.get(options["loss"], {})
    if options.get("fidelity") == "authors" and options["init"] == "best" and losses.get(options["loss"]).authors_drop_last:
        # Cole et al., Sec. 6.1: their "+LinearInit" rows fine-tune 5 epochs from the best linear weights
        recipe = {**recipe, "*": {**recipe.get("*", {}), "epochs": COLE_LINEAR_INIT_EPOCHS}}
    defaults = {"lrs": list(DEFAULT_LRS), "batch_sizes": list(GRID_BATCH_SIZES), "epochs": FINETUNE_EPOCHS,
                "head_lr_mult": 1.0, "seeds": [0], "skip_missing": False, "from_run": None,
                "resolution": int(features.attrs["resolution"]), "weights": checkpoints.default_weights(features.attrs),
                **recipe.get("*", {}), **recipe.get(features.dataset, {})}
    options = {**defaults, **options}
    options["lrs"], options["batch_sizes"] = check_grid(options["lrs"], options["batch_sizes"])
    if "hparams" not in options:  # the linear head's values, then --hp; resolved as the linear stage does
        given_hparams = losses.overrides_for([options["loss"]], overrides)[options["loss"]]
        options["hparams"] = losses.resolve_hparams(
            options["loss"], {**(start.hparams if start else {}), **given_hparams}, num_classes=len(features.classes),
            dataset=features.dataset, train_observed=torch.from_numpy(features.train.observed),
            expected_positives=features.attrs.get("expected_positives"),
        )
    for flag, value, least in (("--epochs", options["epochs"], 1), ("--resolution", options["resolution"], 32)):
        if value < least:
            raise SpmlError(f"{flag} {value}: must be at least {least}")
    if not options["head_lr_mult"] > 0:
        raise SpmlError(f"--head-lr-mult {options['head_lr_mult']}: must be positive")
    check_batch_split(options["batch_sizes"], processes)
    return FinetuneSettings(**options), features, start


def _choose_head(options: dict, features: cache.FeatureSet | None, out: Path) -> runs.LinearHead:
    if options.get("from_run") is not None:
        return runs.read_linear_head(Path(options["from_run"]), options.get("loss"))
    dataset = features.dataset if features is not None else options.get("dataset")
    if dataset is None or options.get("loss") is None:
        raise SpmlError("--init best needs --loss and --dataset (or --cache) to find the newest linear run,"
                        " or --from RUN")
    cache_id = cache.cache_id(features.attrs) if features is not None else None
    return runs.read_linear_head(checkpoints.newest_linear_run(out, dataset, options["loss"], cache_id), options["loss"])
