"""Stacked heads and the stacked Adam against torch's own nn.Linear and torch.optim.Adam."""

import pytest
import torch
from trace_support import record

from spml_cache.linear.adam import StackedAdam, fused_adam_available
from spml_cache.linear.head_matrix import HeadMatrix, rows_of

LRS = [1e-1, 1e-2, 1e-3]


def test_each_head_starts_as_nn_linear_under_its_seed():
    heads = HeadMatrix(7, 3, seeds=[5, 9, 5], lrs=LRS)
    for k, seed in enumerate([5, 9, 5]):
        torch.manual_seed(seed)
        reference = torch.nn.Linear(7, 3)
        # stored divided by the head's lr: equal up to the rounding of that division
        torch.testing.assert_close(heads.linear_state(k)["weight"], reference.weight.detach(), rtol=1e-6, atol=0)
        torch.testing.assert_close(heads.linear_state(k)["bias"], reference.bias.detach(), rtol=1e-6, atol=0)
    x = torch.randn(4, 7)
    torch.testing.assert_close(heads(x)[1], reference_logits(heads, 1, x))
    torch.testing.assert_close(heads.logits(x, chunk_rows=3), heads(x))
    # a training batch's features with a ones column last: the bias in the same product, the same logits
    torch.testing.assert_close(heads(torch.cat([x, torch.ones(4, 1)], dim=1)), heads(x))
    torch.testing.assert_close(heads.weight[2], heads.linear_state(2)["weight"].T)


def reference_logits(heads, k, x):
    state = heads.linear_state(k)
    return x @ state["weight"].T + state["bias"]


def train_heads_and_reference(fused, steps=15, stop=None, penalty=False, ones_column=False):
    """Three heads at three lrs, trained by `HeadMatrix.step` from the logits' gradient, and the same three
    heads as `nn.Linear` + `torch.optim.Adam` each; `stop=(head, step)` stops that head before that step.
    `ones_column`: the heads see each batch as training does, `[B, D + 1]` with a ones column last (the bias's
    gradient from the same product as the weight's)."""
    generator = torch.Generator().manual_seed(0)
    heads = HeadMatrix(6, 4, seeds=[1, 2, 1], lrs=LRS, fused=fused)
    alone = []
    for seed, lr in zip([1, 2, 1], LRS):
        torch.manual_seed(seed)
        linear = torch.nn.Linear(6, 4)
        alone.append((linear, torch.optim.Adam(linear.parameters(), lr=lr)))
    for step in range(steps):
        x = torch.randn(5, 6, generator=generator)
        target = torch.randn(3, 5, 4, generator=generator)
        active = None
        if stop is not None and step >= stop[1]:
            active = torch.tensor([k != stop[0] for k in range(3)])
        seen = torch.cat([x, torch.ones(len(x), 1)], dim=1) if ones_column else x
        logits = heads(seen).requires_grad_()
        weight = heads.weight.requires_grad_()
        value = (((logits - target) ** 2) * (1 + logits.abs())).sum()
        value = value + (weight.abs().sum() if penalty else 0.0)
        grad_logits, grad_weight = torch.autograd.grad(value, [logits, weight], allow_unused=True)
        heads.step(seen, grad_logits, grad_weight if penalty else None, heads.frozen_columns(active))
        for k, (linear, optimiser) in enumerate(alone):
            if active is not None and not active[k]:
                continue
            out = linear(x)
            loss = (((out - target[k]) ** 2) * (1 + out.abs())).sum() + (linear.weight.abs().sum() if penalty else 0.0)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    return heads, [linear for linear, _ in alone]


