"""Run directories (docs/internals.md, "run directories"): the one place that lays them out, for both training
stages, and reads them back.

`runs/<dataset>/<stage>-<loss or "all">-<YYYYmmdd-HHMMSS>/` holds `config.json` and `env.json` (`start_run`),
`metrics.jsonl` (`append_metrics`), `scores/<loss>.npz` (`write_scores`), `labels.npz` (`write_labels`), then
`best.pt` and `results.json` (`finish_run`; results last: without it the run is incomplete). Every file but
`metrics.jsonl` is written to a temporary name and renamed, so a reader never sees half a file;
`metrics.jsonl` grows one complete line at a time.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shutil
import time
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable

import numpy as np
import torch

from spml_cache import losses as loss_registry
from spml_cache.cache import FeatureSet, cache_id
from spml_cache.losses.base import Fidelity
from spml_cache.observation import DEFAULT_RULE, split_key
from spml_cache.runtime.errors import DiskFull, SpmlError

RESULTS = "results.json"


def make_run_dir(stage: str, dataset: str, loss: str, root: Path | str = "runs") -> Path:
    """Create `root/<dataset>/<stage>-<loss>-<stamp>/` (a `-2`, `-3`, ... suffix when that second is taken)."""
    parent = Path(root) / _safe_name(dataset)
    base = f"{stage}-{_safe_name(loss)}-{time.strftime('%Y%m%d-%H%M%S')}"
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


def _safe_name(text: str) -> str:
    """A path component: letters, digits and ._+- only."""
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text) or "_"


def jsonable(value: Any) -> Any:
    """Plain JSON values from numpy/torch scalars and arrays, paths and tuples; non-finite floats become null."""
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, torch.Tensor):
        return jsonable(value.detach().cpu().tolist())
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Enum):
        return jsonable(value.value)
    if isinstance(value, (Path, torch.device, torch.dtype)):
        return str(value)
    return value


def temporary_path(path: Path) -> Path:
    """Where `path` is written before it is renamed into place: a hidden name that ends in `.tmp-<pid>`, so that no
    reader's pattern (`*.pt`, `*.json`, ...) ever matches it, and two processes never share one."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def replace_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """`write(file)` into a temporary file, flushed to the disk, then renamed to `path`: a reader sees the old
    file or the whole new one, never a part. Nothing is left behind on failure."""
    temporary = temporary_path(path)
    try:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as err:
        temporary.unlink(missing_ok=True)
        if isinstance(err, Exception) and DiskFull.caused(err):
            raise DiskFull(path) from None
        raise


def write_json(path: Path | str, data: Any) -> Path:
    """Write `data` as indented JSON, atomically."""
    path = Path(path)
    text = json.dumps(jsonable(data), indent=2, allow_nan=False) + "\n"
    replace_atomically(path, lambda file: file.write(text.encode("utf-8")))
    return path


def read_json(path: Path | str) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpmlError(f"{path} does not exist") from None
    except json.JSONDecodeError as err:
        raise SpmlError(f"{path} is not valid JSON ({err})") from None


def append_metrics(run_dir: Path | str, rows: Iterable[dict]) -> None:
    """Append one JSON line per row to `metrics.jsonl` (one line per head per epoch)."""
    lines = "".join(json.dumps(jsonable(row), allow_nan=False) + "\n" for row in rows)
    path = Path(run_dir) / "metrics.jsonl"
    try:
        with open(path, "a", encoding="utf-8") as file:
            file.write(lines)
    except OSError as err:
        if DiskFull.caused(err):
            raise DiskFull(path) from None
        raise


def read_metrics(run_dir: Path | str) -> list[dict]:
    """The lines of `metrics.jsonl`; a torn last line (the process ended mid-write) is left out."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise SpmlError(f"{path}, line {number}, is not JSON: the file was edited or damaged") from None
    return rows


def save_checkpoint(path: Path | str, state: dict) -> Path:
    """`torch.save` atomically; keep `state` to tensors and plain values so `weights_only=True` loads it."""
    path = Path(path)
    replace_atomically(path, lambda file: torch.save(state, file))
    return path


def load_checkpoint(path: Path | str) -> dict:
    path = Path(path)
    if not path.exists():
        raise SpmlError(f"{path} does not exist: is {path.parent} a finished run directory?")
    return torch.load(path, map_location="cpu", weights_only=True)


