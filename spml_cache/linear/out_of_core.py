"""Stage two out of core: what fits a memory budget, the seeded chunk order of an epoch, batches streamed from the
cache, and average precision scored a block of classes at a time (docs/protocol.md, "Out of core").

In memory (the default whenever the budget allows) an epoch is one permutation of all training rows. Out of
core the training rows are cut into chunks of `chunk_rows` consecutive rows; an epoch visits the chunks in a
seeded permutation and each chunk's rows in a seeded shuffle, and batches are consecutive slices of that order
(a batch may straddle two chunks). Scoring never builds a [N, C] score matrix beyond the budget: classes are
scored a block at a time (AP is per class, so the figures are those of one pass), the features read again for
each block when they are not in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from spml_cache import cache
from spml_cache.labels import tensor_columns
from spml_cache.metrics import average_precision
from spml_cache.runtime import memory
from spml_cache.runtime.errors import check_stop

FLOAT_BYTES = 4
# Bytes per (head, row, class) element while scoring: the scores and `metrics.average_precision`'s buffers
# (int64 keys, int32 counts, a bool mask, ...), measured ~30; rounded up.
SCORING_BYTES = 40
# Per head and class per feature: weight, gradient, two Adam moments, the best epoch's copy (made through one
# temporary) and the logits' share; measured on the 500k x 5,000 benchmark (docs/benchmarks.md).
HEAD_COPIES = 7
MARGIN = 0.1  # of the budget, kept for what the plan does not count: ids, Python objects, transient copies
# What the process itself holds before stage two's arrays (Python, torch, h5py: ~540 MB resident measured on the
# CPU with torch 2.14; on a GPU the budget is the device's memory, none of it in use yet). A constant, not a
# measurement: the plan, and with it the chunk order and the results, is a function of the command alone (the
# budget, the cache's shapes, the grid), the same in every run of it (a measurement differed by a few MB from run
# to run, and the chunks by a row).
PROCESS_BYTES = {"cpu": 512 * 2**20, "cuda": 0}
# A group of heads fits when the features left for it still come in chunks of this many rows (or all of them):
# smaller chunks would spend an epoch on reads.
MIN_CHUNK_ROWS = 1024


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """How stage two holds a cache: the train and eval features in memory or streamed, and how many classes
    are scored at once (`class_block`; all of them when it is `num_classes`)."""

    budget: int  # bytes
    train_in_memory: bool = True
    eval_in_memory: bool = True
    chunk_rows: int = 0  # rows per chunk when features stream (training's chunk order, and scoring's reads)
    class_block: int = 0  # classes per scoring block; 0 = all
    short: int = 0  # bytes the heads, labels and process need beyond the budget before any feature (0: none)

    @property
    def streams(self) -> bool:
        return not (self.train_in_memory and self.eval_in_memory)

    def describe(self) -> str:
        """The one line a run prints when something streams."""
        train = ("train features in memory" if self.train_in_memory
                 else f"train features streamed from the cache in chunks of {self.chunk_rows:,} rows")
        evaluated = "val/test in memory" if self.eval_in_memory else "val/test streamed"
        blocks = f", scored {self.class_block:,} classes at a time" if self.class_block else ""
        over = (f" (the heads, labels and process alone take {memory.describe(self.short)} more than the budget:"
                " expect to exceed it, even one lr at a time)") if self.short else ""
        return f"memory budget {memory.describe(self.budget)}: {train}, {evaluated}{blocks}{over}"


def plan(budget: int, shapes: dict[str, tuple[int, int]], num_classes: int, heads: int, label_bytes: int,
         baseline: int) -> MemoryPlan:
    """The plan for a cache of `shapes` (split: (rows, D)) and `num_classes`, training `heads` heads at once,
    whose labels take `label_bytes`, in a process already holding `baseline` bytes. The best states of heads
    trained before (other lr groups, other parts) wait on disk (parts.py), not here."""
    dim = shapes["train"][1]
    num_train, num_val, num_test = (shapes[name][0] for name in ("train", "val", "test"))
    heads_bytes = HEAD_COPIES * heads * FLOAT_BYTES * (dim + 1) * num_classes
    left = int(budget * (1 - MARGIN)) - baseline - label_bytes - heads_bytes
    train, evaluated = num_train * dim * FLOAT_BYTES, (num_val + num_test) * dim * FLOAT_BYTES
    scoring = heads * num_classes * ((num_val + num_test) * FLOAT_BYTES + max(num_val, num_test) * SCORING_BYTES)
    train_scoring = num_classes * num_train * (FLOAT_BYTES + SCORING_BYTES)  # one head on the train rows (selection)
    if train + evaluated + max(scoring, train_scoring) <= left:
        return MemoryPlan(budget=budget)
    short, left = max(-left, 0), max(left, 0)
    train_in_memory = train <= left // 2
    eval_in_memory = evaluated <= left // 5
    # Over the budget before any feature (`short`): chunks of at least MIN_CHUNK_ROWS rows all the same, since
    # rows read one by one would make an epoch last hours and still not meet the budget.
    floor = min(num_train, MIN_CHUNK_ROWS) if short else 1
    chunk_rows = max(floor, min(max(num_train, num_val, num_test), left // 4 // (3 * dim * FLOAT_BYTES)))
    per_class = heads * max(num_val, num_test) * (SCORING_BYTES + FLOAT_BYTES)
    class_block = int(max(1, min(num_classes, left // 4 // max(per_class, 1))))
    return MemoryPlan(budget=budget, train_in_memory=train_in_memory, eval_in_memory=eval_in_memory,
                      chunk_rows=int(chunk_rows), class_block=class_block, short=short)


def epoch_permutations(num_rows: int, seed: int, epochs: int) -> torch.Tensor:
    """The batch order `[epochs, num_rows]`: a function of (seed, epoch) only, the same for every batch size
    and device (drawn on the CPU)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_rows, generator=generator) for _ in range(epochs)])


