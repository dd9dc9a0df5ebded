"""Stage two's settings: the grid and the losses asked for, checked before anything is written; the
hyperparameters each loss trains with; the heads a run starts from (`--from`); and, for `--resume`, the settings
an interrupted run was started with.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from spml_cache import losses as loss_registry, observation, runs
from spml_cache.cache import FeatureSet, cache_id
from spml_cache.labels import observed_for_loss
from spml_cache.losses import Overrides
from spml_cache.losses.contract import loss_faults
from spml_cache.losses.overrides import Combination
from spml_cache.observation import Observed, Rule
from spml_cache.options import LinearOptions
from spml_cache.options.linear import resolve_losses
from spml_cache.protocol import GRID_WDS, Fidelity, check_grid, check_wds
from spml_cache.runtime.errors import SpmlError


MAX_HEADS = 10_000  # beyond this a sweep is more likely a typo than a plan


@dataclass(frozen=True, kw_only=True)
class LinearSettings:
    """The checked grid of one `linear` run."""

    losses: list[str]
    lrs: list[float]
    batch_sizes: list[int]
    epochs: int
    seeds: list[int]
    overrides: Overrides  # per loss: the hyperparameters given (`hparams` in config.json holds the resolved values)
    val_labels: str
    fidelity: Fidelity
    rules: list[Rule]  # the observation rules every loss trains under (`--observe`; `single` alone by default)
    wds: list[float] = field(default_factory=lambda: list(GRID_WDS))  # the probe's weight decays (`--wd`)

    @classmethod
    def of(cls, options: LinearOptions) -> "LinearSettings":
        """The grid `options` give (the protocol's defaults where not given), checked: the losses named ("all": every
        built-in), the hyperparameters given (`--hp`, each loss's paper search space with `hp_grid`, or a resumed
        run's `Overrides`) and the number of heads they make."""
        names = resolve_losses(options.value("losses"))
        lrs, batch_sizes = check_grid(options.value("lrs"), options.value("batch_sizes"))
        wds = check_wds(options.value("wds"))
        hparams, seeds = options.value("hparams"), options.value("seeds")
        overrides = hparams if isinstance(hparams, Overrides) else Overrides.given(names, hparams)
        overrides = overrides.with_paper_grids() if options.hp_grid == "paper" else overrides
        rules = list(options.observe) if options.observe else observation.parse_rules(None)
        heads = len(lrs) * len(batch_sizes) * seeds * sum(len(overrides.combinations(name)) for name in names)
        heads *= len(rules) * len(wds)
        if heads > MAX_HEADS:
            raise SpmlError(f"the grid has {heads:,} heads (losses x lrs x weight decays x batch sizes x seeds x hyperparameter values"
                            f" x rules), more than {MAX_HEADS:,}: sweep fewer values at a time")
        return cls(losses=names, lrs=lrs, batch_sizes=batch_sizes, epochs=options.value("epochs"),
                   seeds=list(range(seeds)), overrides=overrides, val_labels=options.value("val_labels"),
                   fidelity=options.value("fidelity"), rules=rules, wds=wds)

    def taken(self, used: dict[str, list[Combination]], given: LinearOptions, **planned) -> LinearOptions:
        """The options a run of these settings takes (config.json's `options`, what `--resume` reads back): those
        given, with their defaults; the losses, grid and rules as trained, the hyperparameters resolved (`used`);
        and `planned`: the cache, the memory plan, the run the heads start from."""
        return replace(given.with_defaults(), losses=self.losses, lrs=self.lrs, wds=self.wds,
                       batch_sizes=self.batch_sizes, observe=self.rules,
                       hparams=Overrides.stored({name: loss_registry.merged(combos) for name, combos in used.items()}),
                       **planned)

    @property
    def wd_axis(self) -> list[float] | None:
        """The weight decays when the grid has that axis (any but 0 alone), else None: the papers' grid, whose
        files name no weight decay."""
        return None if self.wds == list(GRID_WDS) else list(self.wds)

    @property
    def every_loss(self) -> bool:
        """`--loss all` (on a cache without a text side: every loss that does not read one), plugins beside."""
        return set(loss_registry.names(similarity=False)) <= set(self.losses)

    def for_cache(self, features: FeatureSet) -> tuple["LinearSettings", list[str]]:
        """These settings on `features`, and notes: on a cache without a text side, the losses that read one are
        refused when named, left out of `--loss all` (with a note)."""
        needing = [name for name in self.losses if loss_registry.get(name).needs_similarity]
        if features.has_text_side or not needing:
            return self, []
        if not self.every_loss:
            features.require_text_side(needing)
        kept = [name for name in self.losses if name not in needing]
        return replace(self, losses=kept), [f"--loss all: {', '.join(needing)} left out ({features.path} has no text"
                                            " side; a CLIP cache has one: extract --backbone clip:ViT-B-16/openai)"]

    def heads_at_once(self) -> int:
        """The most heads one job trains and scores together: every lr, batch size and hyperparameter value."""
        return len(self.lrs) * len(self.batch_sizes) * self.heads_per_lr()

    def heads_per_lr(self) -> int:
        """The heads of one lr and one batch size: one per weight decay and hyperparameter value (the smallest
        group trained)."""
        return len(self.wds) * max(len(self.overrides.combinations(name)) for name in self.losses)

    def units(self, observed: dict[str, Observed], train_labels) -> tuple[dict[str, tuple[str, str]], list[str]]:
        """What the run trains, `{result key: (loss, rule text)}` (rule by rule, losses in order), and notes.

        A loss that learns only from observed positives (`needs_positive`) cannot train under a rule that leaves
        images with a positive but none observed: refused when named, left out of `--loss all` (with a note)."""
        units, notes = {}, []
        for rule in self.rules:
            lacking = int(observation.without_positive(observed[rule.text].train, train_labels).sum())
            for name in self.losses:
                if lacking and loss_registry.get(name).needs_positive:
                    why = (f"{lacking:,} of {len(train_labels):,} training images have a positive but none observed,"
                           f" and {name} learns only from observed positives")
                    if not self.every_loss:
                        raise SpmlError(f"{observation.FLAG} {rule} with --loss {name}: {why}: use a rule that keeps"
                                        " one per image (single, keep-pos:F, uniform:pos=K), or leave"
                                        f" {name} out of --loss")
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
    text = features.train_similarities() if any(
        loss_registry.get(name).needs_similarity for name in settings.losses) else {}
    used = {}
    for name in settings.losses:
        with loss_faults([name]):  # its construction raised: one line naming it
            used[name] = Combination.of([
                loss_registry.resolve_hparams(
                    name, combo, num_classes=len(features.classes), dataset=features.dataset,
                    train_observed=observed_for_loss(features.train.observed, loss_registry.reads_whole_observed(name)),
                    expected_positives=features.attrs.get("expected_positives"), **text,
                )
                for combo in settings.overrides.combinations(name)
            ])
    return used


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


def stored_options(config: dict) -> LinearOptions:
    """`--resume RUN`: the options an interrupted run took, as its config.json keeps them (`options`, whole), or
    as a run from before that read them from its grid and its stage extras."""
    if "options" in config:
        return LinearOptions.from_stored(config["options"])
    grid = runs.Grid.from_config(config)
    starts = [start["run"] for start in (config.get("from") or {}).values() if start]
    return LinearOptions(
        cache=config["cache"], dataset=config["dataset"], losses=grid.losses, lrs=grid.lrs,
        batch_sizes=grid.batch_sizes, wds=config.get("wds") or list(GRID_WDS), epochs=grid.epochs,
        seeds=len(grid.seeds), hparams=Overrides.stored(grid.hparams), val_labels=grid.val_labels,
        fidelity=grid.fidelity, observe=config.get("observe") or [observation.DEFAULT_RULE],
        from_run=starts[0] if starts else None, memory_budget=config.get("memory_budget"),
        chunk_rows=(config.get("out_of_core") or {}).get("chunk_rows"))