@pytest.mark.parametrize("ones_column", [False, True], ids=["", "ones column"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("penalty", [False, True])
def test_stacked_heads_train_as_torch_adam_per_head(fused, penalty, ones_column):
    if fused and not fused_adam_available(torch.device("cpu")):
        pytest.skip("no fused Adam kernel on the CPU in this torch")
    heads, alone = train_heads_and_reference(fused, penalty=penalty, ones_column=ones_column)
    for k, linear in enumerate(alone):
        state = heads.linear_state(k)
        assert not torch.allclose(state["weight"], heads_at_start(k), atol=1e-3)  # it moved
        torch.testing.assert_close(state["weight"], linear.weight.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state["bias"], linear.bias.detach(), rtol=1e-5, atol=1e-6)


def heads_at_start(k):
    return HeadMatrix(6, 4, seeds=[1, 2, 1], lrs=LRS).linear_state(k)["weight"]


@pytest.mark.parametrize("fused", [True, False])
def test_a_stopped_head_keeps_its_weights_while_the_others_train(fused):
    if fused and not fused_adam_available(torch.device("cpu")):
        pytest.skip("no fused Adam kernel on the CPU in this torch")
    stopped_early, alone = train_heads_and_reference(fused, steps=12, stop=(1, 5))
    at_stop, _ = train_heads_and_reference(fused, steps=5)
    torch.testing.assert_close(stopped_early.linear_state(1)["weight"], at_stop.linear_state(1)["weight"], rtol=0, atol=0)
    for k in (0, 2):
        torch.testing.assert_close(stopped_early.linear_state(k)["weight"], alone[k].weight.detach(), rtol=1e-5, atol=1e-6)


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
    # the lazy replay is exact up to float32 rounding (tests/test_theta_exact.py bounds it at ROLE's scale)
    torch.testing.assert_close(per_step, dense, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(per_epoch, dense, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(epoch_adam.slots[0].exp_avg, dense_adam.slots[0].exp_avg, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(epoch_adam.slots[0].exp_avg_sq, dense_adam.slots[0].exp_avg_sq, rtol=1e-4, atol=1e-8)


@pytest.mark.skipif(not fused_adam_available(torch.device("cpu")), reason="no fused Adam kernel on the CPU in this torch")
def test_a_stacked_adam_step_reads_nothing_on_the_host():
    """What a captured step runs (linear/graphs.py): the fused kernel, a dense parameter and ROLE-like lazy rows, a
    head stopped. No `.item()`, `.cpu()`, `bool()` of a tensor, nor a kernel that reads one on the host."""
    generator = torch.Generator().manual_seed(2)
    dense = torch.randn(3, 4, 2, generator=generator).requires_grad_()
    theta = torch.randn(3, 10, 2, generator=generator).requires_grad_()
    adam = StackedAdam(LRS, fused=True)
    adam.add_param(dense)
    adam.add_param(theta, lr_mult=10.0, lazy_rows=True)
    active = torch.tensor([True, False, True])
    rows = torch.tensor([1, 5, 7])

    def step():
        adam.zero_grad()
        (dense.sum() + theta[:, rows].square().sum()).backward()
        adam.step(active, rows)

    step()  # the eager warm-up, as before a capture: it may make what later steps reuse
    adam.advance_rows(rows, adam.steps, active)  # between epochs: stops the head for the lazy rows (syncs allowed)
    _, recorder = record(step)
    assert recorder.forbidden == []
    assert adam.slots[1].last[rows].tolist() == [2, 2, 2]  # the rows know the step they are up to date with


def test_fused_adam_is_found_by_running_it_and_graphs_say_when_they_are_off(monkeypatch):
    from spml_cache.linear import adam_kernel, graphs

    def missing(*args, **kwargs):
        raise NotImplementedError("_fused_adam_ has no kernel for this backend")

    adam_kernel._fused_adam_runs.cache_clear()
    try:
        assert adam_kernel.fused_adam_available("cpu") == hasattr(torch, "_fused_adam_")  # the real kernel runs here
        adam_kernel._fused_adam_runs.cache_clear()
        monkeypatch.setattr(torch, "_fused_adam_", missing)
        assert not adam_kernel.fused_adam_available("cpu")
    finally:
        adam_kernel._fused_adam_runs.cache_clear()  # the next caller tries the real kernel again
    monkeypatch.setattr(graphs, "fused_adam_available", lambda device: False)  # a GPU whose torch lacks the kernel
    with pytest.warns(UserWarning, match=r"^linear: CUDA graphs are off: torch .*'s fused Adam kernel does not run on"
                                         r" cuda; every stack trains eagerly, one after another \(slower"):
        assert not graphs.graphs_available(torch.device("cuda"))
    assert not graphs.graphs_available(torch.device("cpu"))  # the CPU never trains in graphs: nothing to say


@pytest.mark.parametrize("fused", [True, False])
def test_weight_decay_is_torch_adams_on_the_weight_alone(fused):
    """Heads at (lr, wd) pairs in one matrix against each head alone: nn.Linear and torch.optim.Adam with
    weight_decay on the weight and none on the bias (the probe's intercept is not penalised)."""
    if fused and not fused_adam_available(torch.device("cpu")):
        pytest.skip("no fused Adam kernel on the CPU in this torch")
    lrs, wds = [1e-1, 1e-1, 1e-2, 1e-2], [0.0, 0.5, 0.0, 3.0]
    heads = HeadMatrix(6, 4, seeds=[1] * 4, lrs=lrs, wds=wds, fused=fused)
    plain = HeadMatrix(6, 4, seeds=[1] * 4, lrs=lrs, fused=fused)  # the same heads without decay
    alone = []
    for lr, wd in zip(lrs, wds):
        torch.manual_seed(1)
        linear = torch.nn.Linear(6, 4)
        groups = [{"params": [linear.weight], "weight_decay": wd}, {"params": [linear.bias], "weight_decay": 0.0}]
        alone.append((linear, torch.optim.Adam(groups, lr=lr)))
    generator = torch.Generator().manual_seed(0)
    for _ in range(12):
        x, target = torch.randn(5, 6, generator=generator), torch.randn(5, 4, generator=generator)
        for matrix in (heads, plain):
            logits = matrix(x).requires_grad_()
            (grad,) = torch.autograd.grad(((logits - target) ** 2).sum(), [logits])
            matrix.step(x, grad)
        for linear, optimiser in alone:
            optimiser.zero_grad()
            ((linear(x) - target) ** 2).sum().backward()
            optimiser.step()
    for k, (linear, _) in enumerate(alone):
        torch.testing.assert_close(heads.linear_state(k)["weight"], linear.weight.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(heads.linear_state(k)["bias"], linear.bias.detach(), rtol=1e-5, atol=1e-6)
        decayed = not torch.allclose(heads.linear_state(k)["weight"], plain.linear_state(k)["weight"], atol=1e-4)
        assert decayed == bool(wds[k])  # the decay changed exactly the heads that have one


def test_the_logits_gradient_is_read_as_the_heads_columns_without_a_copy_when_it_keeps_their_layout():
    heads = HeadMatrix(5, 3, seeds=[1, 2], lrs=LRS[:2])
    logits = heads(torch.randn(4, 5))
    slope = torch.sigmoid(logits) - 0.5  # elementwise: the logits' memory layout, [B, K*C] underneath
    assert rows_of(slope).data_ptr() == slope.data_ptr()
    expected = slope.transpose(0, 1).reshape(4, -1)
    assert torch.equal(rows_of(slope), expected)
    contiguous = slope.contiguous()  # another layout: copied into the heads' columns, the same values
    assert contiguous.stride() != slope.stride() and torch.equal(rows_of(contiguous), expected)
