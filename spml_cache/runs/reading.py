"""Reading run directories back: which are finished, their results, and an interrupted one to resume."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spml_cache import labels, metrics
from spml_cache.losses import plugins
from spml_cache.runs.files import read_json, read_npz, write_json
from spml_cache.runs.layout import RESULTS, TEST_LABELS, scores_path
from spml_cache.runtime import locks
from spml_cache.runtime.errors import SpmlError


def run_stamp(run_dir: Path | str) -> tuple[str, int]:
    """(YYYYmmdd-HHMMSS, same-second counter) from a run directory's name: orders runs, newest last."""
    found = re.search(r"(\d{8}-\d{6})(?:-(\d+))?$", Path(run_dir).name)
    return (found.group(1), int(found.group(2) or 1)) if found else ("", 0)


def is_complete(run_dir: Path | str) -> bool:
    return (Path(run_dir) / RESULTS).exists()


def load_results(run_dir: Path | str) -> dict:
    """`results.json` of a finished run; a clear error for a run that never finished."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SpmlError(f"{run_dir} is not a run directory")
    if not is_complete(run_dir):
        raise SpmlError(f"{run_dir} has no {RESULTS}: the run did not finish; run it again")
    return read_json(run_dir / RESULTS, dict)


def open_for_resume(run_dir: Path | str, stage: str, renewable: Callable[[str], bool] | None = None) -> dict:
    """`--resume RUN`: the `config.json` of an interrupted run of `stage`; a clear error for anything else. Its
    plugin losses are loaded, the very same code or refused, but for those `renewable(name)` says nothing was kept
    of: those go on with the code found now, which config.json records from then on."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise SpmlError(f"--resume {run_dir}: not a run directory (no config.json)")
    config = read_json(run_dir / "config.json", dict, fix=": the run's record was cut short or damaged, so the run"
                       " cannot go on: start a new run")
    if config.get("stage") != stage:
        raise SpmlError(f"--resume {run_dir}: a {config.get('stage')} run; resume it with"
                        f" spml-cache {config.get('stage')} --resume {run_dir}")
    if is_complete(run_dir):
        raise SpmlError(f"--resume {run_dir}: that run is already complete ({RESULTS})")
    renewed = plugins.load_recorded(config.get("plugins"), run_dir=run_dir, strict=True, renewable=renewable)
    if renewed:  # not while another process trains the run (with the code it recorded): that one is refused
        with locks.held(run_dir, f"run directory {run_dir}"):
            config["plugins"] = {**config["plugins"], **renewed}
            write_json(run_dir / "config.json", config)
    return config


def open_record(config: Path | str, resume: Path | str | None, stage: str) -> tuple[Path, dict]:
    """`--config RUN/config.json` (or RUN): the file and the record of a `stage` run, to run its settings again
    (finished or not); its plugin losses loaded, with the code found now (the new run records it). Beside `--resume`
    it is refused: one goes on with an interrupted run's settings, the other starts a new run from a record's."""
    if resume is not None:
        raise SpmlError(f"--config {config} with --resume {resume}: --resume goes on with an interrupted run's own"
                        " settings, --config starts a new run from a record's; give one of them")
    file = Path(config) / "config.json" if Path(config).is_dir() else Path(config)
    record = read_json(file, dict, fix=": not a run's record (RUN/config.json)")
    if record.get("stage") != stage:
        other = record.get("stage")
        raise SpmlError(f"--config {config}: " + (f"the record of a {other} run; rerun it with spml-cache {other}"
                                                   f" --config {config}" if other in ("linear", "finetune")
                                                   else "not the config.json of a run"))
    plugins.load_recorded(record.get("plugins"), run_dir=file.parent, strict=False)
    return file, record


@dataclass(frozen=True)
class StoredTest:
    """What a run keeps of one result's test split for the metrics beside mAP: each seed's sigmoid scores (`[S, N,
    C]` float32, seeds in results.json's order), the split's labels and label mask (dense or sparse; None: fully
    labelled)."""

    seeds: list[int]
    scores: np.ndarray
    labels: object
    mask: object

    def rankings(self) -> dict[str, np.ndarray]:
        """Each seed's rankings other evaluators report (0..100, `[S]`): `map11`, VOC 2007's 11-point interpolated
        mAP, and `lrap`, label ranking average precision (docs/protocol.md, "The metric")."""
        scores = torch.from_numpy(self.scores)
        return {"map11": np.array([labels.average_precision(seed, self.labels, self.mask, points=11)[1]
                                   for seed in scores]),
                "lrap": np.array([100.0 * float(image_ranking_precision(seed, self.labels, self.mask).mean())
                                  for seed in scores])}

    def f1_family(self, top_k: int = metrics.TOP_K) -> dict[str, np.ndarray]:
        """Each seed's F1 family (0..100, `[S]` per name: `cp`, ..., `of1`) at the threshold and, as `cp@K`, ...,
        for each image's top `top_k` (docs/protocol.md, "Decisions at a threshold"): against the run's test labels,
        over the annotated entries of partial labels; sparse labels stay sparse."""
        scores = torch.from_numpy(self.scores)
        values = {}
        for k, suffix in ((None, ""), (top_k, f"@{top_k}")):
            counts = labels.decision_counts(metrics.predicted(scores, k), self.labels, self.mask)
            family, _ = metrics.f1_family(counts, self.mask is not None)
            values.update({f"{name}{suffix}": value.numpy() for name, value in family.items()})
        return values


def image_ranking_precision(scores: torch.Tensor, split_labels, mask) -> torch.Tensor:
    """`metrics.label_ranking_precision` of one seed's `scores [N, C]` (each image's LRAP, `[N]`) against a split's
    labels (`split_labels`) and mask, dense or sparse, a block of images at a time (each image is scored on its own)."""
    step = max(1, labels.SCORED_BLOCK_ENTRIES // max(scores.shape[1], 1))
    parts = []
    for low in range(0, len(scores), step):
        rows = np.arange(low, min(low + step, len(scores)))
        block = [None if matrix is None else labels.dense(labels.take(matrix, rows), np.uint8)
                 for matrix in (split_labels, mask)]
        parts.append(metrics.label_ranking_precision(scores[low:low + step], *block))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def read_stored_test(run_dir: Path | str, key: str) -> StoredTest | None:
    """Result `key`'s per-seed test scores and the run's test labels; None for a run written before they were kept
    (its `scores/<key>.npz` without `test_seeds`, or no `test_labels.npz`) or without scores (out of core)."""
    run_dir = Path(run_dir)
    score_file, label_file = scores_path(run_dir, key), run_dir / TEST_LABELS
    if not (score_file.exists() and label_file.exists()):
        return None
    found = read_npz(score_file, ("seeds", "test_seeds"), required=False)
    if "test_seeds" not in found:
        return None
    stored = read_npz(label_file)
    test, mask = labels.from_arrays(stored, "labels"), labels.from_arrays(stored, "mask")
    scores = found["test_seeds"]
    if test is None or scores.ndim != 3 or tuple(scores.shape[1:]) != tuple(test.shape):
        raise SpmlError(f"{score_file}: test scores {scores.shape} do not match {label_file}"
                        f" ({None if test is None else test.shape}); run that stage again")
    return StoredTest([int(seed) for seed in found["seeds"]], scores, test, mask)
