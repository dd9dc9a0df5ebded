"""The SPML benchmark protocol of Cole et al. (CVPR 2021; docs/protocol.md), bit-identical to their code.

- `split_train_val`: the 80/20 train/val split of the official training rows (`RandomState(1200)`).
- `observe_labels`: the single positive per image (`RandomState(1200)`, one pass in row order), generalised to
  `num_pos` positives and `num_neg` negatives.
- `initial_head`: the seeded `nn.Linear` every stage starts a head from.
- The papers' grid and epochs, shared by stages two and three.

The metric lives in `metrics.py` (re-exported here: `protocol.mean_average_precision` is public API). torch is
imported only when the metric or `initial_head` is first used, so that the command line checks its flags
(`--observe`, observation/) without loading it.

The random draws must match the reference number for number, so that users can compare against (and import)
the authors' formatted label files: the functions below consume the random stream in exactly the reference's
order, including draws whose result is thrown away.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np

from spml_cache.labels import SparseLabels, as_full, count_positive, hide_unannotated, is_sparse, take
from spml_cache.runtime.errors import SpmlError

if TYPE_CHECKING:
    import torch

    from spml_cache.datasets import LabeledImages

SPLIT_SEED = 1200
OBSERVE_SEED = 1200
VAL_FRAC = 0.2
# The papers' grid (docs/protocol.md, "Training and selection"): every lr x batch size, the best val epoch; each
# stage's options declare them as their defaults and check what is given (options/linear.py: LRS, BATCH_SIZES, WDS).
GRID_LRS = (1e-2, 1e-3, 1e-4, 1e-5)
GRID_BATCH_SIZES = (8, 16)
GRID_WDS = (0.0,)  # the probe's L2 weight decay: none in the papers' grid (linear --wd adds the axis)
LINEAR_EPOCHS = 25
FINETUNE_EPOCHS = 10


class Fidelity(str, Enum):
    """How a loss is computed and trained (docs/fidelity.md): `exact`, the papers' math computed stably (the
    default), or `authors`, the authors' code's numerics and rules (eps in the logs, dropped last batches, early
    stopping). A `str`, so that it compares and is stored as its name."""

    EXACT = "exact"
    AUTHORS = "authors"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def check(cls, value: "Fidelity | str | None" = None, flag: str = "--fidelity") -> "Fidelity":
        """`value` as a Fidelity, None as the default; a bad value is one line naming the flag."""
        if value is None:
            return cls.EXACT
        try:
            return cls(value)
        except ValueError:
            names = " or ".join(member.value for member in cls)
            raise SpmlError(f"{flag} {value!r}: use {names} (docs/fidelity.md)") from None


@dataclass(frozen=True)
class ProtocolSplit:
    ids: list[str]
    labels: np.ndarray | SparseLabels  # uint8 [N, C], full ground truth (SparseLabels for sparse datasets)
    observed: np.ndarray | SparseLabels | None  # int8 [N, C]: 1 observed, 0 unknown, -1 observed negative; None: test
    mask: np.ndarray | SparseLabels | None = None  # uint8 [N, C], 1 where annotated; None: all are (datasets/base.py)


@dataclass(frozen=True)
class Protocol:
    train: ProtocolSplit
    val: ProtocolSplit
    test: ProtocolSplit
    attrs: dict[str, Any]  # split_seed, val_frac, observe_seed, num_pos, num_neg, expected_positives


def split_train_val(
    num_rows: int, *, val_frac: float = VAL_FRAC, seed: int = SPLIT_SEED
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted row indices (int64) of the train and val parts of `num_rows` official training rows.

    The reference: `perm = RandomState(seed).permutation(N)`, `n_val = round(val_frac * N)`,
    train = `sort(perm[:N - n_val])`, val = `sort(perm[-n_val:])`.
    """
    if num_rows < 0:
        raise SpmlError(f"split_train_val: num_rows must be >= 0, got {num_rows}")
    if not 0.0 <= val_frac < 1.0:
        raise SpmlError(f"val_frac must be in [0, 1), got {val_frac}")
    num_val = int(np.round(val_frac * num_rows))  # numpy's round, as the reference (half to even)
    perm = np.random.RandomState(seed).permutation(num_rows)
    # perm[N - n_val:] rather than the reference's perm[-n_val:]: identical for n_val > 0, and an empty val
    # part (not all rows) when n_val == 0.
    train_rows = np.sort(perm[: num_rows - num_val]).astype(np.int64, copy=False)
    val_rows = np.sort(perm[num_rows - num_val :]).astype(np.int64, copy=False)
    return train_rows, val_rows


