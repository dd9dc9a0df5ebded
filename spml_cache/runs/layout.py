"""Where a run's files go and what they hold, for both training stages.

`runs/<dataset>/<stage>-<backbone>-<loss or "all">-<YYYYmmdd-HHMMSS>/` (the backbone and feature kind of the cache,
as its file names them: `linear-timm_vit_base_patch14_dinov2.lvd142m_last4-an+role-20261127-011313`; runs made
before the backbone was named, `linear-an+role-<stamp>`, are read alike: readers go by the files, and the stamp
ends the name either way) holds `config.json` and `env.json` (`start_run`),
`metrics.jsonl` (`files.append_metrics`), `scores/<loss>.npz` (`write_scores`), `labels.npz` and
`test_labels.npz` (`write_labels`), then `best.pt` and `results.json` (`finish_run`; results last: without it the run is incomplete).
"""

from __future__ import annotations

import platform
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spml_cache import labels, metrics
from spml_cache.backbones import DEFAULT as DEFAULT_BACKBONE
from spml_cache.backbones import feature_slug
from spml_cache.cache import FeatureSet, cache_id
from spml_cache.losses import plugins
from spml_cache.runs.files import save_checkpoint, write_json, write_npz
from spml_cache.runtime.errors import SpmlError

RESULTS = "results.json"


def make_run_dir(stage: str, dataset: str, loss: str, root: Path | str = "runs", backbone: str | None = None) -> Path:
    """Create `root/<dataset>/<stage>-<backbone>-<loss>-<stamp>/` (without `backbone`: `<stage>-<loss>-<stamp>`; a
    `-2`, `-3`, ... suffix when that second is taken)."""
    parent = Path(root) / safe_name(dataset)
    named = f"{safe_name(backbone)[:BACKBONE_MAX]}-" if backbone else ""
    base = f"{stage}-{named}{short_label(safe_name(loss))}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SpmlError(f"cannot create {parent} ({err.strerror or err}): pick a writable --out folder") from None
    for attempt in range(1, 1000):
        run_dir = parent / (base if attempt == 1 else f"{base}-{attempt}")
        try:
            run_dir.mkdir()
            return run_dir
        except FileExistsError:
            continue
    raise SpmlError(f"cannot find a free run directory name under {parent}")


# The most characters of a run directory's label (its losses): a directory name is capped at 255 bytes, and the label
# is for people (config.json and results.json say what a run trained).
LABEL_MAX = 120
BACKBONE_MAX = 80  # a plugin backbone's name may be a long path: room for the label and the stamp stays


def short_label(label: str) -> str:
    """`label` (`an+role+...`) as it is when short enough, else as many of its leading names as fit and how many
    are left out (`an+role+12_more`)."""
    if len(label) <= LABEL_MAX:
        return label
    names = label.split("+")
    kept = [names.pop(0)[: LABEL_MAX - 10]]  # the first, cut if it alone is too long (room for "+N_more")
    while names and len("+".join([*kept, names[0], f"{len(names)}_more"])) <= LABEL_MAX:
        kept.append(names.pop(0))
    return "+".join([*kept, f"{len(names)}_more"] if names else kept)


def safe_name(text: str) -> str:
    """A path component: letters, digits and ._+- only."""
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text) or "_"


def env_info(device: torch.device | str) -> dict:
    """Versions and the device, for `env.json` (torchvision's version from its metadata: importing it is slow)."""
    from importlib import metadata

    from spml_cache import __version__

    try:
        torchvision_version = metadata.version("torchvision")
    except metadata.PackageNotFoundError:
        torchvision_version = None

    device = torch.device(device)
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    return {
        "package": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision_version,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "device": str(device),
        "device_name": device_name,
    }


def start_run(out: Path | str, *, stage: str, label: str, features: FeatureSet, device: torch.device,
              options: dict, losses: list[str], **extra) -> Path:
    """Make `out/<dataset>/<stage>-<backbone>-<label>-<stamp>/` and write its `config.json` and `env.json`.

    config.json holds each of the run's settings once: the cache it reads (its path, id, attrs and classes), its
    `options` as it takes them (`Options.stored()` of the resolved options, each under its own name: what report
    and `--resume` read), where each of its plugin `losses` came from, the device, then the stage's `extra`."""
    attrs = features.attrs
    backbone = feature_slug(str(attrs.get("backbone") or DEFAULT_BACKBONE), attrs.get("features"))
    run_dir = make_run_dir(stage, features.dataset, label, out, backbone)
    loaded = plugins.records(losses)
    try:
        write_json(run_dir / "config.json", {
            "stage": stage, "dataset": features.dataset, "cache": str(Path(features.path).resolve()), **options,
            "cache_id": cache_id(features.attrs), "cache_attrs": features.attrs, "classes": features.classes,
            **({"plugins": loaded} if loaded else {}), "device": str(device), **extra,
        })
        write_json(run_dir / "env.json", env_info(device))
    except BaseException:  # a run directory without its config is no run: nothing to resume or report
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return run_dir