def write_npz(path: Path | str, **arrays: np.ndarray) -> Path:
    """`numpy.savez_compressed`, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path, lambda file: np.savez_compressed(file, **arrays))
    return path


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


# --- one run's files, for both training stages -------------------------------------------------------------


@dataclass(frozen=True)
class Grid:
    """What a run trains, as its `config.json` keeps it (both stages): the losses, the (lr, batch size) grid, the
    epochs, the seeds, per loss the resolved hyperparameters, the val labels it selects on, the fidelity."""

    losses: list[str]
    lrs: list[float]
    batch_sizes: list[int]
    epochs: int
    seeds: list[int]
    hparams: dict  # {loss: {key: value}}; a swept key holds its list of values
    val_labels: str  # clean or observed
    fidelity: Fidelity

    @classmethod
    def from_config(cls, config: dict) -> "Grid":
        """The grid of a `config.json` (runs written before `fidelity` was stored trained exactly)."""
        return cls(list(config["losses"]), list(config["lrs"]), list(config["batch_sizes"]), int(config["epochs"]),
                   list(config["seeds"]), dict(config["hparams"]), config["val_labels"],
                   Fidelity.check(config.get("fidelity")))


def start_run(out: Path | str, *, stage: str, label: str, features: FeatureSet, device: torch.device,
              grid: Grid, **extra) -> Path:
    """Make `out/<dataset>/<stage>-<label>-<stamp>/` and write its `config.json` (the cache, the grid, then the
    stage's `extra`) and `env.json`."""
    run_dir = make_run_dir(stage, features.dataset, label, out)
    try:
        write_json(run_dir / "config.json", {
            "stage": stage, "dataset": features.dataset, "cache": str(Path(features.path).resolve()),
            "cache_id": cache_id(features.attrs), "cache_attrs": features.attrs, "classes": features.classes,
            **asdict(grid), "device": str(device), **extra,
        })
        write_json(run_dir / "env.json", env_info(device))
    except BaseException:  # a run directory without its config is no run: nothing to resume or report
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return run_dir


def file_stem(key: str) -> str:
    """The file name (without suffix) of a result key: a loss's name as it is, `loss@rule` with its `@`, `:`,
    `=` and `,` as `_` (`an@entry:0.1` -> `an_entry_0.1`)."""
    return _safe_name(key)


def scores_path(run_dir: Path | str, key: str) -> Path:
    """`scores/<key>.npz` (`file_stem`) of result `key`: its selected head's sigmoid scores per split."""
    return Path(run_dir) / "scores" / f"{file_stem(key)}.npz"


def write_scores(run_dir: Path | str, key: str, **splits: torch.Tensor) -> Path:
    """`scores/<key>.npz`: the selected head's sigmoid scores per split, as float16."""
    arrays = {split: values.detach().cpu().numpy().astype(np.float16) for split, values in splits.items()}
    return write_npz(scores_path(run_dir, key), **arrays)


def write_labels(run_dir: Path | str, *, train_labels, train_observed, val_labels, test_labels,
                 rules: dict[str, np.ndarray] | None = None) -> Path:
    """`labels.npz`: the labels the scores are judged against (what report's figures need); `rules`: other
    observation rules' training masks, as `train_observed@<rule>`."""
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
    return read_json(run_dir / RESULTS)


def open_for_resume(run_dir: Path | str, stage: str) -> dict:
    """`--resume RUN`: the `config.json` of an interrupted run of `stage`; a clear error for anything else."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise SpmlError(f"--resume {run_dir}: not a run directory (no config.json)")
    config = read_json(run_dir / "config.json")
    if config.get("stage") != stage:
        raise SpmlError(f"--resume {run_dir}: a {config.get('stage')} run; resume it with"
                        f" spml-cache {config.get('stage')} --resume {run_dir}")
    if is_complete(run_dir):
        raise SpmlError(f"--resume {run_dir}: that run is already complete ({RESULTS})")
    return config


def newest_run(runs_root: Path | str, dataset: str, stage: str, *, loss: str,
               cache: str | None = None) -> Path | None:
    """The newest finished `stage` run of `dataset` under `runs_root` that trained `loss` (on cache id `cache`,
    when given) and kept its models; None if there is none."""
    folder = Path(runs_root) / _safe_name(dataset)
    usable = []
    for path in sorted(folder.glob(f"{stage}-*")) if folder.is_dir() else []:
        if not (is_complete(path) and (path / "best.pt").exists()):
            continue
        try:
            results = read_json(path / RESULTS)
        except SpmlError:  # a garbled results.json: not a run to start from
            continue
        if loss in results.get("losses", {}) and cache in (None, results.get("cache_id")):
            usable.append(path)
    return max(usable, key=lambda path: (run_stamp(path), path.name), default=None)


def best_loss(trained: dict[str, dict]) -> str | None:
    """The loss whose head a later stage starts from when none is named: the best val mAP among the
    single-positive losses (never an oracle: it saw the full labels), under any observation rule (a result key,
    `loss` or `loss@rule`). `trained` is results.json's `losses`."""
    fair = [key for key, entry in trained.items() if entry.get("val_map") is not None
            and split_key(key)[0] in loss_registry.names() and not loss_registry.get(split_key(key)[0]).oracle]
    return max(fair, key=lambda key: trained[key]["val_map"], default=None)


# --- a linear run's selected heads (stage three's LinearInit, `linear --from`) ----------------------------


@dataclass(frozen=True)
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
    config = read_json(run / "config.json") if (run / "config.json").exists() else {}
    return LinearHead(
        run=Path(run), loss=trained[loss].get("loss", loss), weight=entry["head"]["weight"].float(),
        bias=entry["head"]["bias"].float(), rule=trained[loss].get("rule", DEFAULT_RULE),
        loss_state=dict(entry.get("loss_state") or {}),
        settings={key: entry.get(key) for key in ("lr", "batch_size", "seed", "epoch")},
        hparams=dict(entry.get("hparams") or trained[loss].get("selected", {}).get("hparams") or {}),
        val_map=trained[loss].get("val_map"), cache=config.get("cache"), cache_id=config.get("cache_id"),
        dataset=config.get("dataset"), classes=config.get("classes"),
    )
