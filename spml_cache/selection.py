"""Model selection, the papers' way (docs/protocol.md, "Training and selection"), for stages two and three.

Per head: the first epoch with the highest val mAP (a later epoch replaces it only when strictly greater).
Per loss: the (lr, batch size) config with the highest val mAP, averaged over seeds when there are several
(strictly greater replaces, in grid order). Reported: the test mAP of each seed's head at its best epoch,
as mean ± std over seeds (population std, 0 for one seed). Data in, data out: the run directory is
written by `runs/`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from spml_cache.observation import DEFAULT_RULE


@dataclass(kw_only=True)
class HeadRecord:
    """One head's history and its best epoch (docs/protocol.md: the first epoch with the highest val mAP)."""

    loss: str
    lr: float
    batch_size: int
    seed: int
    hparams: dict = field(default_factory=dict)  # the head's values of the swept hyperparameters ({} without a sweep)
    train_loss: list = field(default_factory=list)  # per finished epoch
    val_map: list = field(default_factory=list)
    test_map: list = field(default_factory=list)
    diverged_epoch: int | None = None
    stopped_epoch: int | None = None  # the epoch a paper's early stopping ended it (--fidelity authors)
    best_epoch: int | None = None
    best_val_map: float = -math.inf
    best_test_ap: np.ndarray | None = None  # per-class test AP (0..1) at the best epoch
    best_state: dict | None = None  # {"head": nn.Linear layout, "loss_state": num_heads=1 state} at the best epoch
    rule: str = DEFAULT_RULE  # the observation rule of its training labels (observation/)
    wd: float | None = None  # its weight decay when the grid has that axis (linear --wd), else None: not recorded
    start: dict | None = None  # fine-tuning: {"val_map", "test_map"} of the model before any step (epoch 0)

    def add_epoch(self, epoch: int, train_loss: float, val_map: float, test_map: float, test_ap: np.ndarray) -> bool:
        """Record a finished epoch; True when it becomes the best epoch. Strictly greater replaces: on ties the
        earlier epoch stays selected, and NaN never does."""
        self.train_loss.append(train_loss)
        self.val_map.append(val_map)
        self.test_map.append(test_map)
        if not val_map > self.best_val_map:
            return False
        self.best_val_map, self.best_epoch, self.best_test_ap = val_map, epoch, np.array(test_ap, copy=True)
        return True

    def to_state(self) -> dict:
        """Plain values and tensors (what `torch.load(weights_only=True)` reads back); `from_state` inverts it."""
        state = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "best_state"}
        state["best_test_ap"] = None if self.best_test_ap is None else torch.from_numpy(np.asarray(self.best_test_ap))
        return state

    @classmethod
    def from_state(cls, state: dict) -> "HeadRecord":
        best_test_ap = state["best_test_ap"]
        return cls(**{**state, "best_test_ap": None if best_test_ap is None else best_test_ap.numpy()})

    @property
    def swept(self) -> tuple:
        """Its hyperparameter combination's swept values as `losses.overrides.Combination.swept` holds them (hashable)."""
        return tuple(self.hparams.items())

    def wd_entry(self) -> dict:
        """`{"wd": value}` where the grid has a weight decay axis, else nothing (the papers' files unchanged)."""
        return {} if self.wd is None else {"wd": self.wd}

    def metric_lines(self, first: int = 0) -> list[dict]:
        """The metrics.jsonl lines of this head's epochs from `first` on (the diverged epoch last; epoch 0, the
        starting model, where it was scored)."""
        keys = {"loss": self.loss, **({"rule": self.rule} if self.rule != DEFAULT_RULE else {}), "lr": self.lr,
                **self.wd_entry(), "batch_size": self.batch_size, "seed": self.seed, **({"hparams": self.hparams} if self.hparams else {})}
        lines = [{**keys, "epoch": e + 1, "train_loss": t, "val_map": v, "test_map": m}
                 for e, (t, v, m) in enumerate(zip(self.train_loss, self.val_map, self.test_map))]
        if self.stopped_epoch is not None:
            lines[self.stopped_epoch - 1]["early_stop"] = True
        if self.diverged_epoch is not None:
            lines.append({**keys, "epoch": self.diverged_epoch, "train_loss": None, "val_map": None,
                          "test_map": None, "diverged": True})
        if self.start is not None:
            lines.insert(0, {**keys, "epoch": 0, "train_loss": None, **self.start})
        return [line for line in lines if line["epoch"] >= first]


def stops_early(record: HeadRecord, rule: str, margin: float) -> bool:
    """A paper's early stopping after the epoch just recorded: `no_gain`, the epoch did not improve on the best;
    `drop`, its val mAP fell more than `margin` below the best."""
    if rule == "no_gain":
        return record.best_epoch != len(record.val_map)
    return record.best_val_map - record.val_map[-1] > margin


def best_so_far(records: list[HeadRecord]) -> dict | None:
    """The head with the best val mAP so far among `records` (for live display): a small picklable summary."""
    best = max(records, key=lambda r: r.best_val_map)
    if best.best_epoch is None:
        return None
    return {"val_map": best.best_val_map, "test_map": best.test_map[best.best_epoch - 1], "lr": best.lr,
            **best.wd_entry(), "batch_size": best.batch_size, "epoch": best.best_epoch, "hparams": best.hparams}


