"""Which runs there are: every run directory under the given paths, read without trusting that it finished, and
the newest complete run per (dataset x stage x cache column, loss).

Reads only the files the stages write (`config.json`, `results.json`, whose absence marks an interrupted run).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from spml_cache import datasets, losses
from spml_cache.backbones import DEFAULT as DEFAULT_BACKBONE
from spml_cache.backbones import feature_label
from spml_cache.losses.base import Fidelity
from spml_cache.observation import DEFAULT_RULE, result_key
from spml_cache.runs import RESULTS, is_complete, read_json, run_stamp
from spml_cache.runtime.errors import SpmlError

RUN_FILES = ("config.json", RESULTS, "metrics.jsonl")
# Fine-tuning from a fresh ImageNet model is another experiment than from the best linear head (LinearInit).
STAGE_LABELS = {"linear": "linear", "finetune": "fine-tuned", "finetune-imagenet": "fine-tuned from ImageNet"}
# The papers' datasets by their readers' REPORT_LABEL, in the papers' order (report/paper.py's values follow it).
DATASET_LABELS = datasets.values_of("REPORT_LABEL")


@dataclass
class Run:
    """One run directory; `results` is None for an incomplete (interrupted or unreadable) run."""

    path: Path
    stage: str
    dataset: str
    cache_id: str
    stamp: tuple[str, int]  # (YYYYmmdd-HHMMSS, same-second counter): orders runs, newest last
    config: dict
    results: dict | None
    problem: str
    fidelity: str  # "authors": trained with the authors' numerics, never tabulated with exact runs
    rule: str = DEFAULT_RULE  # the observation rule whose results this is a view of (`rule_views`)

    @property
    def losses(self) -> dict:
        """`{loss: entry}` of the results under this view's rule."""
        entries = self.results["losses"] if self.results else {}
        return {entry.get("loss", key): entry for key, entry in entries.items()
                if entry.get("rule", DEFAULT_RULE) == self.rule}

    @property
    def test_unscored(self) -> bool:
        """Its test split scored no class (every test positive unknown; `linear` refuses such a cache now, an older
        run may have one): its test mAP of 0.00 means nothing, so `report` shows n/a and never ranks it."""
        partial = (self.results or {}).get("partial_test_labels")
        return isinstance(partial, dict) and partial.get("classes_scored") == 0

    def key(self, loss: str) -> str:
        """The result key of `loss` in this run's files (`loss@rule` under a rule other than single)."""
        return result_key(loss, self.rule)

    @property
    def observed_key(self) -> str:
        """The name in labels.npz of the training rows' observed labels under this view's rule (a fine-tuning run
        keeps its rule's as `train_observed`)."""
        return "train_observed" if self.rule == DEFAULT_RULE else f"train_observed@{self.rule}"


def rule_views(run: Run) -> list[Run]:
    """One view of `run` per observation rule of its results (the run itself when it has only `single`): the
    report never puts the results of two rules in one column."""
    entries = run.results["losses"].values() if run.results else []
    rules = list(dict.fromkeys(entry.get("rule", DEFAULT_RULE) for entry in entries))
    return [run] if rules in ([], [DEFAULT_RULE]) else [replace(run, rule=rule) for rule in rules]


def read_run(path: Path) -> Run:
    """Read one run directory without trusting that the run finished."""
    config = results = None
    problem = f"no {RESULTS}: interrupted or still running"
    try:
        config = read_json(path / "config.json", dict) if (path / "config.json").exists() else None
        results = read_json(path / RESULTS, dict) if is_complete(path) else None
    except SpmlError as err:  # half-written by hand or by a crash: report it, do not stop the table
        problem = str(err)
    if results is not None and not (results.get("complete") and isinstance(results.get("losses"), dict)):
        results, problem = None, f"{RESULTS} not marked complete"
    known = {**(config or {}), **(results or {})}
    init = known.get("init")  # results.json's summary of the start, else config.json's --init
    mode = init.get("mode") if isinstance(init, dict) else init
    return Run(
        path=path,
        stage=(known.get("stage") or path.name.split("-")[0]) + ("-imagenet" if mode == "imagenet" else ""),
        dataset=known.get("dataset") or path.parent.name,
        cache_id=str(known.get("cache_id") or "unknown"),
        stamp=run_stamp(path),
        config=config or {},
        results=results,
        problem=problem if results is None else "",
        fidelity=str(known.get("fidelity") or Fidelity.check()),  # as written: a report reads any run
    )


def collect_runs(paths: list[Path] | None = None, *, runs_root: Path = Path("runs")) -> list[Run]:
    """Every run directory named in `paths` or found below them (default: below `runs_root`)."""
    looked = [Path(p) for p in paths] if paths else [Path(runs_root)]
    found: dict[Path, Path] = {}  # resolved -> as the user named it, so notes show familiar paths
    for path in looked:
        if not path.exists():
            raise SpmlError(f"no runs found: {path} does not exist; pass run directories or --runs DIR")
        if any((path / name).exists() for name in RUN_FILES):
            found.setdefault(path.resolve(), path)
            continue
        for name in RUN_FILES:
            for file in path.rglob(name):
                found.setdefault(file.parent.resolve(), file.parent)
    if not found:
        where = ", ".join(str(p) for p in looked)
        raise SpmlError(
            f"no run directories found under {where} (looked for {', '.join(RUN_FILES)}); "
            "train some with `spml-cache linear` or pass --runs DIR"
        )
    return [view for key in sorted(found) for view in rule_views(read_run(found[key]))]