def observe_labels(labels: np.ndarray, *, num_pos: int = 1, num_neg: int = 0, seed: int = OBSERVE_SEED) -> np.ndarray:
    """The observed labels (int8 [N, C]: 1 / 0 / -1) drawn from full 0/1 labels, exactly as the reference.

    One `RandomState(seed)` for the whole matrix, rows in order; per row: shuffle the positive class indices
    in place and keep the first `num_pos`, then shuffle the negative class indices in place and keep the first
    `num_neg` (as -1); a count of -1 keeps them all (the reference's `num_sel == -1`). The negatives are
    shuffled even when `num_neg == 0`, and the positives even when the row has none to keep: the reference does
    both, and every shuffle of more than one index consumes random numbers that the following rows depend on.
    """
    for name, count in (("num_pos", num_pos), ("num_neg", num_neg)):
        if int(count) != count or count < -1:
            raise SpmlError(f"{name} must be a whole number >= 0, or -1 for all, got {count}")
    # a slice end: the first `count` of the shuffled indices, or all of them for -1
    keep_pos, keep_neg = (None if count == -1 else int(count) for count in (num_pos, num_neg))
    if is_sparse(labels):
        return _observe_sparse(full_sparse(labels), keep_pos, keep_neg, seed)
    labels = np.asarray(labels)
    if labels.ndim != 2:
        raise SpmlError(f"labels must be a 2-D [images, classes] matrix, got shape {labels.shape}")
    positive = labels == 1
    if not (positive | (labels == 0)).all():
        raise SpmlError("labels must hold only 0 and 1 (full ground truth)")

    rng = np.random.RandomState(seed)
    observed = np.zeros(labels.shape, dtype=np.int8)
    for row in range(labels.shape[0]):
        # The shuffled arrays are the reference's own: the int64 index arrays of np.nonzero.
        positive_classes = np.nonzero(positive[row])[0]
        rng.shuffle(positive_classes)
        observed[row, positive_classes[:keep_pos]] = 1
        negative_classes = np.nonzero(~positive[row])[0]
        rng.shuffle(negative_classes)
        observed[row, negative_classes[:keep_neg]] = -1
    return observed


def full_sparse(labels: SparseLabels) -> SparseLabels:
    """Sparse full labels checked (every stored value 0 or 1) and canonical (only the 1s, classes ascending)."""
    if not ((labels.values == 0) | (labels.values == 1)).all():
        raise SpmlError("labels must hold only 0 and 1 (full ground truth)")
    return labels.canonical()


def _observe_sparse(labels: SparseLabels, keep_pos: int | None, keep_neg: int | None, seed: int) -> SparseLabels:
    """`observe_labels` of sparse full labels: the same stream, row by row, without ever an [N, C] matrix. A
    row's positives are its CSR classes (ascending, as np.nonzero gives them), its negatives the other classes."""
    positives = np.diff(labels.indptr)
    kept = [counts if keep is None else np.minimum(counts, keep)
            for counts, keep in ((positives, keep_pos), (labels.num_classes - positives, keep_neg))]
    indptr = np.concatenate([[0], np.cumsum(kept[0] + kept[1])]).astype(np.int64)  # the output's, known ahead
    indices, values = np.zeros(indptr[-1], np.int32), np.zeros(indptr[-1], np.int8)
    rng = np.random.RandomState(seed)
    every_class = np.arange(labels.num_classes, dtype=np.int64)
    is_positive = np.zeros(labels.num_classes, dtype=bool)  # one row's positives, cleared after the row
    for row in range(len(labels)):
        positive_classes = labels.indices[labels.indptr[row] : labels.indptr[row + 1]].astype(np.int64)
        is_positive[positive_classes] = True
        negative_classes = every_class[~is_positive]
        is_positive[positive_classes] = False
        rng.shuffle(positive_classes)
        rng.shuffle(negative_classes)
        classes = np.concatenate([positive_classes[:keep_pos], negative_classes[:keep_neg]])
        signs = np.repeat(np.array([1, -1], np.int8), [kept[0][row], kept[1][row]])
        order = np.argsort(classes)
        indices[indptr[row] : indptr[row + 1]], values[indptr[row] : indptr[row + 1]] = classes[order], signs[order]
    return SparseLabels(indptr, indices, values, labels.num_classes)


def expected_positives(labels) -> float:
    """Mean number of positive labels per image (the papers' `k`); 0.0 for no images."""
    if len(getattr(labels, "shape", np.shape(labels))) != 2:
        raise SpmlError(f"labels must be a 2-D [images, classes] matrix, got shape {np.shape(labels)}")
    return float(count_positive(labels) / len(labels)) if len(labels) else 0.0


