"""The SPML benchmark protocol of Cole et al. (spec/protocol.md), bit-identical to their code, and the metric.

- `split_train_val`: the 80/20 train/val split of the official training rows (`RandomState(1200)`).
- `observe_labels`: the single positive per image (`RandomState(1200)`, one pass in row order), generalised to
  `num_pos` positives and `num_neg` negatives.
- `average_precision` / `mean_average_precision`: per-class AP with `sklearn.metrics.average_precision_score`
  semantics, vectorised over classes and over any leading head dimensions, on the scores' device.

The random draws must match the reference number for number, so that users can compare against (and import)
the authors' formatted label files: the functions below consume the random stream in exactly the reference's
order, including draws whose result is thrown away.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from spml_cache.errors import SpmlError

if TYPE_CHECKING:
    from spml_cache.datasets import LabeledImages

SPLIT_SEED = 1200
OBSERVE_SEED = 1200
VAL_FRAC = 0.2
# Mean positives per training image of the fully labelled datasets, as the papers use them (EPR's k, ...).
EXPECTED_POSITIVES = {"voc": 1.5, "coco": 2.9, "nus": 1.9, "cub": 31.4}


@dataclass(frozen=True)
class ProtocolSplit:
    ids: list[str]
    labels: np.ndarray  # uint8 [N, C], full ground truth
    observed: np.ndarray | None  # int8 [N, C]: 1 observed positive, 0 unobserved, -1 observed negative; None for test


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
    `num_neg` (as -1). The negatives are shuffled even when `num_neg == 0`, and the positives even when the
    row has none to keep: the reference does both, and every shuffle of more than one index consumes random
    numbers that the following rows depend on.
    """
    labels = np.asarray(labels)
    if labels.ndim != 2:
        raise SpmlError(f"labels must be a 2-D [images, classes] matrix, got shape {labels.shape}")
    positive = labels == 1
    if not (positive | (labels == 0)).all():
        raise SpmlError("labels must hold only 0 and 1 (full ground truth)")
    for name, count in (("num_pos", num_pos), ("num_neg", num_neg)):
        if int(count) != count or count < 0:
            raise SpmlError(f"{name} must be a whole number >= 0, got {count}")
    num_pos, num_neg = int(num_pos), int(num_neg)

    rng = np.random.RandomState(seed)
    observed = np.zeros(labels.shape, dtype=np.int8)
    for row in range(labels.shape[0]):
        # The shuffled arrays are the reference's own: the int64 index arrays of np.nonzero.
        positive_classes = np.nonzero(positive[row])[0]
        rng.shuffle(positive_classes)
        observed[row, positive_classes[:num_pos]] = 1
        negative_classes = np.nonzero(~positive[row])[0]
        rng.shuffle(negative_classes)
        observed[row, negative_classes[:num_neg]] = -1
    return observed


def expected_positives(labels: np.ndarray) -> float:
    """Mean number of positive labels per image (the papers' `k`); 0.0 for no images."""
    labels = np.asarray(labels)
    if labels.ndim != 2:
        raise SpmlError(f"labels must be a 2-D [images, classes] matrix, got shape {labels.shape}")
    if labels.shape[0] == 0:
        return 0.0
    return float((labels > 0).sum(axis=1, dtype=np.int64).mean())


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
    labels = np.asarray(images.train.labels, dtype=np.uint8)
    ids = list(images.train.ids)
    if len(ids) != labels.shape[0]:
        raise SpmlError(f"{images.dataset}: {len(ids)} training ids but {labels.shape[0]} label rows")
    observed = observe_labels(labels, num_pos=num_pos, num_neg=num_neg, seed=observe_seed)
    train_rows, val_rows = split_train_val(len(ids), val_frac=val_frac, seed=split_seed)

    def rows(selected: np.ndarray) -> ProtocolSplit:
        return ProtocolSplit([ids[i] for i in selected], labels[selected], observed[selected])

    test = ProtocolSplit(list(images.test.ids), np.asarray(images.test.labels, dtype=np.uint8), None)
    attrs = {
        "split_seed": int(split_seed),
        "val_frac": float(val_frac),
        "observe_seed": int(observe_seed),
        "num_pos": int(num_pos),
        "num_neg": int(num_neg),
        "expected_positives": expected_positives(labels),
    }
    return Protocol(train=rows(train_rows), val=rows(val_rows), test=test, attrs=attrs)


def _as_tensor(values: Any) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values
    array = np.ascontiguousarray(values)
    if not array.flags.writeable:  # torch warns on read-only buffers (np.load mmap, h5py)
        array = array.copy()
    return torch.from_numpy(array)


