"""Stage two's options (`spml-cache linear`, `linear.run_linear`): what changes a run's results
(`LinearOptions`: None where not given, so that the protocol's default applies or, with `--resume`, the run's own
setting, which a given option must not contradict) and where it runs (`LinearPlacement`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from rich.console import Console

from spml_cache import observation
from spml_cache.options.declared import Options, Placement, at_least, given, listed, one_of, option, text
from spml_cache.options.records import config_option
from spml_cache.options.text import RULES_HELP, parse_names, read_hparams, read_rules
from spml_cache.protocol import GRID_BATCH_SIZES, GRID_LRS, GRID_WDS, LINEAR_EPOCHS, Fidelity
from spml_cache.runtime import memory
from spml_cache.runtime.errors import SpmlError
from spml_cache.options.trackers import TRACKERS_HELP, read_trackers


# The grid's checks, for each stage that trains a grid (linear, finetune, the demo): at least one value, each
# positive (a weight decay: 0 or more) and finite; a value given twice is taken once, in the order given.
LRS = listed(lambda lr: lr > 0 and math.isfinite(lr), "every value must be positive", "1e-3")
BATCH_SIZES = listed(lambda size: size > 0, "every value must be positive and whole", "8")
WDS = listed(lambda wd: wd >= 0 and math.isfinite(wd), "every weight decay must be 0 or more (0: none)",
             "0,1e-4 (or leave it out for 0)")


def seed_count(stored) -> int:
    """`--seeds N` as config.json keeps it; an older run's config: its list of seeds 0..N-1."""
    return len(stored) if isinstance(stored, list) else stored


def resolve_losses(names: str | Sequence[str]) -> list[str]:
    """"all" (every built-in loss), loss names and plugin specs (`file.py:Class`, `module:Class`, loaded and
    known by their class's name from then on), each checked against the registry; "all" may stand beside
    plugins (`all,examples/masked_focal.py:MaskedFocal`)."""
    from spml_cache import losses as registry

    names = [name for name in ([names] if isinstance(names, str) else names) if name]
    if not names:
        raise SpmlError(f"--loss is empty: give a loss name, a comma list, or all ({', '.join(registry.names())})")
    resolved = []
    for name in names:
        resolved += registry.names() if name == "all" else [registry.get(name).name]  # raises if unknown
    return list(dict.fromkeys(resolved))


def _losses_differ(given_losses, stored: "LinearOptions"):
    from spml_cache import losses as registry

    names, theirs = resolve_losses(given_losses), list(stored.losses)
    if names == registry.names() and set(registry.names(similarity=False)) <= set(theirs):
        names = theirs  # `all`: on a cache without a text side, what the run kept of it
    if names != theirs:
        yield text(given_losses), text(theirs)


def _floats(value):
    return [float(one) for one in value] if isinstance(value, (list, tuple)) else value


def _hparams_differ(given_hparams, stored: "LinearOptions"):
    """`--hp key=value` beside `--resume`: each value given against the run's own (resolved) value."""
    from spml_cache.losses import Overrides

    for loss, values in Overrides.given(stored.losses, given_hparams).per_loss.items():
        for key, value in values.items():
            theirs = _floats(stored.hparams[loss].get(key))
            if _floats(value) != theirs:
                yield f"{loss}.{key}={text(_floats(value) if isinstance(value, list) else [float(value)])}", text(theirs)


def _paper_grids_differ(hp_grid, stored: "LinearOptions"):
    """`--hp-grid paper` beside `--resume`: each loss's paper search space against the run's values."""
    from spml_cache.losses import Overrides

    for loss, values in Overrides.given(stored.losses, {}).with_paper_grids().per_loss.items():
        for key, value in values.items():
            theirs = _floats(stored.hparams[loss].get(key))
            if _floats(value) != theirs:
                yield hp_grid, text(theirs)


def _read_hparams(value, flag):
    if hasattr(value, "per_loss"):  # a run's `Overrides`
        return value
    return read_hparams(value, flag)


def _stored_hparams(value) -> dict:
    return dict(getattr(value, "per_loss", value))


def _loaded_hparams(value) -> object:
    from spml_cache.losses import Overrides

    return Overrides.stored(value)  # a run's resolved values: resolving them again gives the same


def _budget_differ(budget: int, stored: "LinearOptions"):
    if stored.memory_budget is not None and budget != stored.memory_budget:  # a run from before it was stored: any
        yield memory.flag_text(budget), memory.flag_text(stored.memory_budget)


