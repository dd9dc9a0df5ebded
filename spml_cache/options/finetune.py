"""Stage three's options (`spml-cache finetune`, `finetune.run_finetune`): what changes a run's results
(`FinetuneOptions`: None where not given, so that the loss's recipe, the cache or the default decides or, with
`--resume`, the run's own setting, which a given option must not contradict) and where it runs
(`FinetunePlacement`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from spml_cache.observation import result_key, split_key
from spml_cache.options.declared import Options, Placement, above, at_least, given, one_of, option, text
from spml_cache.options.extract import decode_option
from spml_cache.options.records import config_option
from spml_cache.options.linear import BATCH_SIZES, LRS, seed_count
from spml_cache.options.text import parse_list, read_hparams
from spml_cache.protocol import FINETUNE_EPOCHS, GRID_BATCH_SIZES, GRID_LRS, Fidelity
from spml_cache.runtime.errors import SpmlError
from spml_cache.options.trackers import TRACKERS_HELP, read_trackers

DEFAULT_LRS = (1e-5, 1e-4)
INITS = ("best", "imagenet")  # LinearInit (the default), or a fresh head on the ImageNet trunk


def _read_loss(value: str, flag: str) -> str:
    """A loss, or `loss@rule`; a plugin spec (`file.py:Class@rule`) is known by its class's name from here on."""
    from spml_cache import losses

    loss, rule = split_key(value)
    return result_key(losses.canonical(loss), rule)


def _read_lrs(value, flag: str) -> list[float]:
    """`--lr`: a comma list, or `grid` (stage two's grid); a Python list of numbers, or one."""
    if isinstance(value, str):
        return list(GRID_LRS) if value.strip() == "grid" else parse_list(value, flag, float)
    for one in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(one, bool) or not isinstance(one, (int, float)):
            raise SpmlError(f"{flag} {one!r}: use a number")
    return [float(one) for one in value] if isinstance(value, (list, tuple)) else [float(value)]


def _read_hparams(value, flag: str) -> dict:
    """`--hp key=value`: one value a key (a sweep belongs to the linear probe)."""
    hparams = read_hparams(value, flag)
    for key, one in hparams.items():
        if isinstance(one, (list, tuple)):
            raise SpmlError(f"{flag} {key}={','.join(f'{v:g}' for v in one)}: fine-tuning takes one value; sweep on"
                            " the linear probe (spml-cache linear --hp ...), then fine-tune from its best head")
    return hparams


def _hparams_differ(given_hparams: dict, stored: "FinetuneOptions"):
    """`--hp key=value` beside `--resume`: each value given against the run's own (resolved) value."""
    from spml_cache.losses import Overrides

    loss = split_key(stored.loss)[0]
    for key, value in Overrides.given([loss], given_hparams)[loss].items():
        if stored.hparams.get(key) != value:
            yield f"{key}={text(value)}", text(stored.hparams.get(key))