@dataclass(frozen=True, kw_only=True)
class Selection:
    lr: float
    batch_size: int
    records: list[HeadRecord]  # the selected config's head of every seed, in seed order
    mean_val_map: float
    hparams: dict = field(default_factory=dict)  # the selected values of the swept hyperparameters
    wd: float | None = None  # the selected weight decay (None: the grid has no such axis)

    @property
    def representative(self) -> HeadRecord:
        """The seed whose head goes to best.pt and scores/: the best val mAP (first seed on ties)."""
        return max(self.records, key=lambda record: (record.best_val_map, -record.seed))


def select_config(records: list[HeadRecord]) -> Selection | None:
    """The config (lr, weight decay, batch size and swept hyperparameters) with the highest mean (over seeds) best-epoch val mAP;
    None when every head diverged at once."""
    configs: dict[tuple, list[HeadRecord]] = {}
    for record in records:  # grid order: lr, weight decay, then batch size (then the swept values), as given
        key = (record.lr, record.wd, record.batch_size, record.swept)
        configs.setdefault(key, []).append(record)
    chosen, best = None, -math.inf
    for (lr, wd, batch_size, _), heads in configs.items():
        mean_val = float(np.mean([head.best_val_map for head in heads]))
        if mean_val > best:
            heads = sorted(heads, key=lambda h: h.seed)
            chosen = Selection(lr=lr, batch_size=batch_size, records=heads, mean_val_map=mean_val,
                               hparams=dict(heads[0].hparams), wd=wd)
            best = mean_val
    return chosen


def loss_results(records: list[HeadRecord], selection: Selection | None, hparams: dict, train_maps: list[float],
                 seconds: float) -> dict:
    """The `results.json` entry of one loss (docs/internals.md, "run directories")."""
    configs = [
        {
            "lr": r.lr, **r.wd_entry(), "batch_size": r.batch_size, "seed": r.seed, "best_epoch": r.best_epoch,
            "val_map": r.best_val_map if r.best_epoch else None,
            "test_map": r.test_map[r.best_epoch - 1] if r.best_epoch else None,
            "diverged_epoch": r.diverged_epoch,
            **({"stopped_epoch": r.stopped_epoch} if r.stopped_epoch is not None else {}),
            **({"hparams": r.hparams} if r.hparams else {}),
        }
        for r in records
    ]
    if selection is None:
        return {"selected": None, "error": "no config has a scored epoch in every seed: heads diverged in their first"
                " epoch", "configs": configs, "seconds": seconds}
    chosen = selection.records
    val = [r.best_val_map for r in chosen]
    test = [r.test_map[r.best_epoch - 1] for r in chosen]
    return {
        "selected": {"lr": selection.lr, **({} if selection.wd is None else {"wd": selection.wd}),
                     "batch_size": selection.batch_size, "hparams": {**hparams, **selection.hparams},
                     **({"swept": selection.hparams} if selection.hparams else {})},
        "best_epoch": [r.best_epoch for r in chosen],
        "val_map": float(np.mean(val)),
        "val_map_std": float(np.std(val)),
        "test_map": float(np.mean(test)),
        "test_map_std": float(np.std(test)),
        # None when not measured (the train features streamed from the cache: linear/out_of_core.py)
        "train_map": None if None in train_maps else float(np.mean(train_maps)),
        "per_class_ap": (100 * np.mean([r.best_test_ap for r in chosen], axis=0)).tolist(),
        "per_seed": [
            {"seed": r.seed, "best_epoch": r.best_epoch, "val_map": v, "test_map": t, "train_map": m}
            for r, v, t, m in zip(chosen, val, test, train_maps)
        ],
        "configs": configs,
        "seconds": seconds,
    }


def diverged_after_selection(result: dict) -> int | None:
    """The first epoch at which a head of the selected config (of any seed) diverged, read from a `results.json`
    loss entry's `configs` (so a run written before this was asked is read alike), or None. Its numbers are then
    those of an epoch before its loss turned non-finite: no converged result, never a loss's best."""
    selected = result.get("selected")
    if not selected:
        return None
    same = lambda config: (config["lr"], config.get("wd"), config["batch_size"], config.get("hparams") or {}) == (
        selected["lr"], selected.get("wd"), selected["batch_size"], selected.get("swept") or {})
    epochs = [config["diverged_epoch"] for config in result.get("configs") or []
              if config.get("diverged_epoch") is not None and same(config)]
    return min(epochs, default=None)


def diverged_note(result: dict) -> str | None:
    """What `diverged_after_selection` found, said: which heads diverged when, and what the numbers are."""
    epoch = diverged_after_selection(result)
    if epoch is None:
        return None
    selected, configs = result["selected"], result.get("configs") or []
    if all(config.get("diverged_epoch") is not None for config in configs):
        which = f"every head diverged (a non-finite loss or score), the selected ones at epoch {epoch}"
    else:
        which = (f"the selected heads (lr {selected['lr']:g}, batch {selected['batch_size']}) diverged (a non-finite"
                 f" loss or score) at epoch {epoch}")
    best = ",".join(str(best) for best in result.get("best_epoch") or [])
    return f"{which}; its numbers are epoch {best}'s, from before: no converged result (try a lower --lr, or check the loss)"
