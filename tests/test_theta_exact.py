"""ROLE's theta kept lazily by `StackedAdam` is dense `torch.optim.Adam` up to float32 rounding, eps included.

The gradients are ROLE's size (the 1/(B*C) reduction puts theta's near 1e-5): per entry a magnitude drawn
log-uniformly in [1e-8, 1e-4], so sqrt(v) runs from well below eps = 1e-8 to well above it, where dropping eps
from the replayed steps moved entries by up to the whole step. They land on each batch's rows only, batches cut
from one permutation per epoch; the lazy side is driven as `HeadStack` drives it (every row advanced once per
epoch to the step before its batch, a flush at the end of each epoch, a head stopped at the end of an epoch
passed as inactive from then on); the dense side is one `torch.optim.Adam` per head on a full copy, in float32
and in float64 (the exact trajectory, to ~1e-16).

Tolerances, per entry, with u = 2^-24 (float32's unit roundoff), E epochs, T steps, `peak` the largest |theta|
along the exact trajectory and `path` the distance float64 Adam moves the entry on the gradients' absolute
values (each of its steps is at least as large as the real one, so it bounds the sum of |step|):
- lazy vs float64 Adam, 4 E u (peak + path): per epoch the lazy side adds to an entry three times (the epoch's
  advance, its batch step, the flush), each add rounding by at most u/2 of |theta|, and each added step comes
  from float32 moments that carry a few u of relative rounding (the replay itself is summed in float64 to
  2^-30 relative, see `lazy_rows.REPLAY_TOL`). Seen: up to 1.5 E u (peak + path).
- lazy vs float32 Adam, (4 E + T) u (peak + path): the above plus float32 Adam's own rounding, an add at each
  of its T steps and steps whose moments drift by up to ~u/2 per step (it decays v by float32(0.999)). Seen:
  up to 0.12 (E + T) u (peak + path); float32 Adam itself is as far from float64 Adam.
- moments: 4 E u of v, and of M (Adam's first moment of |g|, which bounds |m| and what rounding m has taken)
  against float64 Adam, per epoch two replayed decays and a batch step of ~1 u each; (4 E + T) u against
  float32 Adam. Seen: up to 2.7 E u (v), 1.3 E u (m).
Dropping eps from the replay (the previous form) misses the first bound by factors of 1e6 to 1e7 here.
"""

import math

import pytest
import torch

from spml_cache.linear.adam import StackedAdam, fused_adam_available, replay_steps

U = 2.0**-24
LR_MULT = 10.0


def role_theta(num_heads, num_rows, num_classes, generator):
    """ROLE's start: logits uniform in [logit(0.4), logit(0.6)], an observed positive per row at logit(0.995)."""
    low, high = math.log(0.4 / 0.6), math.log(0.6 / 0.4)
    theta = low + (high - low) * torch.rand(num_rows, num_classes, generator=generator)
    theta[torch.arange(num_rows), torch.randint(num_classes, (num_rows,), generator=generator)] = math.log(0.995 / 0.005)
    return theta.expand(num_heads, -1, -1).contiguous()


