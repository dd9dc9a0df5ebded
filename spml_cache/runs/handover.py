"""The linear -> fine-tune handover: which finished linear run and which of its heads a later stage starts
from (stage three's LinearInit, `linear --from`, the demo), by one rule."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from spml_cache import losses as loss_registry
from spml_cache.observation.keys import DEFAULT_RULE, split_key
from spml_cache.runs.files import load_checkpoint, read_json
from spml_cache.runs.layout import RESULTS, safe_name
from spml_cache.runs.reading import is_complete, load_results, run_stamp
from spml_cache.runtime.errors import SpmlError


def newest_run(runs_root: Path | str, dataset: str, stage: str, *, loss: str,
               cache: str | None = None) -> Path | None:
    """The newest finished `stage` run of `dataset` under `runs_root` that trained `loss` (on cache id `cache`,
    when given) and kept its models; None if there is none. Without `cache`, runs made from different caches
    (another backbone, resolution or feature kind) are refused in one line, the way `linear --dataset` refuses
    a choice of caches: which one was meant is the user's to say."""
    usable = _usable_runs(Path(runs_root) / safe_name(dataset), stage, loss, cache)
    caches = {results.get("cache_id"): path for path, results in usable}
    if cache is None and len(caches) > 1:
        made_from = ", ".join(f"{path.name} ({_cache_name(path)})" for path in caches.values())
        raise SpmlError(f"{stage} runs of {loss} for {dataset} were made from {len(caches)} different caches"
                        f" (newest of each: {made_from}): pick one with --cache PATH or --from RUN")
    return max((path for path, _ in usable), key=lambda path: (run_stamp(path), path.name), default=None)


def _usable_runs(folder: Path, stage: str, loss: str, cache: str | None) -> list[tuple[Path, dict]]:
    """(run, results) of the finished runs in `folder` that trained `loss` and kept their models."""
    usable = []
    for path in sorted(folder.glob(f"{stage}-*")) if folder.is_dir() else []:
        if not (is_complete(path) and (path / "best.pt").exists()):
            continue
        try:
            results = read_json(path / RESULTS, dict)
        except SpmlError:  # a garbled results.json: not a run to start from
            continue
        if loss in results.get("losses", {}) and cache in (None, results.get("cache_id")):
            usable.append((path, results))
    return usable


def _cache_name(run: Path) -> str:
    """The file name of the cache a run was trained on, as its config.json records it."""
    try:
        return Path(read_json(run / "config.json")["cache"]).name
    except (SpmlError, KeyError, TypeError):
        return "cache unknown"


def check_same_cache(head: LinearHead, cache_id: str, cache_path) -> None:
    """The head must have been trained on the very cache a later stage reads (its id: settings and contents)."""
    if head.cache_id is not None and head.cache_id != cache_id:
        raise SpmlError(f"--from {head.run}: its heads were trained on {head.cache} (cache {head.cache_id}), not on"
                        f" {cache_path} (cache {cache_id}): fine-tune the cache that run used (--cache"
                        f" {head.cache}), or train a linear run on this one")


def other_cache(head: LinearHead, cache_id: str, cache_path) -> str | None:
    """What to say when `--from`'s head was trained on another cache than the one stage two trains on now (None
    when the same, or when the run predates cache ids): the heads fit (classes and width were checked), so they
    start all the same, but from features of another cache, which the user should know."""
    if head.cache_id is None or head.cache_id == cache_id:
        return None
    return (f"--from {head.run}: its heads were trained on {head.cache} (cache {head.cache_id}), not on"
            f" {cache_path} (cache {cache_id}); they start these heads all the same, without their loss state")


def best_loss(trained: dict[str, dict]) -> str | None:
    """The loss whose head a later stage starts from when none is named: the best val mAP among the
    single-positive losses (never an oracle: it saw the full labels), under any observation rule (a result key,
    `loss` or `loss@rule`). `trained` is results.json's `losses`."""
    fair = [key for key, entry in trained.items() if entry.get("val_map") is not None
            and _known(split_key(key)[0]) and not loss_registry.get(split_key(key)[0]).oracle]
    return max(fair, key=lambda key: trained[key]["val_map"], default=None)


def _known(name: str) -> bool:
    """A built-in loss, or a plugin loaded in this process (a run's plugins are loaded when it is read)."""
    return name in loss_registry.names() or loss_registry.plugins.origin(name) is not None


@dataclass(frozen=True, kw_only=True)
class LinearHead:
    """The selected head of one loss in a finished linear run, and what it was trained with."""

    run: Path
    loss: str
    weight: torch.Tensor  # [C, D]
    bias: torch.Tensor  # [C]
    loss_state: dict  # ROLE: {"theta": [1, N_train, C]}
    settings: dict  # lr, batch_size, seed, epoch
    hparams: dict
    val_map: float | None
    cache: str | None
    cache_id: str | None
    dataset: str | None  # the dataset and class names of the cache it was trained on
    classes: list | None
    rule: str = DEFAULT_RULE  # the observation rule of the labels it was trained on


def read_linear_head(run: Path, loss: str | None) -> LinearHead:
    """Loss `loss`'s head from linear run `run` (an oracle's too, when named; `loss@rule` for its head under an
    observation rule other than `single`); without a loss, the head of `best_loss`."""
    results = load_results(run)
    if results.get("stage") != "linear":
        raise SpmlError(f"--from {run} is a {results.get('stage')} run: pass a run of spml-cache linear")
    trained = results["losses"]
    if loss is None:
        loss = best_loss(trained)
        if loss is None:
            raise SpmlError(f"--from {run} has no single-positive head with a val mAP (only {', '.join(trained)}):"
                            " pass --loss NAME to take that loss's head")
    if loss not in trained:
        raise SpmlError(f"--from {run} trained {', '.join(trained)}, not {loss}: pass one of those to --loss")
    entry = load_checkpoint(run / "best.pt").get(loss)
    if not isinstance(entry, dict) or "head" not in entry:
        raise SpmlError(f"{run / 'best.pt'} holds no head for {loss}: re-run spml-cache linear --loss {loss}")
    config = read_json(run / "config.json", dict) if (run / "config.json").exists() else {}
    loss_registry.plugins.load_recorded(config.get("plugins"), run_dir=run, strict=False)  # its plugin losses
    return LinearHead(
        run=Path(run), loss=trained[loss].get("loss", loss), weight=entry["head"]["weight"].float(),
        bias=entry["head"]["bias"].float(), rule=trained[loss].get("rule", DEFAULT_RULE),
        loss_state=dict(entry.get("loss_state") or {}),
        settings={key: entry.get(key) for key in ("lr", "batch_size", "seed", "epoch")},
        hparams=dict(entry.get("hparams") or trained[loss].get("selected", {}).get("hparams") or {}),
        val_map=trained[loss].get("val_map"), cache=config.get("cache"), cache_id=config.get("cache_id"),
        dataset=config.get("dataset"), classes=config.get("classes"),
    )