def _order_keys(scores: torch.Tensor) -> torch.Tensor:
    """Integers with the same order and the same ties as `scores` (any layout), small enough to double."""
    if scores.element_size() >= 8:
        # 64-bit scores leave no room for the label bit: their dense ranks have the same order and ties.
        return torch.unique(scores, return_inverse=True)[1]
    if scores.is_floating_point():
        # IEEE floats are sign-magnitude: magnitude times sign of the int32 bits orders like the floats,
        # and -0.0 meets +0.0 at 0 (sklearn ties them).
        bits = scores.float().view(torch.int32)
        return (bits & 0x7FFFFFFF).mul_(bits.sign())
    return scores  # bool and integers up to 32 bits are their own keys


def _sorted_keys(scores: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """int64 `[..., C, N]`, each row sorted ascending: `2 * (-order key of the score) + label`.

    Ascending keys are descending scores, tied scores stay adjacent, and the label rides along in the low
    bit: one sort of plain integers replaces an argsort and two gathers.
    """
    *heads, num_rows, num_classes = scores.shape
    keys = torch.empty((*heads, num_classes, num_rows), dtype=torch.int64, device=scores.device)
    keys.copy_(_order_keys(scores).transpose(-1, -2))
    keys.mul_(-2).add_(positive.to(torch.int64))
    if keys.device.type == "cpu":
        # numpy's vectorised sort is several times faster than torch.sort on the CPU (same result: the keys are
        # plain integers), and sorts in place.
        keys.numpy().sort(axis=-1)
        return keys
    return torch.sort(keys, dim=-1).values


def average_precision(scores: torch.Tensor, labels: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Per-class average precision (0..1) of `scores [..., N, C]` against 0/1 `labels [N, C]`: `[..., C]`.

    sklearn's `average_precision_score` for every class and every leading (head) index at once:
    AP = sum over distinct score thresholds t (descending) of (R(t) - R(t_prev)) * P(t), with P and R the
    precision and recall of "score >= t"; tied scores enter together. A class without positives has AP 0.
    A column with a NaN score has AP NaN (a diverged head stays visible). Labels > 0 count as positive.
    Computed on the scores' device; float64 result.
    """
    scores = _as_tensor(scores).detach()
    labels = _as_tensor(labels).to(scores.device)
    if scores.ndim < 2 or tuple(scores.shape[-2:]) != tuple(labels.shape):
        raise SpmlError(f"scores {tuple(scores.shape)} do not match labels {tuple(labels.shape)}: expected [..., N, C]")
    device = scores.device
    positive = (labels > 0).T  # [C, N]
    if scores.shape[-2] == 0:  # no images: no positives
        return torch.zeros(scores.shape[:-2] + scores.shape[-1:], dtype=torch.float64, device=device)

    # The [heads, C, N] buffers are large: they are reused in place, as allocating them is a good part of the
    # cost on the CPU.
    keys = _sorted_keys(scores, positive)
    true_pos = torch.bitwise_and(keys, 1, out=torch.empty(keys.shape, dtype=torch.int32, device=device))
    true_pos.cumsum_(-1)  # true positives among the top n scores, n = 1..N
    keys >>= 1  # drop the labels: equal keys are now tied scores
    # sklearn evaluates precision at distinct thresholds only: at a cut after the last of a run of tied scores.
    is_cut = torch.ones(keys.shape, dtype=torch.bool, device=device)
    torch.ne(keys[..., 1:], keys[..., :-1], out=is_cut[..., :-1])
    gained = torch.mul(true_pos, is_cut)
    del is_cut
    at_last_cut = torch.empty_like(true_pos)
    torch.cummax(gained, dim=-1, out=(at_last_cut, keys))  # keys' buffer takes the unused argmax indices
    # Positives gained at a cut: the step of the true positives at the last cut (zero between cuts).
    torch.sub(at_last_cut[..., 1:], at_last_cut[..., :-1], out=gained[..., 1:])
    gained[..., 0] = at_last_cut[..., 0]
    del at_last_cut
    # AP * positives = sum over cuts of (positives gained) * precision; float64 products in keys' buffer.
    weighted = keys.view(torch.float64)
    del keys
    weighted.copy_(gained).mul_(true_pos)
    del gained, true_pos
    inverse_ranks = 1.0 / torch.arange(1, scores.shape[-2] + 1, device=device, dtype=torch.float64)
    recall_weighted = weighted @ inverse_ranks

    num_positives = positive.sum(-1, dtype=torch.float64)
    ap = torch.where(num_positives > 0, recall_weighted / num_positives.clamp(min=1), 0.0)
    if scores.is_floating_point():
        ap = torch.where(torch.isnan(scores.amax(dim=-2)), torch.nan, ap)  # amax propagates NaN
    return ap


def mean_average_precision(scores: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray) -> float:
    """mAP on the 0..100 scale: the mean over ALL classes of `average_precision` (classes without positives
    count as 0) of one `[N, C]` score matrix; numpy or torch inputs."""
    scores = _as_tensor(scores)
    if scores.ndim != 2 or scores.shape[-1] == 0:
        raise SpmlError(f"mean_average_precision wants scores [N, C] with C >= 1, got {tuple(scores.shape)}")
    return 100.0 * float(average_precision(scores, labels).mean())
