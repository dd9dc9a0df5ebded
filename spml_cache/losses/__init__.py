"""Every SPML loss of the papers behind one contract (docs/losses.md); a registry in the style of timm."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from spml_cache.losses import plugins
from spml_cache.losses.base import LOSSES, Loss, register
from spml_cache.losses.loop import EpochWarning, train_logits
from spml_cache.losses.overrides import Overrides, combinations, merged, varying_keys
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.plugins import Origin

if TYPE_CHECKING:
    from rich.table import Table

# Importing a family module registers its losses; the order here is the order `names()` lists them in.
from spml_cache.losses import (  # noqa: E402,F401  (imported for registration)
    oracles,
    assume_negative,
    estimating,
    acknowledge,
    robust,
    large_loss,
    generalized,
    pairwise,
    partial,
    crisp,
    vision_language,
)

__all__ = [
    "EpochWarning", "Loss", "Overrides", "build", "canonical", "combinations", "describe", "describe_table",
    "display_name", "get", "merged", "names", "register", "resolve_hparams", "train_logits", "varying_keys",
]

canonical = plugins.canonical  # the name a loss is known by (a plugin spec's class's `name`)

# The flags of a `describe()` row, as the table words them.
_FLAG_TEXTS = {
    "oracle": "oracle (reads the full labels)",
    "needs_train_logits": "scores the training set every epoch",
    "reconstructed": "reconstructed (no public code)",
    "needs_similarity": "needs the cache's text side (a CLIP cache)",
}


def names(similarity: bool = True) -> list[str]:
    """Registered loss names, in the order of docs/losses.md; `similarity=False` (a cache without a text side)
    leaves out the losses that need one (`needs_similarity`)."""
    return [name for name, cls in LOSSES.items() if similarity or not cls.needs_similarity]


def display_name(name: str) -> str:
    """How tables and figures write loss `name`: as its papers do (`AN-LS`, `EM+APL`, `LL-R`), the `display_name`
    its own class declares (one a class inherits is its parent's, not its own), else `name` itself (a plugin that
    declares none, a name this registry does not know: read back from another version's run). The registry name
    stays what files and flags use."""
    cls = LOSSES.find(name)
    return (cls.__dict__.get("display_name") or name) if cls is not None else name


def get(name: str) -> type[Loss]:
    """The loss class registered as `name`, or the plugin it names (`file.py:Class`, `module:Class`, a loaded
    plugin's or an entry point's name: plugins.py); a clear error listing the valid names otherwise."""
    found = LOSSES.find(name) or plugins.find(name)
    return found if found is not None else LOSSES.get(name)


def reads_whole_observed(name: str) -> bool:
    """Whether loss `name` is built with the whole training observed matrix, not only batches of it: it keeps
    per-example state, or scores every training row each epoch (crisp's class priors). A cache of sparse labels
    densifies the matrix for such a loss alone (its own [N, C] state or scores cost as much already)."""
    cls = get(name)
    return bool(cls.state) or cls.needs_train_logits


def build(name: str, *, num_classes: int, num_train: int | None = None, dataset: str | None = None, **kwargs) -> Loss:
    """Build loss `name` (a registered name, `file.py:Class`, `module:Class` or an installed plugin's name) for
    `num_classes` classes: `num_train` training rows (what the epoch check counts a loop's calls against; None:
    `train_observed`'s rows, or not counted), `dataset` (its published defaults: voc, coco, nus, cub, ...).
    kwargs: `num_heads` (heads trained at once, default 1), `train_observed` (the whole training observed matrix,
    for the losses that read it), `seed`, `train_similarity` (a CLIP cache's, for the losses that need it) and any
    hyperparameter override (`delta=0.002`)."""
    return get(name)(num_classes=num_classes, num_train=num_train, dataset=dataset, **kwargs)


def resolve_hparams(name: str, overrides: dict, *, num_classes: int, dataset: str, train_observed: torch.Tensor,
                    expected_positives: float | None = None, train_similarity: torch.Tensor | None = None,
                    train_crop_similarity: torch.Tensor | None = None) -> dict:
    """The hyperparameters loss `name` trains with: its defaults, its dataset's, then `overrides`; checked by
    building it once for `num_classes`, `dataset` and `train_observed` (with `train_similarity` and
    `train_crop_similarity` for a loss that reads the cache's text side). A dataset without a published `k`
    (expected positives per image) takes `expected_positives`, the value measured on its own labels."""
    overrides, cls = dict(overrides), get(name)
    published = cls.dataset_defaults.get(dataset, {})
    if "k" in cls.defaults and "k" not in overrides and "k" not in published and expected_positives is not None:
        overrides["k"] = float(expected_positives)
    loss = build(name, num_classes=num_classes, dataset=dataset, num_heads=1, train_observed=train_observed, seed=0,
                 train_similarity=train_similarity, train_crop_similarity=train_crop_similarity, **overrides)
    return dict(loss.hparams)


def describe(names: tuple[str, ...] = ()) -> list[dict]:
    """What `spml-cache losses` prints, one row per loss: name, description, reference, defaults (a default derived
    at build time shows how, e.g. "1/(C-1)"), per-dataset defaults, state, flags and, for a plugin, its origin.
    `names` (built-in names, plugin specs, installed plugins' names): those alone, in that order, each refused in
    one line when it names no loss. Without names, every registered loss, then every installed plugin; one that
    cannot be loaded is a row of its name and `error`, the one line that says why, and the rest are listed."""
    if names:
        found = {cls.name: cls for cls in map(get, names)}
        return [_describe_row(name, cls) for name, cls in found.items()]
    found, broken = dict(LOSSES.items()), {}
    for name in plugins.installed():
        try:
            cls = get(name)
        except SpmlError as err:  # one distribution's fault: said on its row
            broken[name] = str(err)
            continue
        found[cls.name] = cls
    rows = [_describe_row(name, cls) for name, cls in found.items()]
    return rows + [{"name": name, "origin": None, "error": error} for name, error in broken.items()]


def _describe_row(name: str, cls: type[Loss]) -> dict:
    return {
        "name": name,
        "display_name": cls.__dict__.get("display_name") or name,
        "origin": plugins.origin(name),
        "error": None,  # an installed plugin that cannot be loaded: why
        "description": getattr(cls, "description", ""),  # a plugin may leave them out
        "reference": getattr(cls, "reference", ""),
        "defaults": {
            key: cls.derived.get(key, "derived at build time") if value is None else value
            for key, value in cls.defaults.items()
        },
        "dataset_defaults": cls.dataset_defaults,
        "state": cls.state,
        "observed_negative": cls.observed_negative,
        "oracle": cls.oracle,
        "needs_train_logits": cls.needs_train_logits,
        "reconstructed": cls.reconstructed,
        "needs_similarity": cls.needs_similarity,
        "authors": {"log_eps": cls.authors_log_eps, "early_stop": cls.authors_early_stop,
                    "drop_last": cls.authors_drop_last, "defaults": cls.authors_defaults},
        "paper_grid": {"values": dict(cls.paper_grid), "source": cls.paper_grid_source} if cls.paper_grid else None,
        "per_head": list(cls.per_head),
    }


def _format_hparams(values: dict) -> str:
    return " ".join(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}" for key, value in values.items())


def _authors_text(authors: dict) -> str:
    parts = [f"-log(q + {authors['log_eps']:g})"] if authors["log_eps"] else []
    parts += ["drops the last partial batch"] if authors["drop_last"] else []
    parts += [f"defaults {_format_hparams(authors['defaults'])}"] if authors["defaults"] else []
    if authors["early_stop"]:
        rule, margin = authors["early_stop"]
        parts.append("stops at the first epoch without gain" if rule == "no_gain" else f"stops {margin:g} below best")
    return "--fidelity authors: " + ", ".join(parts)


def describe_table(rows: list[dict] | None = None) -> Table:
    """`describe()` rows (default: every loss) as the rich Table `spml-cache losses` prints."""
    from rich.table import Table
    from rich.text import Text

    rows = describe() if rows is None else rows
    table = Table(title=f"{len(rows)} loss{'' if len(rows) == 1 else 'es'}", show_lines=True, caption="equations: docs/losses.md; what"
                  " --fidelity authors changes, and every known difference from the authors' code: docs/fidelity.md")
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("what it does / paper reference", ratio=3)
    table.add_column("defaults", ratio=2)
    table.add_column("state / flags", ratio=2)
    for row in rows:
        if row.get("error"):
            table.add_row(row["name"], Text("cannot be loaded: " + row["error"], style="red"), "-", "-")
            continue
        defaults = [_format_hparams(row["defaults"]) or "-"]
        defaults += [f"{dataset}: {_format_hparams(values)}" for dataset, values in row["dataset_defaults"].items()]
        flags = [row["state"]] if row["state"] else []
        flags += [f"z = -1: {row['observed_negative']}"]
        flags += [text for flag, text in _FLAG_TEXTS.items() if row[flag]]
        flags += [_authors_text(row["authors"])] if any(row["authors"].values()) else []
        if row["paper_grid"]:
            grid = "; ".join(f"{key} in {{{', '.join(f'{v:g}' for v in values)}}}"
                             for key, values in row["paper_grid"]["values"].items())
            flags.append(f"--hp-grid paper: {grid} ({row['paper_grid']['source']})")
        what = Text(row["description"] + "\n") + Text(row["reference"], style="dim")
        if row["origin"]:
            what += Text("\nplugin: " + Origin.read(row["origin"]).text(), style="cyan")
        shown = Text(row["name"]) + (Text(f"\n{row['display_name']}", style="dim")
                                     if row.get("display_name", row["name"]) != row["name"] else Text())
        table.add_row(shown, what, "\n".join(defaults), "\n".join(flags) or "-")
    return table
