"""Large-loss modification of `an` (Kim et al., CVPR 2022; docs/losses.md, "Large-loss modification").

Early in training the largest losses among assumed negatives are mostly false negatives, so from epoch 2 each
batch picks the `m` largest unobserved-entry losses and rejects them (`ll_r`), corrects them for this step
(`ll_ct`), or corrects them for good (`ll_cp`). Selection is per head, on detached loss values, and includes
every entry tied with the m-th largest, so a tie can select more than `m` entries. Observed negatives
(`z = -1`) are never candidates.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from spml_cache.losses.base import Fidelity, Loss, mean_over_entries, neg_log_1mp, neg_log_p, register, rows_for_heads
from spml_cache.losses.terms import logs_of, reduced
from spml_cache.runtime.registry import Param


def largest_unobserved(losses: torch.Tensor, unobserved: torch.Tensor, positions: torch.Tensor, depth: int,
                       buffers: "RankingBuffers | None" = None):
    """The unobserved entries whose loss is at least the m-th largest of their head, and that threshold.

    `losses` `[..., B, C]` (detached), `unobserved` bool, broadcastable to it; `positions` long `[..., 1]`, per
    head where the m-th largest candidate sits in descending order (`threshold_positions`); `depth`: how many of
    the largest a step ranks, at least every head's m of the whole run. Returns the mask `[..., B, C]` and the
    threshold `[..., 1, 1]`; when a head has fewer than `m` unobserved entries the threshold is -inf and all of
    them are selected; a head whose `m` is 0 selects nothing (its threshold is NaN). `buffers`: where a step of
    this shape writes its ranking (the same values and threshold, 4 ops fewer: `RankingBuffers`).
    """
    # The `depth` largest read at a position, not topk(m): the shapes do not depend on m, so one captured step
    # serves every epoch and every head's m. The NaN past the end is the threshold of m = 0: no loss is >= NaN.
    # compiled (linear --compile), the ops are fused anyway: dynamo breaks its graph at an `out=` into a view
    if buffers is None or torch.compiler.is_compiling():
        candidates = torch.where(unobserved, losses, float("-inf")).flatten(-2)
        ordered = F.pad(candidates.topk(depth, dim=-1).values, (0, 1), value=float("nan"))
        threshold = ordered.gather(-1, positions).unsqueeze(-1)
    else:
        torch.where(unobserved, losses, buffers.minus_inf, out=buffers.candidates)
        torch.topk(buffers.flat_candidates, depth, dim=-1, out=(buffers.largest, buffers.indices))
        threshold = buffers.ordered.gather(-1, buffers.positions)
    return unobserved & (losses >= threshold), threshold


class RankingBuffers:
    """What `largest_unobserved` writes one batch shape's ranking into, made by its first step with the views a
    step reads: the candidates contiguous (read `[..., B*C]` by a view: the logits' layout is not contiguous per
    head, a flatten of it copies), -inf as a tensor of their dtype, the `depth` largest written before a NaN
    that stays (no pad), the ranked values and `positions` (a view of the loss's buffer, refilled in place) with
    the dimension the threshold keeps (no unsqueeze)."""

    def __init__(self, losses: torch.Tensor, positions: torch.Tensor, depth: int) -> None:
        like = dict(dtype=losses.dtype, device=losses.device)
        self.source, self.depth = positions, depth
        self.candidates = torch.empty(losses.shape, **like)
        self.flat_candidates = self.candidates.flatten(-2)  # a view: the buffer is contiguous
        self.minus_inf = torch.full((), float("-inf"), **like)
        ranked = torch.full((*losses.shape[:-2], depth + 1), float("nan"), **like)
        self.largest = ranked[..., :depth]
        self.indices = torch.empty(self.largest.shape, dtype=torch.long, device=losses.device)
        self.ordered, self.positions = ranked.unsqueeze(-2), positions.unsqueeze(-1)

    def serve(self, positions: torch.Tensor, depth: int) -> bool:
        """Whether these buffers are the ones for `positions` (the same tensor) and `depth`."""
        return self.source is positions and self.depth == depth


def detached(x: torch.Tensor) -> torch.Tensor:
    """`x` out of autograd's graph: `x.detach()` where it is in one (`forward`), else `x` (a closed form's step: no
    op)."""
    return x.detach() if x.requires_grad else x


def threshold_positions(counts: list[int], num_entries: int, depth: int) -> torch.Tensor:
    """Per head, the position of the m-th largest of `num_entries` candidates in descending order, `[K, 1]`: the
    last one when there are fewer, one past the `depth` ranked (the NaN) when m is 0."""
    return torch.tensor([[min(m, num_entries) - 1 if m > 0 else depth] for m in counts])


class _LargeLoss(Loss):
    """`an` with stable logits, and a per-batch selection of large unobserved losses from epoch 2 on."""

    reference = "Kim et al., CVPR 2022 (Large Loss Matters); compared in Chen et al., IJCAI 2024, Table 2"
    defaults = {"delta": 0.002}
    authors_early_stop = ("drop", 3.0)  # Kim et al.: stop once val mAP falls 3 below its best
    per_head = ("delta",)
    params = (Param.between("delta", 0.0, 1.0, "()"),)
    paper_grid = {"delta": (0.001, 0.002, 0.003, 0.004, 0.005)}
    paper_grid_source = ("Kim et al.'s answer to their repository's issue 8 (LargeLossMatters): a grid search over"
                         " delta_rel in {0.1, ..., 0.5} %")

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.epoch = 0  # before the first start_epoch: nothing is rejected
        self.num_epochs: int | None = None
        self.depths: dict[int, int] = {}  # per batch size (B*C) with a buffer of positions: how many a step ranks
        self.rankings: dict[tuple, RankingBuffers] = {}  # per batch shape: where a step writes `selected`'s ranking
        self.zeros: dict[tuple, torch.Tensor] = {}  # `zero`'s

    def start_epoch(self, epoch, num_epochs, train_logits=None):
        self.epoch, self.num_epochs = epoch, num_epochs
        for num_entries, depth in list(self.depths.items()):  # in place: a step captured in another epoch reads these
            counts = self.head_counts(num_entries)
            if max(counts) > depth:  # only when called with another num_epochs than before: ranked anew
                del self.depths[num_entries]
                continue
            self.get_buffer(f"threshold_position_{num_entries}").copy_(threshold_positions(counts, num_entries, depth))

    def rejection_count(self, num_entries: int, epoch: int | None = None) -> int | list[int]:
        """m for a batch of `num_entries = B*C` entries (one per head when the heads' deltas differ), at `epoch`
        (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        deltas = self.hparams["delta"]
        if isinstance(deltas, list):
            return [self.count(num_entries, delta, epoch) for delta in deltas]
        return self.count(num_entries, deltas, epoch)

    def head_counts(self, num_entries: int, epoch: int | None = None) -> list[int]:
        """`rejection_count` as one m per head."""
        m = self.rejection_count(num_entries, epoch)
        return m if isinstance(m, list) else [m] * self.num_heads

    def positions_for(self, num_entries: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """Where this epoch's m-th largest sits among `num_entries` candidates, per head (`threshold_positions`),
        and how many a step ranks: the largest m of the run (m grows with the epoch), so that a batch of 16 x 80
        classes ranks a few dozen entries, not 1,280. m is counted on the host (exactly, in Python floats), so each
        batch size gets a device buffer, made by its first (eager) step and refilled by every `start_epoch`: a
        step reads m from memory, never from Python."""
        if num_entries not in self.depths:
            if self.num_epochs is None:  # no start_epoch yet: rank them all
                depth = num_entries
            else:
                depth = min(num_entries, max(self.head_counts(num_entries, max(self.epoch, self.num_epochs))))
            positions = threshold_positions(self.head_counts(num_entries), num_entries, depth).to(device)
            self.register_buffer(f"threshold_position_{num_entries}", positions, persistent=False)
            self.depths[num_entries] = depth
        return self.get_buffer(f"threshold_position_{num_entries}"), self.depths[num_entries]

    def count(self, num_entries: int, delta: float, epoch: int) -> int:
        """ceil(B*C*(t-1)*delta), 0 at epoch 1."""
        if epoch < 2:
            return 0
        if self.fidelity is Fidelity.AUTHORS:
            # Kim et al.'s code: clean_rate -= delta once per epoch, then ceil(B*C*(1 - clean_rate)); the float
            # subtraction makes it one higher wherever B*C*(t-1)*delta is a whole number (docs/fidelity.md)
            clean_rate = 1.0
            for _ in range(epoch - 1):
                clean_rate -= delta
            return math.ceil(num_entries * (1 - clean_rate))
        # round first: B*C*(t-1)*delta is an integer more often than floating point says (100 * 0.07)
        return math.ceil(round(num_entries * (epoch - 1) * delta, 6))

    def targets(self, logits, observed, index):
        """(positive, unobserved) masks of this batch."""
        return observed == 1, observed == 0

    def modify(self, terms, large, threshold, nl_p, nl_1mp, index):
        raise NotImplementedError

    def modify_slopes(self, slopes, large, d_nl_p):
        """`modify`'s change to the terms' slopes (the closed form's)."""
        raise NotImplementedError

    def selected(self, logits, nl_1mp, unobserved):
        """`largest_unobserved` of this batch: selected in every epoch, epoch 1 too (m = 0 selects nothing), so
        that a step runs the same ops whatever the epoch."""
        positions, depth = self.positions_for(logits.shape[-2] * logits.shape[-1], logits.device)
        positions = positions if logits.dim() == 3 else positions[0]  # [K, 1], or [1] for one head's [B, C]
        losses = detached(nl_1mp)
        key = (losses.shape, losses.dtype, losses.device)
        buffers = self.rankings.get(key)
        if buffers is None or not buffers.serve(positions, depth):  # a batch shape's first step (or a new depth)
            buffers = self.rankings[key] = RankingBuffers(losses, positions, depth)
        return largest_unobserved(losses, unobserved, positions, depth, buffers)

    def zero(self, like: torch.Tensor) -> torch.Tensor:
        """0 as a 0-d tensor of `like`'s dtype and device, made once (a `where` with the number 0 makes it each
        step)."""
        key = (like.dtype, like.device)
        if key not in self.zeros:
            self.zeros[key] = torch.zeros((), dtype=like.dtype, device=like.device)
        return self.zeros[key]

    def forward(self, logits, observed, *, labels=None, index=None):
        positive, unobserved = self.targets(logits, observed, index)
        nl_p, nl_1mp = neg_log_p(logits), neg_log_1mp(logits)
        terms = torch.where(positive, nl_p, nl_1mp)
        large, threshold = self.selected(logits, nl_1mp, unobserved)
        return mean_over_entries(self.modify(terms, large, threshold, nl_p, nl_1mp, index))

    def loss_and_grad(self, logits, observed, *, labels=None, index=None):
        positive, unobserved = self.targets(logits, observed, index)
        logs = logs_of(logits)
        terms, slopes = (torch.where(positive, on_p, on_1mp) for on_p, on_1mp in
                         ((logs.nl_p, logs.nl_1mp), (logs.d_nl_p, logs.d_nl_1mp)))
        large, threshold = self.selected(logits, logs.nl_1mp, unobserved)
        terms = self.modify(terms, large, threshold, logs.nl_p, logs.nl_1mp, index)
        return reduced(terms, self.modify_slopes(slopes, large, logs.d_nl_p))


@register
class LargeLossReject(_LargeLoss):
    """LL-R: the selected large losses become 0; they still count in the B*C denominator."""

    name = "ll_r"
    display_name = "LL-R"
    observed_negative = "nl(1-p); never rejected"
    description = "large-loss rejection: the ceil(B*C*(t-1)*delta) largest unobserved losses are set to 0"

    def modify(self, terms, large, threshold, nl_p, nl_1mp, index):
        # not masked_fill, whose output is contiguous: the mean over another layout sums in another order
        return torch.where(large, self.zero(terms), terms)

    def modify_slopes(self, slopes, large, d_nl_p):
        # one op (torch.where(large, 0.0, slopes) makes its 0 a tensor first); the same values in another layout,
        # which the heads' gradient copies exactly
        return slopes.masked_fill(large, 0.0)


@register
class LargeLossCorrectTemporary(_LargeLoss):
    """LL-Ct: the selected entries take the positive-target term nl(p) for this step only."""

    name = "ll_ct"
    display_name = "LL-Ct"
    observed_negative = "nl(1-p); never corrected"
    description = "large-loss temporary correction: the largest unobserved losses use nl(p) for this step"

    def modify(self, terms, large, threshold, nl_p, nl_1mp, index):
        return torch.where(large, nl_p, terms)

    def modify_slopes(self, slopes, large, d_nl_p):
        return torch.where(large, d_nl_p, slopes)


@register
class LargeLossCorrectPermanent(_LargeLoss):
    """LL-Cp: `m = ceil(B*C*delta)` from epoch 2; corrected as LL-Ct, and the entries strictly above the
    threshold become observed positives of their training row for the rest of training (per head).

    This is the paper's intent; the authors' public code never reaches this branch and behaves as LL-Ct.
    The stored labels (buffer `corrected_observed`, `[K, N_train, C]`) supersede the `observed` argument.
    """

    name = "ll_cp"
    display_name = "LL-Cp"
    observed_negative = "nl(1-p); never corrected"
    description = "large-loss permanent correction: the ceil(B*C*delta) largest unobserved losses become positives"
    state = "corrected_observed [K, N_train, C]: observed labels plus permanent corrections"
    row_buffers = ("corrected_observed",)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.register_buffer("corrected_observed", self.train_observed.unsqueeze(0).repeat(self.num_heads, 1, 1))

    def count(self, num_entries: int, delta: float, epoch: int) -> int:
        if self.fidelity is Fidelity.AUTHORS:  # the authors' code never reaches its LL-Cp branch: LL-Ct's count
            return super().count(num_entries, delta, epoch)
        if epoch < 2:
            return 0
        return math.ceil(round(num_entries * delta, 6))

    def targets(self, logits, observed, index):
        rows = rows_for_heads(self.corrected_observed, index, logits)
        return rows == 1, rows == 0

    def modify(self, terms, large, threshold, nl_p, nl_1mp, index):
        if self.fidelity is Fidelity.AUTHORS:  # ... and corrects nothing for good: LL-Ct, as its code runs
            return torch.where(large, nl_p, terms)
        permanent = large & (detached(nl_1mp) > threshold)
        with torch.no_grad():
            rows = rows_for_heads(self.corrected_observed, index, nl_1mp)
            rows = torch.where(permanent, torch.ones_like(rows), rows)
            if nl_1mp.dim() == 2:
                self.corrected_observed[0, index] = rows
            else:
                self.corrected_observed[:, index] = rows
        return torch.where(large, nl_p, terms)

    def modify_slopes(self, slopes, large, d_nl_p):  # as LL-Ct in both modes: what modify returns
        return torch.where(large, d_nl_p, slopes)
