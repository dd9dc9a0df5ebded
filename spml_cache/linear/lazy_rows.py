"""Lazy rows for `StackedAdam` (adam.py): the zero-gradient Adam steps that a row of a per-training-row parameter
(ROLE's `theta [K, N_train, C]`) missed, replayed exactly before anything reads the row.

Dense Adam moves every row at every step with its decaying momentum; a lazy parameter updates only the batch's rows
and replays the rest here, eps included: per entry a short series in sqrt(v) whose coefficients are float64 sums
over the missed steps, truncation and remainder below 2^-30 of the move (`Replay.replay`), so the lazy parameter is
dense `torch.optim.Adam` up to float32 rounding. With ROLE-sized gradients, whose sqrt(v) runs from below eps to far
above it (tests/test_theta_exact.py), lazy theta stays within 1.5 E u (peak + path) of float64 dense Adam (u =
2^-24, E epochs, peak the entry's largest |value|, path how far Adam moves it on |g|), closer than float32
`torch.optim.Adam` itself gets (up to 0.11 T u (peak + path) over T steps); its moments within 3 E u. (Dropping eps
from the replayed steps, as an earlier version did, moved entries whose sqrt(v) is near eps by up to whole steps:
docs/fidelity.md.)
"""

from __future__ import annotations

import math

import torch

from spml_cache.linear.adam_kernel import BETA1, BETA2, scalar_dtype

# The replay's truncation and series remainder, relative to the first replayed step of an entry (and so to the whole
# drift), are bounded by this: 2^-30, 1/64 of float32's unit roundoff.
REPLAY_TOL = 2.0**-30
SERIES_LEVELS = (4, 8, 16, 32, 64, 128)  # series lengths a block of rows is rounded up to (beyond: step by step)
REPLAY_BLOCK_ROWS = 2048  # rows replayed at once: bounds the [K, rows, C] temporaries


def replay_steps(beta1: float = BETA1, beta2: float = BETA2, tol: float = REPLAY_TOL) -> int:
    """How many momentum-only steps after a row's last gradient a replay sums: the j-th moves an entry by at
    most r^(j-1) / sqrt(1 - beta2) times the first (r = beta1 / sqrt(beta2)), so the steps beyond sum to below
    `tol` of the first (254 for Adam's betas)."""
    ratio = beta1 / beta2**0.5
    if not 0 < ratio < 1:
        raise ValueError(f"lazy rows need beta1^2 < beta2 (momentum that dies out), got betas ({beta1}, {beta2})")
    return math.ceil(math.log(tol * (1 - ratio) * (1 - beta2) ** 0.5) / math.log(ratio))