def chunked_permutations(num_rows: int, chunk_rows: int, seed: int, epochs: int) -> torch.Tensor:
    """The batch order `[epochs, num_rows]` out of core: per epoch a seeded permutation of the chunks (of
    `chunk_rows` consecutive rows, the last one shorter) and a seeded shuffle of each chunk's rows; a function
    of (seed, epoch, chunk_rows) only."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.arange(0, num_rows, chunk_rows)
    orders = []
    for _ in range(epochs):
        parts = []
        for chunk in torch.randperm(len(starts), generator=generator).tolist():
            low = int(starts[chunk])
            size = min(chunk_rows, num_rows - low)
            parts.append(low + torch.randperm(size, generator=generator))
        orders.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64))
    return torch.stack(orders)


@dataclass(eq=False)
class Batch:
    """One training batch: its features with a ones column last `[B, D + 1]` (the heads' bias: their logits and
    gradient are then one product each, head_matrix.py), observed labels `[B, C]` and (oracle losses) full labels.
    `rows` (the first D columns, where a batch's feature rows are written) and `features_t` (the transpose the
    heads' gradient reads) are views made once with it: a batch size's buffers serve every step."""

    features: torch.Tensor
    observed: torch.Tensor
    labels: torch.Tensor | None

    def __post_init__(self) -> None:
        self.rows, self.features_t = self.features[:, :-1], self.features.t()

    @staticmethod
    def features_buffer(rows: int, dim: int, device: torch.device) -> torch.Tensor:
        """`[rows, dim + 1]` of ones: the feature rows are written into its first `dim` columns."""
        return torch.ones((rows, dim + 1), dtype=torch.float32, device=device)


class ChunkReader:
    """Training rows read from the cache a chunk at a time, for the batches of one chunked order: the chunks a
    batch touches are kept (at most two: a batch straddles at most one chunk boundary when it is no larger than
    a chunk), the others dropped."""

    def __init__(self, source, chunk_rows: int, device: torch.device) -> None:
        self.source, self.chunk_rows, self.device = source, chunk_rows, device
        self.loaded: dict[int, torch.Tensor] = {}
        self.buffers: dict[int, np.ndarray] = {}  # chunk -> the host buffer it was read into
        self.free: list[np.ndarray] = []  # host buffers, reused

    def features(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The feature rows `rows` (into `out`, when given)."""
        chunks = torch.div(rows, self.chunk_rows, rounding_mode="floor")
        needed = sorted(set(chunks.tolist()))
        for chunk in [c for c in self.loaded if c not in needed]:
            del self.loaded[chunk]
            self.free.append(self.buffers.pop(chunk))
        for chunk in needed:
            if chunk not in self.loaded:
                low = chunk * self.chunk_rows
                buffer = self.free.pop() if self.free else np.empty((self.chunk_rows, self.source.shape[1]), np.float32)
                self.buffers[chunk] = buffer
                block = self.source.read(low, min(low + self.chunk_rows, len(self.source)), out=buffer)
                self.loaded[chunk] = torch.from_numpy(block).to(self.device)
        if len(needed) == 1:
            return torch.index_select(self.loaded[needed[0]], 0, rows - needed[0] * self.chunk_rows, out=out)
        if out is None:
            out = torch.empty((len(rows), self.source.shape[1]), dtype=torch.float32, device=self.device)
        for chunk in needed:
            here = (chunks == chunk).nonzero().squeeze(1)
            out[here] = self.loaded[chunk].index_select(0, rows[here] - chunk * self.chunk_rows)
        return out


class RowSource:
    """Rows `[N, D]` of features for scoring: an in-memory tensor, or one or more `StoredFeatures` end to end
    (val then test), read in chunks."""

    def __init__(self, parts: list, device: torch.device, chunk_rows: int = 16384) -> None:
        self.parts, self.device, self.chunk_rows = parts, device, chunk_rows
        self.bounds = np.cumsum([0] + [len(part) for part in parts])
        self.shape = (int(self.bounds[-1]), parts[0].shape[1])

    def __len__(self) -> int:
        return self.shape[0]

    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows `start:stop` into the first rows of `out` (a new array when None)."""
        out = np.empty((stop - start, self.shape[1]), np.float32) if out is None else out
        for part, low, high in zip(self.parts, self.bounds[:-1], self.bounds[1:]):
            a, b = max(start, low), min(stop, high)
            if a < b:
                part.read(int(a - low), int(b - low), out=out[a - start : b - start])
        return out[: stop - start]

    def chunks(self, start: int, stop: int):
        """The rows `start:stop` a chunk at a time, every chunk read into the same buffer: each is to be used
        before the next is asked for."""
        buffer = np.empty((min(self.chunk_rows, max(stop - start, 0)), self.shape[1]), np.float32)
        for low in range(start, stop, self.chunk_rows):
            yield torch.from_numpy(self.read(low, min(low + self.chunk_rows, stop), out=buffer)).to(self.device)


def _columns(heads, low: int, high: int) -> torch.Tensor:
    """The columns of classes `low:high` of every head of a `HeadMatrix` (head k's at k*C + c)."""
    device = heads.scaled_bias.device
    return (torch.arange(heads.num_heads, device=device).view(-1, 1) * heads.num_classes
            + torch.arange(low, high, device=device)).reshape(-1)


def block_logits(heads, features: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """Logits `[K, N, high - low]` of every head of a `HeadMatrix` for the classes `low:high`."""
    columns = _columns(heads, low, high)
    flat = torch.addmm(heads.scaled_bias[columns], features, heads.scaled_weight[:, columns])
    flat.mul_(heads.lr_columns[columns])
    return flat.view(len(features), heads.num_heads, high - low).transpose(0, 1)


def blocked_average_precision(heads: list, source, start: int, stop: int, targets, class_block: int,
                              num_classes: int, mask=None) -> torch.Tensor:
    """Per-class AP `[sum K, C]` of every head of the `HeadMatrix`es `heads` on the rows `start:stop` of `source`
    (a tensor, or a `RowSource` read again per block), against the first `stop - start` rows of `targets` (over
    the annotated entries of `mask`, partial labels), a block of `class_block` classes at a time."""
    device = heads[0].scaled_bias.device
    out = []
    for low in range(0, num_classes, class_block):
        check_stop()  # a safe point: a block may read every row from the cache again
        high = min(low + class_block, num_classes)
        if isinstance(source, RowSource):
            chunks = source.chunks(start, stop)
        else:
            chunks = [source[i : min(i + 16384, stop)] for i in range(start, stop, 16384)]
        logits = [[] for _ in heads]
        for features in chunks:
            for index, matrix in enumerate(heads):
                logits[index].append(block_logits(matrix, features, low, high))
        scores = torch.cat([torch.sigmoid(torch.cat(parts, dim=1)) for parts in logits])  # per matrix: engine._aps
        del logits
        annotated = None if mask is None else tensor_columns(mask, low, high, device, stop - start)
        out.append(average_precision(scores, tensor_columns(targets, low, high, device, stop - start), annotated))
    return torch.cat(out, dim=-1)


def dense_targets(targets, rows: int, device: torch.device) -> torch.Tensor | None:
    """All classes of the first `rows` rows of `targets` as a dense uint8 tensor (None stays None: no mask)."""
    return None if targets is None else tensor_columns(targets, 0, targets.shape[1], device, rows)


def load_within(path, budget: int, heads: int, device: torch.device, chunk_rows: int | None = None,
                per_group: int | None = None):
    """The cache at `path` loaded for `budget` bytes of `device` (`plan`), `heads` heads trained at once:
    `(FeatureSet, MemoryPlan, groups)`, the features that do not fit left in the file. `chunk_rows`: the chunk size
    given (`--chunk-rows`, or a resumed run's), the train features streamed in chunks of it whatever the budget.
    When the heads alone exceed the budget and come in groups of `per_group` (an lr's heads of one batch size),
    `groups` is how many groups to train at once (the most that fit, at least one); else None. Nothing measured
    at run time enters the plan (`PROCESS_BYTES`)."""
    shapes, label_bytes, num_classes = cache.feature_shapes(path)
    baseline = PROCESS_BYTES["cuda" if device.type == "cuda" else "cpu"]
    chosen, groups = plan(budget, shapes, num_classes, heads, label_bytes, baseline), None
    if chosen.short and per_group:
        def fits(n: int) -> bool:  # n groups at once
            tried = plan(budget, shapes, num_classes, n * per_group, label_bytes, baseline)
            return not tried.short and (not tried.streams or tried.chunk_rows >= min(shapes["train"][0], MIN_CHUNK_ROWS))

        groups = next((n for n in range(heads // per_group, 0, -1) if fits(n)), 1)
        chosen = plan(budget, shapes, num_classes, groups * per_group, label_bytes, baseline)
    if chunk_rows:  # the chunk order asked for, or a resumed out-of-core run's own
        # More rows than the training rows is one chunk of them all, whose order (`chunked_permutations`) is the
        # in-memory order: the same batches as `chunk_rows` = the training rows, without a buffer of the size given.
        chosen = replace(chosen, train_in_memory=False, chunk_rows=max(1, min(chunk_rows, shapes["train"][0])))
    if not chosen.streams:
        return cache.load(path), chosen, groups
    features = cache.load(path, in_memory=False)
    splits = {}
    for name, in_memory in (("train", chosen.train_in_memory), ("val", chosen.eval_in_memory),
                            ("test", chosen.eval_in_memory)):
        split = getattr(features, name)
        splits[name] = replace(split, features=split.features.read(0, len(split))) if in_memory else split
    return replace(features, **splits), chosen, groups


def train_map(state: dict, data) -> float:
    """mAP (0..100) of one head in `nn.Linear` layout on the in-memory train features of `LinearData` `data`, a
    block of classes at a time (the block shrunk so that one head over every training row fits as K heads over
    the val/test rows do)."""
    from spml_cache.linear.head_matrix import HeadMatrix

    heads = HeadMatrix(state["weight"].shape[1], state["weight"].shape[0], [0], [1.0], device=data.device,
                       start=(state["weight"], state["bias"]))
    rows = data.num_train
    block = max(1, data.class_block * max(data.num_val, len(data.test_labels), 1) // max(rows, 1))
    ap = blocked_average_precision([heads], data.train_features, 0, rows, data.train_labels, block, data.num_classes)
    return 100.0 * float(ap.mean())
