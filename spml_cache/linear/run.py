"""Stage two (`spml-cache linear`): linear heads on cached features, the papers' linear-probe regime, fast.

Checks every input before anything is written, then for each loss and seed trains all (lr, batch size)
configs at once (`engine.py`, in jobs: `jobs.py`), selects per docs/protocol.md (`selection.py`) and writes
the run directory (`runs.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from rich.console import Console

from spml_cache import losses as loss_registry
from spml_cache import runs
from spml_cache.cache import FeatureSet, cache_id, find_cache, load
from spml_cache.devices import resolve_device
from spml_cache.errors import SpmlError
from spml_cache.linear.jobs import merged_progress, resolve_workers, train_jobs
from spml_cache.linear.engine import LinearData
from spml_cache.linear.live import LiveTable
from spml_cache.metrics import mean_average_precision
from spml_cache.progress import console as progress_console
from spml_cache.protocol import GRID_BATCH_SIZES, GRID_LRS, LINEAR_EPOCHS, check_grid
from spml_cache.runs import load_results, read_linear_head
from spml_cache.selection import HeadRecord, loss_results, select_config


# --- inputs: everything is checked before the run directory exists -----------------------------------------


@dataclass(frozen=True)
class LinearSettings:
    """The checked grid of one `linear` run."""

    losses: list[str]
    lrs: list[float]
    batch_sizes: list[int]
    epochs: int
    seeds: list[int]
    overrides: dict  # per loss: the hyperparameters given (`hparams` in config.json holds the resolved values)
    val_labels: str

    @classmethod
    def check(cls, losses_: str | Sequence[str], lrs: Sequence[float], batch_sizes: Sequence[int], epochs: int,
              seeds: int, hparams: dict[str, float], val_labels: str) -> "LinearSettings":
        """`losses_`: "all", or loss names; `hparams`: `{key: value}` or `{"loss.key": value}`."""
        names = resolve_losses(losses_)
        lrs, batch_sizes = check_grid(lrs, batch_sizes)
        if epochs < 1:
            raise SpmlError(f"--epochs {epochs}: must be at least 1")
        if seeds < 1:
            raise SpmlError(f"--seeds {seeds}: must be at least 1 (seeds 0..N-1 are run)")
        if val_labels not in ("clean", "observed"):
            raise SpmlError(f"--val-labels {val_labels!r}: use clean (full val labels) or observed")
        return cls(names, lrs, batch_sizes, epochs, list(range(seeds)), loss_registry.overrides_for(names, dict(hparams)),
                   val_labels)


def resolve_losses(names: str | Sequence[str]) -> list[str]:
    """"all", or loss names, each checked against the registry."""
    if isinstance(names, str):
        names = [names]
    names = [name for name in names if name]
    if names == ["all"]:
        return loss_registry.names()
    if not names:
        raise SpmlError(f"--loss is empty: give a loss name, a comma list, or all ({', '.join(loss_registry.names())})")
    for name in names:
        loss_registry.get(name)  # raises with the valid names
    return list(dict.fromkeys(names))


def resolved_hparams(settings: LinearSettings, features: FeatureSet) -> dict[str, dict]:
    """Per loss, the hyperparameters it trains with (checked by building it once)."""
    return {
        name: loss_registry.resolve_hparams(
            name, settings.overrides[name], num_classes=len(features.classes), dataset=features.dataset,
            train_observed=torch.from_numpy(features.train.observed),
            expected_positives=features.attrs.get("expected_positives"),
        )
        for name in settings.losses
    }


def start_heads(from_run: Path | str | None, names: list[str], features: FeatureSet) -> dict[str, dict]:
    """`--from RUN`: per loss, the head its heads start from: RUN's selected head of the same loss, else RUN's
    best single-positive head (highest val mAP; never an oracle's, which saw the full labels). The loss's own
    state (ROLE's theta) comes along when it is the same loss on the same cache.
    `{loss: {"weight", "bias", "loss_state", "from"}}`; empty without `--from`."""
    if from_run is None:
        return {}
    trained = load_results(from_run).get("losses", {})
    fair = [name for name in trained if trained[name].get("val_map") is not None
            and name in loss_registry.names() and not loss_registry.get(name).oracle]
    fallback = max(fair, key=lambda name: trained[name]["val_map"], default=None)
    sources = {name: name if name in trained else fallback for name in names}
    if None in sources.values():
        missing = [name for name, source in sources.items() if source is None]
        raise SpmlError(f"--from {from_run} has no head for {', '.join(missing)} and no single-positive head to"
                        " start from: pass a run that trained those losses")
    read = {source: read_linear_head(Path(from_run), source) for source in dict.fromkeys(sources.values())}
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
        starts[name] = {"weight": head.weight, "bias": head.bias, "loss_state": head.loss_state if keep_state else {},
                        "from": {"run": str(head.run), "loss": head.loss, **head.settings}}
    return starts


# --- the run ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearRun:
    run_dir: Path
    results: dict


def run_linear(
    *, cache: Path | str | None = None, dataset: str | None = None, cache_dir: Path | str | None = None,
    losses: str | Sequence[str] = "all", lrs: Sequence[float] = GRID_LRS, batch_sizes: Sequence[int] = GRID_BATCH_SIZES,
    epochs: int = LINEAR_EPOCHS, seeds: int = 1, hparams: dict[str, float] | None = None, device: str = "auto",
    out: Path | str = "runs", val_labels: str = "clean", workers: int = 0, from_run: Path | str | None = None,
    console: Console | None = None,
) -> LinearRun:
    """`spml-cache linear`: train the (loss x lr x batch size x seed) grid, select, write a run directory.

    A job trains every lr of one (loss, seed) and its batch sizes; with `workers` > 1 each batch size is its
    own job, so that even one loss's grid spreads over the cores (same results either way). `from_run`: every
    head starts from that linear run's head (`start_heads`) instead of its seed's initialisation.
    """
    settings = LinearSettings.check(losses, lrs, batch_sizes, epochs, seeds, hparams or {}, val_labels)
    target = resolve_device(device)
    features = load(find_cache(cache, dataset, cache_dir))
    used = resolved_hparams(settings, features)
    starts = start_heads(from_run, settings.losses, features)
    pairs = [(name, index, seed) for name in settings.losses for index, seed in enumerate(settings.seeds)]
    split = [(name, index, seed, (size,)) for name, index, seed in pairs for size in settings.batch_sizes]
    workers = resolve_workers(workers, target, len(split), len(features.train) * settings.epochs * len(pairs))
    jobs = split if workers > 1 else [(name, index, seed, tuple(settings.batch_sizes)) for name, index, seed in pairs]
    data = LinearData.from_features(features, target, settings.val_labels)

    label = "all" if settings.losses == loss_registry.names() else "+".join(settings.losses)
    grid = {"losses": settings.losses, "lrs": settings.lrs, "batch_sizes": settings.batch_sizes,
            "epochs": settings.epochs, "seeds": settings.seeds, "hparams": used, "val_labels": settings.val_labels}
    run_dir = runs.start_run(
        out, stage="linear", label=label, features=features, device=target, grid=grid, workers=workers,
        num_train=data.num_train, num_val=data.num_val, num_test=len(features.test),
        feature_dim=data.train_features.shape[1], **{"from": {name: s["from"] for name, s in starts.items()} or None},
    )
    runs.write_labels(run_dir, train_labels=features.train.labels, train_observed=features.train.observed,
                      val_labels=features.val.labels, test_labels=features.test.labels)

    def grid_order(record) -> tuple:  # seed, then lr, then batch size: selection breaks ties in this order
        return record.seed, settings.lrs.index(record.lr), settings.batch_sizes.index(record.batch_size)

    entries, checkpoints = {}, {}
    expected = {name: sum(1 for job in jobs if job[0] == name) for name in settings.losses}
    finished: dict[str, list] = {name: [] for name in settings.losses}
    progress: dict[tuple, dict] = {}
    with LiveTable(settings.losses, len(settings.seeds), settings.epochs, console or progress_console) as live:
        for (name, index, part), epoch_best, lines, job in train_jobs(jobs, used, settings, data, features, workers, starts):
            runs.append_metrics(run_dir, lines)
            if epoch_best is not None and name in finished:  # an epoch of a job of an unfinished loss
                progress.setdefault((name, index), {})[part] = epoch_best
                live.epoch(name, index, *merged_progress(progress[(name, index)].values()))
            if job is None:
                continue
            finished[name].append(job)
            if len(finished[name]) == expected[name]:  # every job of this loss is done
                done = finished.pop(name)
                records = sorted((record for records, _ in done for record in records), key=grid_order)
                seconds = sum(seconds for _, seconds in done)  # training time, summed over the loss's jobs
                entries[name], best = select_loss(run_dir, name, records, used[name], data, seconds)
                if best is not None:
                    checkpoints[name] = best
                live.loss_done(name, entries[name])
    results = runs.finish_run(
        run_dir, stage="linear", features=features, losses={name: entries[name] for name in settings.losses},
        checkpoints={name: checkpoints[name] for name in settings.losses if name in checkpoints},
    )
    return LinearRun(run_dir, results)


@torch.no_grad()
def head_scores(state: dict, features: torch.Tensor) -> torch.Tensor:
    """Sigmoid scores `[N, C]` of one head in `nn.Linear` layout."""
    weight = state["weight"].to(features.device)
    return torch.sigmoid(torch.addmm(state["bias"].to(features.device), features, weight.t()))


def select_loss(run_dir: Path, name: str, records: list[HeadRecord], hparams: dict, data: LinearData,
                seconds: float) -> tuple[dict, dict | None]:
    """Select one loss's config and write its `scores/<name>.npz`; its `results.json` and `best.pt` entries.

    The selected head (the best seed of the selected config) goes to best.pt with its `num_heads=1` loss state;
    train mAP is measured against the full training labels.
    """
    selection = select_config(records)
    if selection is None:
        return loss_results(records, None, hparams, [], seconds), None
    train_maps = [
        mean_average_precision(head_scores(r.best_state["head"], data.train_features), data.train_labels)
        for r in selection.records
    ]
    best = selection.representative
    train = head_scores(best.best_state["head"], data.train_features)
    evaluated = head_scores(best.best_state["head"], data.eval_features)
    runs.write_scores(run_dir, name, train=train, val=evaluated[: data.num_val], test=evaluated[data.num_val :])
    checkpoint = {
        "head": best.best_state["head"], "loss_state": best.best_state["loss_state"], "lr": best.lr,
        "batch_size": best.batch_size, "seed": best.seed, "epoch": best.best_epoch, "hparams": hparams,
    }
    return loss_results(records, selection, hparams, train_maps, seconds), checkpoint
