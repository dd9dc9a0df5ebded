"""Stage two's settings: the grid and the losses asked for, checked before anything is written; the
hyperparameters each loss trains with; the heads a run starts from (`--from`); and, for `--resume`, the settings
an interrupted run was started with.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from spml_cache import losses as loss_registry, observation, runs
from spml_cache.cache import FeatureSet, cache_id
from spml_cache.labels import observed_for_loss
from spml_cache.losses import Overrides
from spml_cache.losses.contract import loss_faults
from spml_cache.losses.overrides import Combination
from spml_cache.observation import Observed
from spml_cache.options import LinearOptions
from spml_cache.options.linear import resolve_losses
from spml_cache.options.records import rerun
from spml_cache.protocol import GRID_WDS, Fidelity
from spml_cache.runtime.errors import SpmlError


MAX_HEADS = 10_000  # beyond this a sweep is more likely a typo than a plan


@dataclass(frozen=True)
class LinearSettings:
    """What one `linear` run trains: its options, resolved (each a value: as given, else the run's own on
    `--resume`, else what the losses, the cache or the memory plan resolve it to, else its default; config.json
    keeps them whole), and what they decide."""

    options: LinearOptions

    @classmethod
    def of(cls, options: LinearOptions) -> "LinearSettings":
        """The grid `options` give (each checked by its declaration), resolved: the losses named ("all": every
        built-in), the hyperparameters given (`--hp`, each loss's paper search space with `hp_grid`, or a resumed
        run's `Overrides`); refused when they make too many heads."""
        names = resolve_losses(options.value("losses"))
        hparams = options.value("hparams")
        overrides = hparams if isinstance(hparams, Overrides) else Overrides.given(names, hparams)
        overrides = overrides.with_paper_grids() if options.hp_grid == "paper" else overrides
        settings = cls(options.resolved(losses={"losses": names, "hparams": overrides}))
        grid = settings.options
        heads = len(grid.lrs) * len(grid.batch_sizes) * grid.seeds * len(grid.observe) * len(grid.wds) * sum(
            len(overrides.combinations(name)) for name in names)
        if heads > MAX_HEADS:
            raise SpmlError(f"the grid has {heads:,} heads (losses x lrs x weight decays x batch sizes x seeds x hyperparameter values"
                            f" x rules), more than {MAX_HEADS:,}: sweep fewer values at a time")
        return settings

    def planned(self, **found) -> "LinearSettings":
        """These settings with what the run's plan found (`found`: the source each option falls back on, as
        `Options.resolved` takes them): the cache, the memory plan, the hyperparameters resolved."""
        return replace(self, options=self.options.resolved(**found))

    @property
    def seeds(self) -> list[int]:
        return list(range(self.options.seeds))

    @property
    def wd_axis(self) -> list[float] | None:
        """The weight decays when the grid has that axis (any but 0 alone), else None: the papers' grid, whose
        files name no weight decay."""
        wds = list(self.options.wds)
        return None if wds == list(GRID_WDS) else wds

    @property
    def every_loss(self) -> bool:
        """`--loss all` (on a cache without a text side: every loss that does not read one), plugins beside."""
        return set(loss_registry.names(similarity=False)) <= set(self.options.losses)

    def for_cache(self, features: FeatureSet) -> tuple["LinearSettings", list[str]]:
        """These settings on `features`, and notes: on a cache without a text side, the losses that read one are
        refused when named, left out of `--loss all` (with a note)."""
        losses = self.options.losses
        needing = [name for name in losses if loss_registry.get(name).needs_similarity]
        if features.has_text_side or not needing:
            return self, []
        if not self.every_loss:
            features.require_text_side(needing)
        kept = [name for name in losses if name not in needing]
        return self.planned(losses={"losses": kept}), [
            f"--loss all: {', '.join(needing)} left out ({features.path} has no text side; a CLIP cache has one:"
            " extract --backbone clip:ViT-B-16/openai)"]

    def heads_at_once(self) -> int:
        """The most heads one job trains and scores together: every lr, batch size and hyperparameter value."""
        return len(self.options.lrs) * len(self.options.batch_sizes) * self.heads_per_lr()

    def heads_per_lr(self) -> int:
        """The heads of one lr and one batch size: one per weight decay and hyperparameter value (the smallest
        group trained)."""
        hparams = self.options.hparams  # per loss, as given (an `Overrides`), or as resolved once the run is planned
        return len(self.options.wds) * max(len(hparams.combinations(name)) for name in self.options.losses)

    def units(self, observed: dict[str, Observed], train_labels) -> tuple[dict[str, tuple[str, str]], list[str]]:
        """What the run trains, `{result key: (loss, rule text)}` (rule by rule, losses in order), and notes.

        A loss that learns only from observed positives (`needs_positive`) cannot train under a rule that leaves
        images with a positive but none observed: refused when named, left out of `--loss all` (with a note)."""
        units, notes = {}, []
        for rule in self.options.observe:
            lacking = int(observation.without_positive(observed[rule.text].train, train_labels).sum())
            for name in self.options.losses:
                if lacking and loss_registry.get(name).needs_positive:
                    why = (f"{lacking:,} of {len(train_labels):,} training images have a positive but none observed,"
                           f" and {name} learns only from observed positives")
                    if not self.every_loss:
                        raise SpmlError(f"{observation.FLAG} {rule} with --loss {name}: {why}: use a rule that keeps"
                                        f" one per image ({observation.keeping_a_positive()}), or leave {name} out"
                                        " of --loss")
                    notes.append(f"--loss all: {name} left out under {rule} ({why})")
                    continue
                units[observation.result_key(name, rule)] = (name, rule.text)
        return units, notes


@dataclass(frozen=True)
class StartHead:
    """The head every head of one loss starts from (`--from RUN`), and where it comes from."""

    weight: torch.Tensor  # [C, D]
    bias: torch.Tensor  # [C]
    loss_state: dict  # the loss's own state (ROLE's theta): the same loss on the same cache only, else empty
    source: dict  # {"run", "loss", "lr", "batch_size", "seed", "epoch"}: config.json's `from` entry


def resolved_hparams(settings: LinearSettings, features: FeatureSet) -> dict[str, list[Combination]]:
    """Per loss, every combination of hyperparameters its heads train with (one without a sweep), each checked
    by building the loss once."""
    names = settings.options.losses
    text = features.train_similarities() if any(loss_registry.get(name).needs_similarity for name in names) else {}
    used = {}
    for name in names:
        with loss_faults([name]):  # its construction raised: one line naming it
            used[name] = Combination.of([
                loss_registry.resolve_hparams(
                    name, combo, num_classes=len(features.classes), dataset=features.dataset,
                    train_observed=observed_for_loss(features.train.observed, loss_registry.reads_whole_observed(name)),
                    expected_positives=features.attrs.get("expected_positives"), **text,
                )
                for combo in settings.options.hparams.combinations(name)
            ])
    return used


def kept_hparams(used: dict[str, list[Combination]]) -> Overrides:
    """The hyperparameters each loss trains with (`resolved_hparams`) as the run keeps them (config.json's
    `hparams`: a swept key's values as its list), which resolve to the same combinations again on `--resume`."""
    return Overrides.stored({name: loss_registry.merged(combos) for name, combos in used.items()})


def start_heads(from_run: Path | str | None, names: list[str], features: FeatureSet) -> dict[str, StartHead]:
    """`--from RUN`: per loss, the head its heads start from: RUN's selected head of the same loss, else RUN's
    best single-positive head (highest val mAP; never an oracle's, which saw the full labels). The loss's own
    state (ROLE's theta) comes along when it is the same loss on the same cache.
    `{loss: StartHead}`; empty without `--from`."""
    if from_run is None:
        return {}
    trained = runs.load_results(from_run).get("losses", {})
    fallback = runs.best_loss(trained)
    sources = {name: name if name in trained else fallback for name in names}
    if None in sources.values():
        missing = [name for name, source in sources.items() if source is None]
        raise SpmlError(f"--from {from_run} has no head for {', '.join(missing)} and no single-positive head to"
                        " start from: pass a run that trained those losses")
    read = {source: runs.read_linear_head(Path(from_run), source) for source in dict.fromkeys(sources.values())}
    num_classes, dim = len(features.classes), features.train.features.shape[1]
    same_cache = cache_id(features.attrs)
    starts = {}
    for name in names:
        head = read[sources[name]]
        if tuple(head.weight.shape) != (num_classes, dim) or (head.classes and list(head.classes) != features.classes):
            theirs = head.classes or [f"{head.weight.shape[0]} classes"]
            raise SpmlError(
                f"--from {from_run}: its heads predict {len(theirs)} classes ({', '.join(map(str, theirs[:3]))}, ...)"
                f" from {head.weight.shape[1]}-d features, but {features.path} has {num_classes} classes"
                f" ({', '.join(features.classes[:3])}, ...) of {dim}-d features: train on the cache that run used,"
                " or leave out --from"
            )
        keep_state = head.loss == name and head.cache_id == same_cache
        starts[name] = StartHead(head.weight, head.bias, head.loss_state if keep_state else {},
                                 {"run": str(head.run), "loss": head.loss, **head.settings})
    for said in dict.fromkeys(runs.other_cache(head, same_cache, features.path) for head in read.values()):
        if said:  # the heads fit, but come from another cache's features: one line, not silence
            warnings.warn(said, stacklevel=2)
    return starts


def stored_options(config: dict, file: Path) -> LinearOptions:
    """`--resume RUN`: the options an interrupted run took, as its config.json (`file`) keeps them: each under its
    own name; in a run's from before, under `options`, or (older still) in its grid and its stage extras. A value
    its declaration refuses is the file's (edited or damaged), named by its key."""
    if "options" in config:
        return LinearOptions.from_stored(config["options"], file, "options.")
    starts = [start["run"] for start in (config.get("from") or {}).values() if start]
    before = {"wds": list(GRID_WDS), "observe": [observation.DEFAULT_RULE], "fidelity": Fidelity.EXACT.value,
              "from_run": starts[0] if starts else None,  # what a run from before these were kept took
              "chunk_rows": (config.get("out_of_core") or {}).get("chunk_rows")}
    return LinearOptions.from_stored({**before, **config}, file)


def rerun_options(config: Path, resume: Path | None, given: LinearOptions) -> tuple[LinearOptions, str]:
    """`--config RUN/config.json`: that run's options (read as `--resume` reads them), each option given in its
    place, and the line saying so. The record's `--hp` values stay, per loss, beside those given (a loss it did
    not train starts from none); its dataset is its cache's, unless `--dataset` is given in place of `--cache`."""
    file, record = runs.open_record(config, resume, "linear")
    stored = stored_options(record, file)
    options, line = rerun(stored, given, file, clears={"dataset": ("cache",)}, derived=("dataset",))
    if given.hparams is not None or given.losses is not None:
        names, kept = resolve_losses(options.losses), stored.hparams.per_loss
        added = Overrides.given(names, given.hparams or {}).per_loss
        options = replace(options, hparams=Overrides({name: {**kept.get(name, {}), **added[name]} for name in names}))
    return options, line
