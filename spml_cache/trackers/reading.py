"""What the trackers log, read from the run directory's own files (through `runs/`), so that every value a tracker
holds is the one the run wrote: the options and tags from config.json (`read_run`), each head's epochs from the
lines metrics.jsonl takes (`epochs_of`), and the results from results.json and the stored test scores
(`read_outcome`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from spml_cache import __version__, runs
from spml_cache.observation import DEFAULT_RULE, result_key
from spml_cache.options import FinetuneOptions, LinearOptions
from spml_cache.trackers.base import Epoch, Head, Outcome, Result, RunInfo, number_text

# The run's own files, each a tracker's artifact where the tool keeps files: its settings, machine, every epoch
# and its results (the weights and scores stay in the run directory).
STAGE_OPTIONS = {"linear": LinearOptions, "finetune": FinetuneOptions}  # what each stage's config.json keeps
ARTIFACTS = ("config.json", "env.json", "metrics.jsonl", runs.RESULTS)
# results.json's numbers of a result that a tracker logs as its metrics (mean over seeds, and spread).
RESULT_METRICS = ("val_map", "val_map_std", "test_map", "test_map_std", "train_map")


def flat_params(options: dict, prefix: str = "") -> dict:
    """config.json's `options` as flat parameters: a nested mapping's keys joined with dots (`hparams.role.k`), a
    list as its comma text (`0.01,0.001`), None as `none`; numbers, booleans and text as they are."""
    params = {}
    for name, value in options.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            params.update(flat_params(value, f"{key}.") if value else {key: "none"})
        elif isinstance(value, (list, tuple)):
            params[key] = ",".join(str(one) for one in value) or "none"
        else:
            params[key] = "none" if value is None else value
    return params


def read_run(run_dir: Path) -> RunInfo:
    """The run as its config.json says it (both stages write it before they train)."""
    config = runs.read_json(run_dir / "config.json", dict)
    attrs = config.get("cache_attrs") or {}
    tags = {"stage": config["stage"], "dataset": config["dataset"], "run_dir": str(run_dir.resolve()),
            "cache": str(config.get("cache")), "cache_id": str(config.get("cache_id")),
            "backbone": str(attrs.get("backbone", "resnet50")), "device": str(config.get("device")),
            "spml_cache": __version__}
    options = stored_options(config)
    return RunInfo(run_dir=run_dir, stage=config["stage"], dataset=config["dataset"], epochs=int(config["epochs"]),
                   options=options, params=flat_params(options), tags=tags)


def stored_options(config: dict) -> dict:
    """The options a run's config.json keeps, each under its own name (a run from before issue 52 kept them under
    `options`)."""
    if "options" in config:
        return dict(config["options"])
    return {name: config[name] for name in STAGE_OPTIONS[config["stage"]].declared() if name in config}


def head_name(lr, wd, batch_size: int, seed: int, swept: dict) -> str:
    """`lr_0.01-bs_8-seed_0` (with `-wd_...` where the grid has weight decays, and each swept hyperparameter)."""
    parts = [f"lr_{number_text(lr)}", *([f"wd_{number_text(wd)}"] if wd is not None else []),
             f"bs_{batch_size}", f"seed_{seed}", *(f"{key}_{number_text(value)}" for key, value in swept.items())]
    return "-".join(parts)


def head_of(line: dict) -> Head:
    """The head a metrics.jsonl line is of."""
    swept, rule = line.get("hparams") or {}, line.get("rule", DEFAULT_RULE)
    params = {"loss": line["loss"], "rule": rule, "lr": line["lr"],
              **({"wd": line["wd"]} if "wd" in line else {}), "batch_size": line["batch_size"], "seed": line["seed"],
              **swept}
    name = head_name(line["lr"], line.get("wd"), line["batch_size"], line["seed"], swept)
    return Head(key=result_key(line["loss"], rule), name=name, params=params)


def epochs_of(lines: list[dict], epochs: int) -> list[Epoch]:
    """metrics.jsonl's lines as epochs: the values a line has (never a test mAP: the protocol selects on val, and
    a tracker's test curve would invite choosing on it), and whether the head ends there."""
    found = []
    for line in lines:
        values = {name: line[name] for name in ("train_loss", "val_map") if line.get(name) is not None}
        last = line["epoch"] >= epochs or bool(line.get("diverged")) or bool(line.get("early_stop"))
        found.append(Epoch(head=head_of(line), epoch=int(line["epoch"]), values=values, last=last))
    return found


def _result(run_dir: Path, key: str, entry: dict) -> Result:
    if entry.get("selected") is None:
        return Result(key=key, selected=None, metrics={}, error=entry.get("error"))
    metrics = {name: entry[name] for name in RESULT_METRICS if entry.get(name) is not None}
    stored = runs.read_stored_test(run_dir, key)  # None: a run scored out of core keeps no per-seed scores
    if stored is not None:
        metrics.update({name: float(np.mean(values)) for name, values in {**stored.rankings(), **stored.f1_family()}.items()})
    selected = {**entry["selected"], "best_epoch": entry["best_epoch"]}
    swept = entry["selected"].get("swept") or {}
    heads = [head_name(selected["lr"], selected.get("wd"), selected["batch_size"], seed["seed"], swept)
             for seed in entry["per_seed"]]
    return Result(key=key, selected=selected, metrics=metrics, heads=heads)


def read_outcome(run_dir: Path) -> Outcome:
    """A finished run's results (results.json, and its F1 family from the stored test scores) and artifacts."""
    results = runs.load_results(run_dir)
    return Outcome(results={key: _result(run_dir, key, entry) for key, entry in results["losses"].items()},
                   files=[run_dir / name for name in ARTIFACTS if (run_dir / name).is_file()])