@dataclass(frozen=True, kw_only=True)
class LinearOptions(Options):
    """Every option of one `linear` run that changes its results, as given (None: not given)."""

    losses: str | Sequence[str] | None = given(
        "all", "A loss, a comma list (an,role), or all; see `spml-cache losses`.", flag="--loss",
        read=lambda value, flag: parse_names(value) if isinstance(value, str) else list(value),
        compare=_losses_differ, fallback="losses", derived=True)  # the names, `all` as those it stands for
    cache: Path | None = given(None, "The feature cache (.h5) to train on.", kind=Path, fallback="cache")
    dataset: str | None = given(None, "Train on the one cache of this dataset in $SPML_CACHE or ./cache.",
                                fallback="cache")
    lrs: Sequence[float] | None = given(GRID_LRS, "Learning rates, a comma list (default: the papers' grid).",
                                        flag="--lr", kind=float, many=True, check=LRS)
    wds: Sequence[float] | None = given(
        GRID_WDS, "The probe's L2 weight decays, a comma list (e.g. 0,1e-4,1e-3): one head per (lr, wd) in the same"
        " stacks, selected on val (default: 0, the papers' grid).", flag="--wd", kind=float, many=True, check=WDS)
    batch_sizes: Sequence[int] | None = given(GRID_BATCH_SIZES, "Batch sizes, a comma list (default: the papers' grid).",
                                              flag="--batch-size", kind=int, many=True, check=BATCH_SIZES)
    epochs: int | None = given(LINEAR_EPOCHS, "Epochs per head; the best val epoch is selected (default: the papers'"
                               " number).", check=at_least(1))
    seeds: int | None = given(1, "Run seeds 0..N-1 (init and batch order); results are mean ± std (default: one"
                              " seed).", check=at_least(1, "seeds 0..N-1 are run"), load=seed_count)
    hparams: Mapping | None = given(
        {}, "A hyperparameter key=value (repeatable); loss.key=value for one loss; key=v1,v2,... sweeps the values.",
        flag="--hp", repeat=True, read=_read_hparams, compare=_hparams_differ, dump=_stored_hparams,
        load=_loaded_hparams, fallback="losses", derived=True)  # per loss: as given, then as resolved
    val_labels: str | None = given("clean", "Select on clean (full) val labels, the default, or on the observed ones.",
                                   check=one_of("clean", "observed", fix="use clean (full val labels) or observed"))
    from_run: Path | None = given(None, "Start every head from this linear run's head of the same loss (else its best"
                                  " single-positive head).", flag="--from", kind=Path)
    fidelity: Fidelity | None = given(
        Fidelity.EXACT, "exact (default): the papers' math, computed stably; authors: their code's numerics, dropped"
        " last batches and early stopping (docs/fidelity.md).", read=Fidelity.check)
    hp_grid: str | None = given(
        None, "paper: sweep each loss's own search space where its paper states one (spml-cache losses lists them);"
        " --hp values win.", check=one_of("paper", fix="use paper (each loss's own search space, see spml-cache"
                                          " losses)"), compare=_paper_grids_differ)
    observe: Sequence[observation.Rule] | None = given(
        tuple(observation.parse_rules(None)), f"Observation rules, a comma list (default single; {RULES_HELP}): every"
        " loss trains under each; rules the cache lacks are drawn from its full labels (docs/protocol.md).",
        read=read_rules)
    memory_budget: int | None = given(
        None, "Memory stage two may use, e.g. 1GB (default: 80% of the device's free memory); features beyond it"
        " stream from the cache in a seeded chunk order planned from the budget and the cache's shapes"
        " (docs/protocol.md).", read=lambda value, flag: memory.parse_size(value, flag), compare=_budget_differ,
        fallback="plan")
    chunk_rows: int | None = given(
        None, "Stream the train features in chunks of N rows whatever the budget: the same chunk order, and results,"
        " on any machine (docs/protocol.md).", kind=int, check=at_least(1, fix="give a whole number of rows, at"
                                                                         " least 1"),
        fallback="plan")  # not given: the plan's chunks where the features stream from the cache, else none


@dataclass(frozen=True, kw_only=True)
class LinearPlacement(Placement):
    """Where and how this process runs a `linear` run, none of which changes its results."""

    device: str = option("auto", "auto, cpu, cuda or cuda:N.")  # under torchrun: each process's own GPU
    out: Path | None = option(None, "Runs folder: writes <out>/<dataset>/linear-<backbone>-<loss>-<time>/"
                              " (default: runs).", kind=Path)  # None: runs, or a resumed run's own
    workers: int = option(0, "Processes training (loss, seed, batch size) jobs in parallel; 0: one per core on the CPU"
                          " when the grid is big.", check=at_least(0))
    resume: Path | None = option(None, "Go on with the interrupted linear run RUN: train only what it has not kept,"
                                 " with its own settings (a flag beside it that contradicts them is refused).",
                                 kind=Path)
    config: Path | None = config_option("linear")
    graphs: bool = option(True, "On a GPU, train the stacks one by one, eagerly, instead of all at once as replayed"
                          " CUDA graphs (for debugging; same results up to float rounding).", flag="--no-graphs",
                          switch=True)
    compile_steps: bool = option(False, "Compile each stack's training step with torch.compile (inductor) where the"
                                 " run takes enough steps to pay it back (a closed-form loss, 100,000 full steps of"
                                 " a batch size: COCO-sized grids); prints the compile time. The same heads up to"
                                 " float rounding. Not beside CUDA graphs: on a GPU add --no-graphs.",
                                 flag="--compile", switch=True)
    trackers: tuple[str, ...] | None = option(None, TRACKERS_HELP, flag="--log", read=read_trackers)
    cache_dir: Path | None = option(None, "Where --dataset's cache is looked for.", kind=Path, flag="")
    console: Console | None = field(default=None, compare=False)  # where notes and progress go (None: progress's)
    # told the run directory as soon as it exists, new or resumed (an experiment keeps it: a stop may follow)
    run_dir_made: Callable[[Path], None] | None = field(default=None, compare=False)