class Replay:
    """The zero-gradient steps of Adam with `betas` and `eps` that a lazy parameter's rows missed, summed in closed
    form (`replay`) into the parameter and moments of a `StackedAdam` slot (`param`, `exp_avg`, `exp_avg_sq`, the
    per-head `lr` and `last[row]`, the step each row is up to date with)."""

    def __init__(self, betas: tuple[float, float], eps: float) -> None:
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.steps = replay_steps(self.beta1, self.beta2)  # how many missed steps a replay sums at most

    def replay(self, slot, rows: torch.Tensor, upto: torch.Tensor, halt: torch.Tensor, stopped: bool) -> None:
        """The s = upto - last momentum-only steps of each row (per head: up to the step it stopped at), exactly.

        With w = sqrt(v0) and a_j, b_j of `StackedAdam.advance_rows`, the drift is m0 * S, S = sum_{j<=s} a_j / (b_j w + eps).
        Around a centre c per start step L: b_j w + eps = d (1 + delta_j z), d = c w + eps, z = c w / d in
        [0, 1), delta_j = b_j / c - 1, so S = (1/d) sum_n mu_n z^n with mu_n = sum_{j<=s} a_j (-delta_j)^n (per
        start step and s, cumulative sums over j in float64): one division and a short Horner polynomial per
        entry (in the parameter's dtype) instead of s divisions. The series converges for every w where all
        |delta_j| < 1; `_series_plan` picks its length so that the remainder is below REPLAY_TOL of the first
        step (rows it cannot bound within SERIES_LEVELS terms are summed step by step), and the sum stops after
        `replay_steps` steps, whose tail is below REPLAY_TOL too: both far below float32 rounding. (Stopping at
        160 steps, as before, raised the worst error by up to 0.15 E u (peak + path), within rounding, on 640 rows
        at batch 2 and lrs 1e-1 .. 1e-4 (the measure of tests/test_theta_exact.py); at 120 steps, to ~20 E u.)
        """
        last = slot.last[rows]
        skipped = (torch.minimum(upto, halt.view(-1, 1)) - last).clamp_(min=0)  # [K, R]
        slot.last[rows] = torch.maximum(last, upto)
        # Rows never stepped (last 0) have zero moments: nothing to replay.
        work = ((last > 0) & (skipped > 0).any(dim=0)).nonzero().squeeze(1)
        if work.numel() == 0:
            return
        rows, skipped = rows[work], skipped[:, work]
        starts, start_of_row = torch.unique(last[work], return_inverse=True)
        a, b = self._terms(starts)
        center, degree = self._series_plan(a, b, slot.param.dtype)
        # Rows in blocks of one series length (rounded up to a power of two), by start step.
        level = torch.bucketize(degree, torch.tensor(SERIES_LEVELS, device=degree.device))[start_of_row]
        order = torch.argsort(level * len(starts) + start_of_row)
        counts = torch.unique_consecutive(level[order], return_counts=True)[1].tolist()
        first = 0
        for count in counts:
            for block in range(first, first + count, REPLAY_BLOCK_ROWS):
                picked = order[block : min(block + REPLAY_BLOCK_ROWS, first + count)]
                self._block(slot, rows[picked], start_of_row[picked], skipped[:, picked], (a, b, center, degree),
                            stopped)
            first += count

    def _block(self, slot, rows: torch.Tensor, start_of_row: torch.Tensor, skipped: torch.Tensor, plan: tuple,
               stopped: bool) -> None:
        """Replay one block of rows whose series share a length: `plan` is (a, b, centre, degree) per start step."""
        a, b, center, degree = plan
        used, start_of_row = torch.unique(start_of_row, return_inverse=True)
        a, b, center, n = a[used], b[used], center[used], int(degree[used].max())
        param = slot.param
        exp_avg, exp_avg_sq = slot.exp_avg.index_select(1, rows), slot.exp_avg_sq.index_select(1, rows)
        entry = (1,) * (param.dim() - 2)
        skipped = skipped.view(skipped.shape + entry)  # [K, R, 1]: per head and row
        steps = skipped.clamp(max=self.steps)  # the steps summed: those beyond move no float32 value
        lr = slot.lr.view((-1,) + (1,) * (param.dim() - 1))
        if n <= SERIES_LEVELS[-1]:
            table = self._moment_table(a, b, center, n)  # [U, J + 1, n + 1]
            coefficients = table[start_of_row.view(1, -1), steps.view(steps.shape[:2])]  # [K, R, n + 1]
            coefficients = (coefficients * -slot.lr.view(-1, 1, 1)).to(param.dtype)
            step = self._series_step(exp_avg, exp_avg_sq, center[start_of_row].to(param.dtype).view((1, -1) + entry),
                                     coefficients)
        else:
            step = self._exact_step(exp_avg, exp_avg_sq, a[start_of_row], b[start_of_row], steps, -lr)
        if stopped:
            # A head with no step to replay (a stopped one) keeps its rows as they are, NaN moments included.
            step = torch.where(skipped > 0, step, 0.0)
        param.index_add_(1, rows, step)
        skipped = skipped.to(lr.dtype)
        exp_avg.mul_((self.beta1**skipped).to(exp_avg.dtype))
        exp_avg_sq.mul_((self.beta2**skipped).to(exp_avg_sq.dtype))
        slot.exp_avg.index_copy_(1, rows, exp_avg)
        slot.exp_avg_sq.index_copy_(1, rows, exp_avg_sq)

    def _terms(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """a_j and b_j (`StackedAdam.advance_rows`) for j = 1 .. `replay_steps` after each start step: `[U, J]` each."""
        dtype = scalar_dtype(starts.device)
        j = torch.arange(1, self.steps + 1, dtype=dtype, device=starts.device)
        start = starts.to(dtype).unsqueeze(1)
        beta1_j, beta2_j = self.beta1**j, self.beta2**j
        a = beta1_j / (1 - self.beta1**start * beta1_j)
        b = beta2_j.sqrt() / torch.sqrt(1 - self.beta2**start * beta2_j)
        return a, b

    def _series_plan(self, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per start step: the centre c (the a-weighted mean of the b_j, rounded to `dtype` so that the entries
        see the same c as the coefficients) and the number of series terms n after which the remainder is below
        REPLAY_TOL of the first replayed step, for any w and any s: |remainder| <= (1/d) sum_j a_j
        |delta_j|^(n+1) / min(1, 1 + delta_j), and the first step >= (1/d) a_1 / (1 + max(delta_1, 0)). For Adam's
        betas n is 64 one step in, 11 at 100, 7 at 286 and 5 from ~1000 steps on."""
        center = ((a * b).sum(dim=1) / a.sum(dim=1)).to(dtype).to(a.dtype)
        delta = b / center.unsqueeze(1) - 1
        size = delta.abs()
        remainder = a / (1 + delta.clamp(max=0)) * size  # its sum over j bounds the remainder after n = 0 terms
        bound = REPLAY_TOL * a[:, 0] / (1 + delta[:, 0].clamp(min=0))
        degree = torch.full(center.shape, SERIES_LEVELS[-1] + 1, dtype=torch.long, device=center.device)
        pending = torch.arange(len(center), device=center.device)
        for n in range(SERIES_LEVELS[-1] + 1):
            done = remainder.sum(dim=1) <= bound
            degree[pending] = torch.where(done, degree[pending].clamp(max=n), degree[pending])
            if bool(done.all()):
                break
            if 2 * int(done.sum()) >= len(done):  # drop the start steps done once they are half of those left
                pending, remainder, size, bound = pending[~done], remainder[~done], size[~done], bound[~done]
            remainder.mul_(size)
        return center, degree

    def _moment_table(self, a: torch.Tensor, b: torch.Tensor, center: torch.Tensor, degree: int) -> torch.Tensor:
        """mu_n for s = 0 .. J skipped steps: `[U, J + 1, degree + 1]`, cumulative over the steps."""
        terms = torch.empty(a.shape + (degree + 1,), dtype=a.dtype, device=a.device)
        terms[..., 0] = a
        if degree:
            ratio = 1 - b / center.unsqueeze(1)  # -delta_j
            torch.cumprod(ratio.unsqueeze(2).expand(a.shape + (degree,)), dim=2, out=terms[..., 1:])
            terms[..., 1:] *= a.unsqueeze(2)
        table = torch.empty(len(a), self.steps + 1, degree + 1, dtype=a.dtype, device=a.device)
        table[:, 0] = 0
        torch.cumsum(terms, dim=1, out=table[:, 1:])
        return table

    def _series_step(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, center: torch.Tensor,
                     coefficients: torch.Tensor) -> torch.Tensor:
        """The replayed step of every entry, m0 * (1/d) sum_n coefficient_n z^n (Horner; `_replay`), the head's
        -lr already in the coefficients."""
        scaled = exp_avg_sq.sqrt().mul_(center)  # c w
        denom = scaled + self.eps  # d
        z = scaled.div_(denom)
        columns = [column.view(coefficients.shape[:2] + (1,) * (exp_avg.dim() - 2)) for column in coefficients.unbind(2)]
        n = len(columns) - 1
        if n == 0:
            total = columns[0] * exp_avg
        else:
            total = torch.addcmul(columns[n - 1], z, columns[n])
            for column in reversed(columns[: n - 1]):
                torch.addcmul(column, total, z, out=total)
            total.mul_(exp_avg)
        return total.div_(denom)

    def _exact_step(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    steps: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The replayed step summed step by step in float64 (betas whose series would be too long here)."""
        shape = (1, -1) + (1,) * (exp_avg.dim() - 2)
        w = exp_avg_sq.to(a.dtype).sqrt()
        total = torch.zeros_like(w)
        for j in range(int(steps.max())):
            term = a[:, j].view(shape) / (b[:, j].view(shape) * w + self.eps)
            total += torch.where(steps > j, term, 0.0)
        return total.mul_(exp_avg.to(a.dtype)).mul_(scale).to(exp_avg.dtype)