def train(lrs, num_rows, num_classes, batch, epochs, *, stop=None, fused=None, via_grad=False, seed=0):
    """Train theta lazily and densely on the same gradients; `stop=(head, epoch)`: that head's loss "diverges" in
    that epoch (1-indexed), so it is stopped at its end, as `HeadStack.end_epoch` does."""
    generator = torch.Generator().manual_seed(seed)
    num_heads = len(lrs)
    start = role_theta(num_heads, num_rows, num_classes, generator)
    lazy = start.clone().requires_grad_(via_grad)
    adam = StackedAdam(lrs, fused=fused)
    adam.add_param(lazy, lr_mult=LR_MULT, lazy_rows=True)
    dense = {name: [start[k].to(dtype, copy=True).requires_grad_() for k in range(num_heads)]
             for name, dtype in (("32", torch.float32), ("64", torch.float64), ("abs", torch.float64))}
    optimisers = {name: [torch.optim.Adam([p], lr=LR_MULT * lr) for p, lr in zip(params, lrs)]
                  for name, params in dense.items()}
    peak = start.double().abs()
    active = torch.ones(num_heads, dtype=torch.bool)
    stopped, at_stop, steps = None, None, 0
    for epoch in range(1, epochs + 1):
        order = torch.randperm(num_rows, generator=generator)
        adam.advance_rows(order, adam.steps + torch.arange(num_rows) // batch, stopped)
        for first in range(0, num_rows, batch):
            rows = order[first : first + batch]
            scale = 10 ** torch.empty(num_heads, len(rows), num_classes).uniform_(-8, -4, generator=generator)
            grad = scale * torch.randn(num_heads, len(rows), num_classes, generator=generator)
            if via_grad:
                lazy.grad = torch.zeros_like(lazy).index_copy_(1, rows, grad)
                adam.step(stopped, rows)
            else:
                adam.step(stopped, rows, {id(lazy): grad})
            steps += 1
            for name, params in dense.items():
                for k, (param, optimiser) in enumerate(zip(params, optimisers[name])):
                    if not active[k]:
                        continue
                    param.grad = torch.zeros_like(param).index_copy_(0, rows, grad[k].to(param.dtype))
                    if name == "abs":
                        param.grad.abs_()
                    optimiser.step()
            peak = torch.maximum(peak, torch.stack([p.detach() for p in dense["64"]]).abs())
        if stop is not None and epoch == stop[1]:
            active = torch.tensor([k != stop[0] for k in range(num_heads)])
            stopped = active
        adam.flush(active)  # HeadStack.eval_logits
        if stop is not None and epoch == stop[1]:
            at_stop = [t[stop[0]].clone() for t in (lazy, adam.slots[0].exp_avg, adam.slots[0].exp_avg_sq)]

    def stacked(name, key=None):
        params = dense[name]
        if key is None:
            return torch.stack([p.detach() for p in params])
        return torch.stack([optimiser.state[p][key] for p, optimiser in zip(params, optimisers[name])])

    slot = adam.slots[0]
    return {
        "theta": lazy.detach(), "m": slot.exp_avg, "v": slot.exp_avg_sq, "start": start,
        "dense32": stacked("32"), "m32": stacked("32", "exp_avg"), "v32": stacked("32", "exp_avg_sq"),
        "dense64": stacked("64"), "m64": stacked("64", "exp_avg"), "v64": stacked("64", "exp_avg_sq"),
        "path": (stacked("abs") - start.double()).abs(), "M": stacked("abs", "exp_avg"),
        "peak": peak, "epochs": epochs, "steps": steps, "at_stop": at_stop,
    }


def assert_within(value, reference, bound, what):
    error = (value.double() - reference.double()).abs()
    excess = error - bound
    worst = int(excess.flatten().argmax())
    assert bool((excess <= 0).all()), (
        f"{what}: {int((excess > 0).sum())} entries beyond the bound, worst {error.flatten()[worst]:.3e} "
        f"against {bound.flatten()[worst]:.3e}")


def assert_dense_adam(result):
    epochs, steps = result["epochs"], result["steps"]
    scale = U * (result["peak"] + result["path"])
    # it moved, and eps matters: steps of v near eps^2 moved theta far less than eps-free steps would
    assert (result["dense64"] - result["start"].double()).abs().max() > 0.1
    assert_within(result["theta"], result["dense64"], 4 * epochs * scale, "theta vs float64 Adam")
    assert_within(result["theta"], result["dense32"], (4 * epochs + steps) * scale, "theta vs float32 Adam")
    assert_within(result["m"], result["m64"], 4 * epochs * U * result["M"], "exp_avg vs float64 Adam")
    assert_within(result["v"], result["v64"], 4 * epochs * U * result["v64"], "exp_avg_sq vs float64 Adam")
    assert_within(result["m"], result["m32"], (4 * epochs + steps) * U * result["M"], "exp_avg vs float32 Adam")
    assert_within(result["v"], result["v32"], (4 * epochs + steps) * U * result["v64"], "exp_avg_sq vs float32 Adam")


def kernels(fused):
    if fused and not fused_adam_available(torch.device("cpu")):
        pytest.skip("no fused Adam kernel on the CPU in this torch")


@pytest.mark.parametrize("fused", [True, False])
def test_rows_skipped_for_longer_than_the_replayed_steps(fused):
    """Batch 2 over 640 rows: a row waits up to ~640 steps for its next batch, beyond the replay's 254 steps."""
    kernels(fused)
    assert replay_steps() < 640
    assert_dense_adam(train([1e-2, 1e-3], 640, 20, 2, 3, fused=fused))


@pytest.mark.parametrize("fused", [True, False])
def test_voc_like_batches_at_four_learning_rates(fused):
    kernels(fused)
    assert_dense_adam(train([1e-1, 1e-2, 1e-3, 1e-4], 1000, 20, 16, 4, fused=fused, via_grad=not fused, seed=1))


@pytest.mark.parametrize("fused", [True, False])
def test_a_stopped_head_keeps_theta_and_moments_and_the_others_stay_exact(fused):
    """Head 1 stops at the end of epoch 2 (HeadStack: flushed with it inactive, then `stopped` at every step):
    dense Adam took every step of epoch 2 for it and none after; its rows keep exactly that state."""
    kernels(fused)
    result = train([1e-2, 1e-3, 1e-2], 640, 20, 4, 4, stop=(1, 2), fused=fused, seed=2)
    assert_dense_adam(result)
    for now, then in zip((result["theta"], result["m"], result["v"]), result["at_stop"]):
        assert torch.equal(now[1], then)


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.99), (0.99, 0.9999)])
def test_a_replay_is_zero_gradient_adam_step_by_step(betas):
    """One `advance_rows` from any start step over any number of skipped steps (up to 4000, past the replay's
    truncation) against float64 Adam stepped one zero gradient at a time, from states whose sqrt(v) spans
    1e-12 .. 1e-3 around eps. Also other betas: (0.99, 0.9999) needs more series terms than the series takes at
    its first steps, and sums those rows step by step. Bound, 8 u (|theta| + |move|): one float32 add to theta
    (u/2 of |theta|) and the move rounded in float32 (the float32 series evaluation: a few u of it; seen: up to
    3.6 u (|theta| + |move|) over seeds and betas); the moments decay by one rounded factor each (u), or
    underflow float32."""
    generator = torch.Generator().manual_seed(3)
    lrs, num_rows, num_classes = [1e-1, 1e-3], 600, 20
    theta = 3 * torch.randn(len(lrs), num_rows, num_classes, generator=generator)
    lazy = theta.clone()
    adam = StackedAdam(lrs, betas=betas)
    adam.add_param(lazy, lr_mult=LR_MULT, lazy_rows=True)
    start = torch.randint(1, 5000, (num_rows,), generator=generator)
    start[:40] = torch.arange(1, 41)  # the first steps, where the bias corrections spread the series most
    skipped = torch.randint(0, 4000, (num_rows,), generator=generator)
    skipped[::7] = torch.randint(0, 5, (len(skipped[::7]),), generator=generator)
    w = 10 ** torch.empty(lazy.shape).uniform_(-12, -3, generator=generator)
    slot = adam.slots[0]  # the state of rows last stepped at `start`
    slot.exp_avg.copy_(w * torch.empty(lazy.shape).uniform_(-3, 3, generator=generator))
    slot.exp_avg_sq.copy_(w * w)
    slot.last.copy_(start)
    adam.steps = int((start + skipped).max())
    param, exp_avg, exp_avg_sq = theta.double(), slot.exp_avg.double(), slot.exp_avg_sq.double()
    adam.advance_rows(torch.arange(num_rows), start + skipped)

    beta1, beta2 = betas
    lr = LR_MULT * torch.tensor(lrs, dtype=torch.float64).view(-1, 1, 1)
    for j in range(1, int(skipped.max()) + 1):
        on = (skipped >= j).view(1, -1, 1)
        t = (start + j).double().view(1, -1, 1)
        exp_avg = torch.where(on, beta1 * exp_avg, exp_avg)
        exp_avg_sq = torch.where(on, beta2 * exp_avg_sq, exp_avg_sq)
        step = lr * (exp_avg / (1 - beta1**t)) / ((exp_avg_sq / (1 - beta2**t)).sqrt() + 1e-8)
        param = torch.where(on, param - step, param)
    assert (param - theta).abs().max() > 1
    assert_within(lazy, param, 8 * U * (param.abs() + (param - theta).abs()), "theta vs step by step")
    tiny = torch.finfo(torch.float32).tiny
    assert_within(slot.exp_avg, exp_avg, 2 * U * exp_avg.abs() + tiny, "exp_avg vs step by step")
    assert_within(slot.exp_avg_sq, exp_avg_sq, 2 * U * exp_avg_sq + tiny, "exp_avg_sq vs step by step")