@dataclass
class Column:
    dataset: str
    stage: str
    cache_id: str
    label: str
    weights: str | None = None  # the backbone weights that made the cache's features
    rule: str = DEFAULT_RULE  # the observation rule of the training labels
    backbone: str = DEFAULT_BACKBONE  # the backbone that made the cache's features (its registry name, +last4)


def in_spec_order(names) -> list[str]:
    """`names` in the registry's order (docs/losses.md), names it does not know last."""
    order = losses.names()
    return [name for name in order if name in names] + sorted(set(names) - set(order))


def oracle_losses() -> set[str]:
    """The losses that read the full labels: upper bounds, not single-positive methods."""
    return {name for name in losses.names() if losses.get(name).oracle}


def loss_family(name: str) -> str:
    """The family of loss `name`: the module of spml_cache/losses/ that registers it ("oracles", "robust", ...);
    "other" for a name this version's registry does not know."""
    return losses.get(name).__module__.rpartition(".")[2] if name in losses.names() else "other"


def run_backbone(run: Run) -> str:
    """The backbone that made the run's cache and its feature kind (`vit_b_16+last4`; pooled: the name alone;
    runs from before backbones had a choice: ResNet-50), so that two kinds are two columns."""
    attrs = run.config.get("cache_attrs", {})
    return feature_label(str(attrs.get("backbone") or DEFAULT_BACKBONE), attrs.get("features"))


def _column_label(dataset: str, stage: str, cache_id: str, several_caches: bool, fidelity: str, rule: str,
                  backbone: str = DEFAULT_BACKBONE) -> str:
    label = f"{DATASET_LABELS.get(dataset, dataset)} {STAGE_LABELS.get(stage, stage)}"
    label += f" [{backbone}]" if backbone != DEFAULT_BACKBONE else ""
    label += " (authors' numerics)" if fidelity == Fidelity.AUTHORS else ""
    label += f" ({rule})" if rule != DEFAULT_RULE else ""
    return f"{label} (cache {cache_id[:8]})" if several_caches else label


def select_newest(runs: list[Run]) -> tuple[list[Column], dict[tuple[str, str], Run], list[str]]:
    """Columns, the newest complete run per (column label, loss), and notes on what was set aside."""
    complete = [run for run in runs if run.results is not None]
    caches: dict[tuple[str, str], set[str]] = {}  # per dataset and backbone: a backbone is a column of its own
    for run in complete:
        caches.setdefault((run.dataset, run_backbone(run)), set()).add(run.cache_id)
    notes = [
        f"{ds}{'' if bb == DEFAULT_BACKBONE else f' [{bb}]'}: runs from {len(ids)} different caches"
        f" ({', '.join(sorted(i[:8] for i in ids))}): reported apart"
        for (ds, bb), ids in sorted(caches.items())
        if len(ids) > 1
    ]
    columns: dict[str, Column] = {}
    history: dict[tuple[str, str], list[Run]] = {}
    for run in sorted(complete, key=lambda r: (r.stamp, r.path.name)):
        backbone = run_backbone(run)
        label = _column_label(run.dataset, run.stage, run.cache_id, len(caches[run.dataset, backbone]) > 1,
                              run.fidelity, run.rule, backbone)
        weights = run.config.get("cache_attrs", {}).get("weights")
        columns.setdefault(label, Column(run.dataset, run.stage, run.cache_id, label, weights, run.rule, backbone))
        for loss, result in run.losses.items():
            if "test_map" in result:
                history.setdefault((label, loss), []).append(run)
            else:  # the stage records a loss whose every head diverged, with no numbers
                notes.append(f"{loss} ({label}): no result in {run.path} ({result.get('error', 'no test_map')})")
    chosen = {key: runs_of_key[-1] for key, runs_of_key in history.items()}
    for (label, loss), runs_of_key in sorted(history.items()):
        if len(runs_of_key) > 1:
            older = ", ".join(str(r.path) for r in runs_of_key[:-1])
            notes.append(f"{loss} ({label}): newest of {len(runs_of_key)} runs used, {runs_of_key[-1].path}; older: {older}")
    stage_order = list(STAGE_LABELS)
    ordered = sorted(
        columns.values(),
        key=lambda c: (
            stage_order.index(c.stage) if c.stage in stage_order else len(stage_order),
            list(DATASET_LABELS).index(c.dataset) if c.dataset in DATASET_LABELS else len(DATASET_LABELS),
            c.backbone != DEFAULT_BACKBONE, c.backbone,  # the papers' ResNet-50 first, then the others by name
            c.rule != DEFAULT_RULE,  # a dataset's single-positive column first, then its rules'
            c.label,
        ),
    )
    return ordered, chosen, notes