@dataclass(frozen=True, kw_only=True)
class FinetuneOptions(Options):
    """Every option of one `finetune` run that changes its results, as given (None: not given)."""

    init: str | None = given("best", "best: start from the best linear head (LinearInit, the default); imagenet: a"
                             " fresh head.", check=one_of(*INITS, fix="use best (LinearInit) or imagenet (a fresh"
                                                                      " head)"))
    from_run: Path | None = given(None, "Linear run to take the head from (default: the newest one for the dataset and"
                                  " loss under --out).", flag="--from", kind=Path, fallback="start")
    cache: Path | None = given(None, "Feature cache whose rows (ids, splits, observed labels) to fine-tune on"
                               " (default: the linear run's).", kind=Path, fallback="cache")
    dataset: str | None = given(None, "Dataset name, to find its newest linear run and default cache.",
                                fallback="cache")
    loss: str | None = given(None, "Loss to fine-tune with (spml-cache losses lists them); its head is the one taken;"
                             " loss@rule (an@entry:0.1) takes its head under that observation rule, and trains on"
                             " that rule's labels.", read=_read_loss, fallback="start")
    weights: str | None = given(None, "Trunk init, for the cache's backbone: a weights tag (IMAGENET1K_V1, ...), none"
                                " or a .pth (default: what made the cache); must match the cache for an exact"
                                " LinearInit.", fallback="trunk")
    epochs: int | None = given(FINETUNE_EPOCHS, "Epochs (default 10, or the loss's recipe: GR 8 on VOC/COCO).",
                               check=at_least(1), fallback="recipe")
    lrs: list[float] | None = given(DEFAULT_LRS, "Comma-separated learning rates, or 'grid' for 1e-2,1e-3,1e-4,1e-5"
                                    " (default 1e-5,1e-4).", flag="--lr", kind=float, many=True, read=_read_lrs,
                                    check=LRS, fallback="recipe")
    batch_sizes: list[int] | None = given(GRID_BATCH_SIZES, "Comma-separated global batch sizes (default 8,16); shared"
                                          " by torchrun's processes.", flag="--batch-size", kind=int, many=True,
                                          check=BATCH_SIZES, fallback="recipe")
    resolution: int | None = given(None, "Images are resized to R x R (default: the cache's resolution).", kind=int,
                                   check=at_least(32), fallback="cache")
    seeds: int | None = given(1, "Number of seeds (0..N-1) of batch order and flips (default 1).",
                              check=at_least(1, "seeds 0..N-1 are run"), load=seed_count)
    hparams: dict | None = given({}, "Loss hyperparameter override key=value (repeatable); default: the linear head's"
                                 " values.", flag="--hp", repeat=True, read=_read_hparams, compare=_hparams_differ,
                                 fallback="losses", derived=True)  # as given, then as resolved (None left out)
    head_lr_mult: float | None = given(1.0, "The head's learning rate multiplier (default 1; 10 for GR and LL, as their"
                                       " authors' code).", check=above(0, fix="must be positive"), fallback="recipe")
    skip_missing: bool | None = given(False, "Leave out rows whose image is missing under --root instead of stopping.",
                                      switch=True)
    fidelity: Fidelity | None = given(
        Fidelity.EXACT, "exact (default): the papers' math, computed stably; authors: their code's numerics,"
        " evaluation and early stopping (docs/fidelity.md).", read=Fidelity.check)
    decode: str | None = decode_option("the cache's decoder where this device runs it, so that epoch 0 is the linear"
                                       " head", fallback="cache")


@dataclass(frozen=True, kw_only=True)
class FinetunePlacement(Placement):
    """Where and how this process runs a fine-tuning, none of which changes its results: the images' root, the
    device, the folders read and written, the run to resume, the image reader processes."""

    root: Path | None = option(None, "Dataset root the cache was extracted from; images are read from ROOT/id"
                               " (default: $SPML_DATA; with --resume or --config, that run's own).", kind=Path)
    device: str = option("auto", "auto, cpu, cuda or cuda:N (under torchrun: each process's own GPU).")
    out: Path = option(Path("runs"), "Runs folder: where linear runs are looked up and the fine-tuning run is"
                       " written.")
    resume: Path | None = option(None, "Continue the interrupted fine-tuning run RUN from its last checkpoint.",
                                 kind=Path)
    config: Path | None = config_option("finetune")
    workers: int | None = option(None, "Image reader processes (default: 8 on a GPU, fewer on a CPU).", kind=int,
                                 check=at_least(0))
    trackers: tuple[str, ...] | None = option(None, TRACKERS_HELP, flag="--log", read=read_trackers)
    cache_dir: Path | None = option(None, "Where --dataset's cache is looked for.", kind=Path, flag="")
    log: Callable[[str], None] = field(default=lambda line: None, compare=False)  # where notes go (rank 0's)
    # told the run directory as soon as it exists, new or resumed (an experiment keeps it: a stop may follow)
    run_dir_made: Callable[[Path], None] | None = field(default=None, compare=False)