def file_stem(key: str) -> str:
    """The file name (without suffix) of a result key: a loss's name as it is, `loss@rule` with its `@`, `:`,
    `=` and `,` as `_` (`an@entry:0.1` -> `an_entry_0.1`)."""
    return safe_name(key)


def scores_path(run_dir: Path | str, key: str) -> Path:
    """`scores/<key>.npz` (`file_stem`) of result `key`: its selected head's sigmoid scores per split."""
    return Path(run_dir) / "scores" / f"{file_stem(key)}.npz"


@dataclass(frozen=True)
class SeedScores:
    """Each seed's sigmoid test scores from the selected config's head at its best epoch (`[S, N, C]`, seeds in
    results.json's `per_seed` order), and the test labels (and label mask) they are judged against: what report's
    F1 family and bootstrap intervals read (docs/protocol.md, "Decisions" and "Intervals")."""

    seeds: list[int]
    test: torch.Tensor
    labels: object  # the test split's labels as the stage holds them: numpy, a tensor, or SparseLabels
    mask: object = None  # its label mask (partial labels), None where every label is known


def write_scores(run_dir: Path | str, key: str, per_seed: SeedScores | None = None, **splits: torch.Tensor) -> Path:
    """`scores/<key>.npz`: the selected head's sigmoid scores per split (float16); with `per_seed`, every seed's
    test scores as float32 `test_seeds` (float16 would tie scores that the stage's mAP told apart) beside `seeds`,
    and each seed's per-class F1 at the threshold (`per_class_f1`, `[S, C]`, 0..1) and for the top k
    (`per_class_f1@3`)."""
    arrays = {split: values.detach().cpu().numpy().astype(np.float16) for split, values in splits.items()}
    if per_seed is not None:
        test = per_seed.test.detach().float()
        for top_k, name in ((None, "per_class_f1"), (metrics.TOP_K, f"per_class_f1@{metrics.TOP_K}")):
            counts = labels.decision_counts(metrics.predicted(test, top_k), per_seed.labels, per_seed.mask)
            arrays[name] = metrics.f1_family(counts, per_seed.mask is not None)[1].cpu().numpy()
        arrays.update(test_seeds=test.cpu().numpy(), seeds=np.asarray(per_seed.seeds, dtype=np.int64))
    return write_npz(scores_path(run_dir, key), **arrays)


TEST_LABELS = "test_labels.npz"


def write_labels(run_dir: Path | str, *, train_labels, train_observed, val_labels, test_labels, test_mask=None,
                 rules: dict[str, np.ndarray] | None = None) -> Path | None:
    """`labels.npz`: the labels the scores are judged against (what report's figures need); `rules`: other
    observation rules' training masks, as `train_observed@<rule>`. Sparse label matrices (a cache of many
    classes) are not written (None: `labels.for_figures`). And, in either form, `test_labels.npz`: the test
    labels and label mask (`labels.to_arrays`: `labels`, `mask`), what report's metrics beside mAP read."""
    mask = {} if test_mask is None else labels.to_arrays(test_mask, "mask")
    write_npz(Path(run_dir) / TEST_LABELS, **labels.to_arrays(test_labels, "labels"), **mask)
    if labels.for_figures(train_labels) is None:
        return None
    others = {f"train_observed@{rule}": observed for rule, observed in (rules or {}).items()}
    return write_npz(Path(run_dir) / "labels.npz", train_labels=train_labels, train_observed=train_observed,
                     val_labels=val_labels, test_labels=test_labels, **others)


def finish_run(run_dir: Path | str, *, stage: str, features: FeatureSet, losses: dict, checkpoints: dict,
               **extra) -> dict:
    """Write `best.pt` (per loss: the selected model and its loss state) and then `results.json`, whose presence
    marks a finished run; returns the results."""
    run_dir = Path(run_dir)
    results = {"stage": stage, "dataset": features.dataset, "cache_id": cache_id(features.attrs), "complete": True,
               **extra, "losses": losses}
    save_checkpoint(run_dir / "best.pt", checkpoints)
    write_json(run_dir / RESULTS, results)
    return results
