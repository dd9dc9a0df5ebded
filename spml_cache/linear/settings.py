"""Stage two's settings: the grid and the losses asked for, checked before anything is written; the
hyperparameters each loss trains with; the heads a run starts from (`--from`); and, for `--resume`, the settings
an interrupted run was started with.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping, Sequence

import torch

from spml_cache import losses as loss_registry, observation, runs
from spml_cache.cache import FeatureSet, cache_id
from spml_cache.labels import observed_for_loss
from spml_cache.linear.options import LinearOptions
from spml_cache.linear.parts import KeptParts
from spml_cache.losses import Overrides
from spml_cache.losses.contract import loss_faults
from spml_cache.losses.overrides import Combination
from spml_cache.losses.base import Fidelity
from spml_cache.observation import Observed, Rule
from spml_cache.protocol import GRID_WDS, check_grid, check_wds
from spml_cache.runtime import memory
from spml_cache.runtime.errors import SpmlError


MAX_HEADS = 10_000  # beyond this a sweep is more likely a typo than a plan


@dataclass(frozen=True)
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
        """The grid `options` give (the protocol's defaults where not given), checked. `losses`: "all", or loss
        names; `hparams`: `{key: value}` or `{"loss.key": value}` (`--hp`), a value a list to sweep it, or the
        `Overrides` of a resumed run; `hp_grid="paper"`: every loss's own search space where its paper states one;
        `observe`: the observation rules (None: `single`); `wds`: the weight decays, each trained beside every lr
        (None: `GRID_WDS`, none)."""
        epochs, seeds, val_labels, hparams = (options.value(name) for name in ("epochs", "seeds", "val_labels",
                                                                              "hparams"))
        hp_grid, observe, wds = options.hp_grid, options.observe, options.wds
        names = resolve_losses(options.value("losses"))
        lrs, batch_sizes = check_grid(options.value("lrs"), options.value("batch_sizes"))
        wds = check_wds(GRID_WDS if wds is None else wds)
        if epochs < 1:
            raise SpmlError(f"--epochs {epochs}: must be at least 1")
        if seeds < 1:
            raise SpmlError(f"--seeds {seeds}: must be at least 1 (seeds 0..N-1 are run)")
        if val_labels not in ("clean", "observed"):
            raise SpmlError(f"--val-labels {val_labels!r}: use clean (full val labels) or observed")
        fidelity = Fidelity.check(options.fidelity)
        if hp_grid not in (None, "paper"):
            raise SpmlError(f"--hp-grid {hp_grid!r}: use paper (each loss's own search space, see spml-cache losses)")
        overrides = hparams if isinstance(hparams, Overrides) else Overrides.given(names, hparams)
        overrides = overrides.with_paper_grids() if hp_grid == "paper" else overrides
        rules = list(observe) if observe else observation.parse_rules(None)
        heads = len(lrs) * len(batch_sizes) * seeds * sum(len(overrides.combinations(name)) for name in names)
        heads *= len(rules) * len(wds)
        if heads > MAX_HEADS:
            raise SpmlError(f"the grid has {heads:,} heads (losses x lrs x weight decays x batch sizes x seeds x hyperparameter values"
                            f" x rules), more than {MAX_HEADS:,}: sweep fewer values at a time")
        return cls(names, lrs, batch_sizes, epochs, list(range(seeds)), overrides, val_labels, fidelity, rules, wds)

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


def resolve_losses(names: str | Sequence[str]) -> list[str]:
    """"all" (every built-in loss), loss names and plugin specs (`file.py:Class`, `module:Class`, loaded and
    known by their class's name from then on), each checked against the registry; "all" may stand beside
    plugins (`all,examples/masked_focal.py:MaskedFocal`)."""
    if isinstance(names, str):
        names = [names]
    names = [name for name in names if name]
    if not names:
        raise SpmlError(f"--loss is empty: give a loss name, a comma list, or all ({', '.join(loss_registry.names())})")
    resolved = []
    for name in names:
        resolved += loss_registry.names() if name == "all" else [loss_registry.get(name).name]  # raises if unknown
    return list(dict.fromkeys(resolved))


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


def stored_settings(run_dir: Path) -> tuple[dict, LinearSettings, Path | None]:
    """`--resume RUN`: the config of an interrupted linear run, its settings, and the run its heads started from."""
    # a plugin that changed since the run began goes on only while none of its parts is kept (fixed after it failed)
    config = runs.open_for_resume(run_dir, "linear", renewable=lambda name: name not in KeptParts(run_dir).losses())
    grid = runs.Grid.from_config(config)
    rules = observation.parse_rules(config["observe"]) if config.get("observe") else None
    settings = LinearSettings.of(LinearOptions(
        losses=grid.losses, lrs=grid.lrs, batch_sizes=grid.batch_sizes, epochs=grid.epochs, seeds=len(grid.seeds),
        hparams=Overrides.stored(grid.hparams), val_labels=grid.val_labels, fidelity=grid.fidelity, observe=rules,
        wds=config.get("wds")))
    starts = config.get("from") or {}
    from_run = next((Path(start["run"]) for start in starts.values() if start), None)
    return config, settings, from_run



def refuse_contradictions(run_dir: Path, config: dict, settings: LinearSettings, given: Mapping) -> None:
    """`--resume RUN` trains with RUN's settings: a flag given beside it that says otherwise (`given`: the values
    given, None where a flag was left out) is refused in one line naming it; one that agrees is accepted."""
    for flag, shown, ours, theirs in _resume_flags(config, settings, given):
        if shown is not None and ours != theirs:
            raise SpmlError(f"--resume {run_dir}: {flag} {shown} contradicts the run's {_text(theirs)} (a resumed run"
                            f" keeps its own settings): leave out {flag}, or start a new run with it")


def _text(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(f"{one:g}" if isinstance(one, float) else str(one) for one in value) or "none"
    return "none" if value is None else str(value)


def _resume_flags(config: dict, settings: LinearSettings, given: Mapping):
    """(flag, the value given as text or None when it was left out, it as the run would store it, what the run
    stores) for every setting a flag can give."""
    get = given.get
    names = get("losses") and resolve_losses(get("losses"))
    if names and names == loss_registry.names() and settings.every_loss:
        names = settings.losses  # `all`: on a cache without a text side, what the run kept of it
    starts = [Path(start["run"]).resolve() for start in (config.get("from") or {}).values() if start]
    budget = get("memory_budget") and memory.flag_text(memory.parse_size(get("memory_budget")))
    stored_budget = config.get("memory_budget")
    rules = get("observe") and [rule.text for rule in get("observe")]
    listed = {key: get(key) and [kind(v) for v in get(key)]
              for key, kind in (("lrs", float), ("batch_sizes", int), ("wds", float))}
    yield from [
        ("--loss", names and _text(get("losses")), names, settings.losses),
        ("--lr", listed["lrs"] and _text(listed["lrs"]), listed["lrs"], settings.lrs),
        ("--batch-size", listed["batch_sizes"] and _text(listed["batch_sizes"]), listed["batch_sizes"],
         settings.batch_sizes),
        ("--wd", listed["wds"] and _text(listed["wds"]), listed["wds"] and check_wds(listed["wds"]), settings.wds),
        ("--epochs", get("epochs"), get("epochs"), settings.epochs),
        ("--seeds", get("seeds"), get("seeds"), len(settings.seeds)),
        ("--val-labels", get("val_labels"), get("val_labels"), settings.val_labels),
        ("--fidelity", get("fidelity"), get("fidelity") and Fidelity.check(get("fidelity")), settings.fidelity),
        ("--observe", rules and _text(rules), rules, [rule.text for rule in settings.rules]),
        ("--from", get("from_run"), get("from_run") and Path(get("from_run")).resolve(), starts[0] if starts else None),
        ("--chunk-rows", get("chunk_rows"), get("chunk_rows") and min(get("chunk_rows"), config.get("num_train") or
                                                                       get("chunk_rows")),
         (config.get("out_of_core") or {}).get("chunk_rows")),  # more than the training rows is all of them
        # a run from before the budget was stored takes the one given
        ("--memory-budget", budget, budget, budget if stored_budget is None else memory.flag_text(stored_budget)),
        *_hparam_flags(settings, get("hparams"), get("hp_grid")),
    ]


def _hparam_flags(settings: LinearSettings, hparams: Mapping | None, hp_grid: str | None):
    """`--hp key=value` and `--hp-grid paper` beside `--resume`: each value given against the run's own."""
    floats = lambda value: [float(v) for v in value] if isinstance(value, (list, tuple)) else value
    for loss, values in (Overrides.given(settings.losses, hparams).per_loss.items() if hparams else ()):
        for key, value in values.items():
            yield "--hp", f"{loss}.{key}={_text(floats(value) if isinstance(value, list) else [float(value)])}", \
                floats(value), floats(settings.overrides[loss].get(key))
    if hp_grid is not None:
        for loss, values in Overrides.given(settings.losses, {}).with_paper_grids().per_loss.items():
            for key, value in values.items():
                yield "--hp-grid", hp_grid, floats(value), floats(settings.overrides[loss].get(key))