def apply_protocol(
    images: LabeledImages,
    *,
    val_frac: float = VAL_FRAC,
    split_seed: int = SPLIT_SEED,
    observe_seed: int = OBSERVE_SEED,
    num_pos: int = 1,
    num_neg: int = 0,
) -> Protocol:
    """Split the official training rows into train/val and draw the observed labels (once, over all of them).

    The observed labels are drawn before the split, over the official training rows in their order, so the
    val rows keep theirs too (for `--val-labels observed`). The official test split gets no observed labels.
    """
    labels = as_full(images.train.labels)
    ids = list(images.train.ids)
    if len(ids) != labels.shape[0]:
        raise SpmlError(f"{images.dataset}: {len(ids)} training ids but {labels.shape[0]} label rows")
    observed = observe_labels(labels, num_pos=num_pos, num_neg=num_neg, seed=observe_seed)
    mask = images.train.mask
    if mask is not None:
        observed = hide_unannotated(observed, mask)
    train_rows, val_rows = split_train_val(len(ids), val_frac=val_frac, seed=split_seed)

    def rows(selected: np.ndarray) -> ProtocolSplit:
        return ProtocolSplit([ids[i] for i in selected], take(labels, selected),
                             take(observed, selected), take(mask, selected))

    test = ProtocolSplit(list(images.test.ids), as_full(images.test.labels), None, images.test.mask)
    attrs = {
        "split_seed": int(split_seed),
        "val_frac": float(val_frac),
        "observe_seed": int(observe_seed),
        "num_pos": int(num_pos),
        "num_neg": int(num_neg),
        "expected_positives": expected_positives(labels),
    }
    return Protocol(train=rows(train_rows), val=rows(val_rows), test=test, attrs=attrs)


def check_val_split(val_labels: np.ndarray, source: str) -> None:
    """Selection ranks epochs and configs by val mAP: a val split of fewer than two rows, or without a single
    positive label, ranks nothing (every val mAP 0, the first epoch picked by chance); refuse it."""
    values = val_labels.values if hasattr(val_labels, "indptr") else np.asarray(val_labels)  # a sparse matrix's
    rows, positives = len(val_labels), int((values > 0).sum())
    if rows < 2 or positives == 0:
        what = f"{rows} row{'s' * (rows != 1)}" + ("" if rows < 2 else " and no positive label")
        raise SpmlError(f"{source}: its val split has {what}, so val mAP cannot select an epoch or a config: use a"
                        f" dataset with more training images (val is {VAL_FRAC:.0%} of them)")


def check_train_test(num_train: int, test_labels, test_mask, source: str) -> None:
    """Results that look real and are not: without a training row no head learns (the report would show the
    initial heads' mAP as a result), and a test split without a row, or without an annotated positive label,
    scores 0.00 whatever the heads learnt; refuse them before training."""
    if num_train == 0:
        raise SpmlError(f"{source}: its train split has no rows, so no head would learn anything: use a dataset with"
                        " training images")
    rows = len(test_labels)
    if rows == 0:
        raise SpmlError(f"{source}: its test split has no rows, so test mAP would be 0.00 whatever the heads learn:"
                        " use a dataset with test images")
    if count_positive(test_labels, test_mask) == 0:
        what = "positive label" if test_mask is None else "annotated positive label (every positive cell unknown)"
        raise SpmlError(f"{source}: its test split has no {what} in {rows} rows, so test mAP would be 0.00 whatever"
                        " the heads learn: label the test images' classes (a CSV's test rows need known positives)")


def average_precision(scores, labels, mask=None):
    """Per-class AP (0..1), `metrics.average_precision` (public API here too; torch loads on the first call)."""
    from spml_cache import metrics

    return metrics.average_precision(scores, labels, mask)


def mean_average_precision(scores, labels, mask=None) -> float:
    """mAP (0..100), `metrics.mean_average_precision` (public API here too; torch loads on the first call)."""
    from spml_cache import metrics

    return metrics.mean_average_precision(scores, labels, mask)


def initial_head(in_features: int, num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`nn.Linear(in_features, num_classes)`'s weight `[C, D]` and bias `[C]` right after `manual_seed(seed)`:
    the head every stage starts from for that seed, so that a head trained in a stack, alone, or on top of the
    trunk begins identically.

    Built on the CPU generator (forked, so the caller's RNG state is untouched): the same numbers on any device.
    """
    import torch
    from torch import nn

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        linear = nn.Linear(in_features, num_classes)
    return linear.weight.detach(), linear.bias.detach()
