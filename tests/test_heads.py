"""Stacked heads and the stacked Adam against torch's own nn.Linear and torch.optim.Adam."""

import pytest
import torch

from spml_cache.heads import StackedAdam, StackedHeads, fused_adam_available

LRS = [1e-1, 1e-2, 1e-3]


def test_each_head_starts_as_nn_linear_under_its_seed():
    heads = StackedHeads(7, 3, seeds=[5, 9, 5])
    for k, seed in enumerate([5, 9, 5]):
        torch.manual_seed(seed)
        reference = torch.nn.Linear(7, 3)
        assert torch.equal(heads.linear_state(k)["weight"], reference.weight.detach())
        assert torch.equal(heads.linear_state(k)["bias"], reference.bias.detach())
    x = torch.randn(4, 7)
    torch.testing.assert_close(heads(x)[1], reference_logits(heads, 1, x))
    torch.testing.assert_close(heads.logits(x, chunk_rows=3), heads(x).detach())


def reference_logits(heads, k, x):
    state = heads.linear_state(k)
    return x @ state["weight"].T + state["bias"]


def quadratic_loss(tensors, targets):
    """Per-head losses that give every head (and each slot of it) a different gradient."""
    return sum(((t - target) ** 2 * (1 + t.abs())).flatten(1).sum(1) for t, target in zip(tensors, targets))


@pytest.mark.parametrize("fused", [True, False])
def test_stacked_adam_equals_torch_adam_per_head(fused):
    if fused and not fused_adam_available(torch.device("cpu")):
        pytest.skip("no fused Adam kernel on the CPU in this torch")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 5, 4, generator=generator).requires_grad_()
    bias = torch.randn(3, 4, generator=generator).requires_grad_()
    extra = torch.randn(3, 6, generator=generator).requires_grad_()  # a loss parameter at 10x the lr
    adam = StackedAdam(LRS, fused=fused)
    adam.add_param(weight)
    adam.add_param(bias)
    adam.add_param(extra, lr_mult=10.0)
    alone = [[t[k].detach().clone().requires_grad_() for t in (weight, bias, extra)] for k in range(3)]
    optimisers = [
        torch.optim.Adam([{"params": p[:2], "lr": lr}, {"params": p[2:], "lr": 10 * lr}]) for p, lr in zip(alone, LRS)
    ]
    for _ in range(12):
        targets = [torch.randn(t.shape, generator=generator) for t in (weight, bias, extra)]
        adam.zero_grad()
        quadratic_loss((weight, bias, extra), targets).sum().backward()
        adam.step()
        for k, (params, optimiser) in enumerate(zip(alone, optimisers)):
            optimiser.zero_grad()
            quadratic_loss([p.unsqueeze(0) for p in params], [t[k : k + 1] for t in targets]).sum().backward()
            optimiser.step()
    for k in range(3):
        for stacked, single in zip((weight, bias, extra), alone[k]):
            torch.testing.assert_close(stacked[k], single, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_a_stopped_head_keeps_its_parameters_even_with_nan_gradients(fused):
    if fused and not fused_adam_available(torch.device("cpu")):
        pytest.skip("no fused Adam kernel on the CPU in this torch")
    weight = torch.randn(3, 4, 2).requires_grad_()
    adam = StackedAdam(LRS, fused=fused)
    adam.add_param(weight)
    adam.zero_grad()
    weight.sum().backward()
    adam.step()
    frozen = weight[1].detach().clone()
    others = weight.detach().clone()
    active = torch.tensor([True, False, True])
    for _ in range(3):
        adam.zero_grad()
        (weight * float("nan")).sum().backward()  # every gradient NaN
        weight.grad[0] = 1.0
        weight.grad[2] = -1.0
        adam.step(active)
    assert torch.equal(weight[1], frozen)
    assert torch.isfinite(weight).all()
    assert (weight[0] < others[0]).all() and (weight[2] > others[2]).all()


def test_lazy_rows_match_dense_adam():
    """ROLE's theta: only the batch's rows get gradient, but dense Adam moves every row with its momentum."""
    generator = torch.Generator().manual_seed(1)
    num_rows, batch = 40, 5
    start = torch.randn(3, num_rows, 2, generator=generator)
    dense, per_step, per_epoch = (start.clone().requires_grad_() for _ in range(3))
    optimisers = [StackedAdam(LRS), StackedAdam(LRS), StackedAdam(LRS)]
    for theta, adam, lazy in zip((dense, per_step, per_epoch), optimisers, (False, True, True)):
        adam.add_param(theta, lr_mult=10.0, lazy_rows=lazy)
    dense_adam, step_adam, epoch_adam = optimisers
    for _ in range(4):
        order = torch.randperm(num_rows, generator=generator)
        # the trainer's schedule: each row brought to the step before its batch, once per epoch
        epoch_adam.advance_rows(order, epoch_adam.steps + torch.arange(num_rows) // batch)
        for first in range(0, num_rows, batch):
            rows = order[first : first + batch]
            target = torch.randn(batch, 2, generator=generator)
            step_adam.catch_up(rows)
            for theta, adam in zip((dense, per_step, per_epoch), optimisers):
                adam.zero_grad()
                ((theta[:, rows] - target) ** 2).sum().backward()
                adam.step(rows=rows)
        epoch_adam.flush()
    step_adam.flush()
    assert not torch.allclose(dense[:, :, :], start, atol=1e-2)  # theta moved
    # the lazy replay drops eps from the momentum-only steps: equal to ~1e-5 relative
    torch.testing.assert_close(per_step, dense, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(per_epoch, dense, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(epoch_adam.slots[0].exp_avg, dense_adam.slots[0].exp_avg, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(epoch_adam.slots[0].exp_avg_sq, dense_adam.slots[0].exp_avg_sq, rtol=1e-4, atol=1e-8)
