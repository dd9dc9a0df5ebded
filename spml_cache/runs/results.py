"""A finished run's results as typed objects (what `sc.linear`, `sc.finetune` and `sc.load_run` return), over the
run directory's results.json, which stays reachable whole (`run.results`).

A run holds one result per result key (a loss, or `loss@rule` under an observation rule other than single): the
selected config, val and test mAP with their spread over seeds, the per-seed and per-config rows, and, from the
per-seed test scores the run keeps, the rankings and the F1 family (`LossResult.rankings`, `LossResult.f1_family`, as `spml-cache
report --metric` reads them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from spml_cache import metrics
from spml_cache.observation import split_key
from spml_cache.runs.files import load_checkpoint, read_json
from spml_cache.runs.handover import best_loss
from spml_cache.runs.reading import load_results, read_stored_test
from spml_cache.runtime.errors import SpmlError, unknown_name


@dataclass(frozen=True)
class LossResult:
    """One result of a run (results.json's `losses[key]`, whole in `raw`).

    `key`: the loss, or `loss@rule`; `selected`: the config selected on val (`lr`, `batch_size`, `hparams`, and
    `wd` where weight decays were swept); `val_map`, `test_map` (0..100) at the selected config's best val epoch,
    mean over seeds, and their `_std` (population std over seeds); `best_epoch`, one per seed; `per_seed` and
    `configs`: results.json's rows (each seed; each config and seed); `start`: a fine-tuning's epoch 0 (its val
    and test mAP before any step), None for a linear run."""

    key: str
    selected: dict
    val_map: float
    val_map_std: float | None
    test_map: float | None
    test_map_std: float | None
    best_epoch: tuple[int, ...]
    per_seed: tuple[dict, ...]
    configs: tuple[dict, ...]
    start: dict | None
    raw: dict
    run_dir: Path

    @classmethod
    def of(cls, run_dir: Path, key: str, raw: dict) -> "LossResult":
        """The result `key` of the run in `run_dir`, typed from `raw`, its entry in results.json's `losses`."""
        epochs = raw.get("best_epoch")
        return cls(key=key, selected=dict(raw.get("selected") or {}), val_map=raw.get("val_map"),
                   val_map_std=raw.get("val_map_std"), test_map=raw.get("test_map"),
                   test_map_std=raw.get("test_map_std"),
                   best_epoch=tuple(epochs) if isinstance(epochs, list) else (() if epochs is None else (epochs,)),
                   per_seed=tuple(raw.get("per_seed") or ()), configs=tuple(raw.get("configs") or ()),
                   start=raw.get("start"), raw=raw, run_dir=run_dir)

    @property
    def loss(self) -> str:
        """The loss's name (the key without its rule)."""
        return split_key(self.key)[0]

    @property
    def rule(self) -> str:
        """The observation rule it trained under (`single` unless the key names one)."""
        return split_key(self.key)[1]

    def f1_family(self, top_k: int = metrics.TOP_K) -> dict[str, tuple[float, float | None]]:
        """`{name: (mean, std)}` over seeds of the F1 family on the test split (0..100: `cp`, `cr`, `cf1`, `op`,
        `or`, `of1` at the 0.5 threshold, and `cf1@K` ... for each image's `top_k` highest scores at or above it),
        from the per-seed test scores the run keeps, as `spml-cache report --metric` computes them; std None with
        one seed; {} for a run that kept no scores (written before they were, or scored out of core).

        Parameters
        ----------
        top_k : int
            How many of each image's highest scores the `@K` variants take (default 3)."""
        return self._over_seeds(lambda stored: stored.f1_family(top_k))

    def rankings(self) -> dict[str, tuple[float, float | None]]:
        """`{name: (mean, std)}` over seeds of the rankings other evaluators report on the test split (0..100):
        `map11`, VOC 2007's 11-point interpolated mAP, and `lrap`, label ranking average precision, as `spml-cache
        report --metric map11` / `lrap` computes them; std None with one seed; {} for a run that kept no scores."""
        return self._over_seeds(lambda stored: stored.rankings())

    def _over_seeds(self, per_seed) -> dict[str, tuple[float, float | None]]:
        """`{name: (mean, std)}` of what `per_seed(StoredTest)` gives per seed; {} where the run kept no scores."""
        stored = read_stored_test(self.run_dir, self.key)
        if stored is None:
            return {}
        return {name: (float(values.mean()), float(values.std()) if len(values) > 1 else None)
                for name, values in per_seed(stored).items()}

    def head(self) -> dict:
        """The selected checkpoint's entry in the run's best.pt: a linear run's `head` (`weight` [C, D], `bias`
        [C]), a fine-tuning's `model` state, with the `lr`, `batch_size`, `seed`, `epoch` and `hparams` it was
        selected at."""
        return load_checkpoint(self.run_dir / "best.pt")[self.key]


@dataclass(frozen=True)
class StageRun:
    """A finished run of a training stage: its directory and its results.json (`results`, whole), with each result
    typed (`losses`, or `run[key]`)."""

    run_dir: Path
    results: dict

    @cached_property
    def losses(self) -> dict[str, LossResult]:
        """`{key: LossResult}` in results.json's order."""
        return {key: LossResult.of(Path(self.run_dir), key, raw)
                for key, raw in (self.results.get("losses") or {}).items()}

    def __getitem__(self, key: str) -> LossResult:
        """`run["role"]`: the result of `key` (a loss, or `loss@rule`); an unknown one is one line with the closest."""
        if key not in self.losses:
            raise SpmlError(f"{self.run_dir}: {unknown_name('result', key, self.losses)}; it holds"
                            f" {', '.join(self.losses) or 'none'}")
        return self.losses[key]

    @property
    def stage(self) -> str:
        """`linear` or `finetune`."""
        return self.results.get("stage", "")

    @property
    def dataset(self) -> str:
        """The dataset the run's cache is of (`voc`, ...)."""
        return self.results.get("dataset", "")

    @property
    def config(self) -> dict:
        """The run's config.json: its options as resolved, the cache, the environment."""
        return read_json(Path(self.run_dir) / "config.json", dict)

    @property
    def best(self) -> str | None:
        """The result of best val mAP among the single-positive losses (never an oracle's): the head `finetune`
        starts from when no loss is named."""
        return best_loss(self.results.get("losses") or {})


@dataclass(frozen=True)
class LinearRun(StageRun):
    """What a finished `linear` run gives back: its directory and its results (results.json), typed per loss."""


@dataclass(frozen=True)
class FinetuneRun(StageRun):
    """What a finished fine-tuning gives back: its directory and its results (results.json), typed per loss;
    `init`: the head it started from (results.json's `init`)."""

    @property
    def init(self) -> dict:
        """The head it started from: `mode` (best or imagenet), the linear `run`, `loss`, its config and val mAP."""
        return dict(self.results.get("init") or {})


RUNS = {"linear": LinearRun, "finetune": FinetuneRun}


def load_run(run_dir: Path | str) -> StageRun:
    """The finished run in `run_dir` (a `linear` or `finetune` run directory), typed: `LinearRun` or `FinetuneRun`.

    Parameters
    ----------
    run_dir : path
        The run directory (it holds results.json)."""
    if not isinstance(run_dir, (str, os.PathLike)):
        raise SpmlError(f"sc.load_run: run_dir {run_dir!r}: give the run directory's path (a str or pathlib.Path)")
    results = load_results(run_dir)
    kind = RUNS.get(results.get("stage"))
    if kind is None:
        raise SpmlError(f"{run_dir}: a run of stage {results.get('stage')!r}, not linear or finetune")
    return kind(Path(run_dir), results)
