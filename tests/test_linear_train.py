"""Stage two's trainer: a head in a stack is the head trained alone, and both are the plain PyTorch recipe.

The reference here restates the linear regime the simple way: `torch.manual_seed(seed); nn.Linear(D, C)`,
`torch.optim.Adam` (the loss's parameters at lr_mult x lr), batches cut from `torch.randperm` drawn per epoch
from a generator seeded with the seed, last partial batch kept, sklearn AP on val after every epoch.
"""

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score

from linear_support import reordering_step, write_synthetic_cache
from spml_cache import cache, losses
from spml_cache.linear import engine
from spml_cache.linear.engine import LinearData, SeedGrid, SeedRun

EPOCHS = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    # 45 training rows: batch 8 ends with 5 rows, batch 16 with 13 (one full batch-8 chunk and the 5)
    path = write_synthetic_cache(tmp_path_factory.mktemp("cache") / "voc-resnet50-448.h5", train=45, val=24, test=30)
    return LinearData.from_features(cache.load(path), torch.device("cpu"))


def sklearn_map(scores: np.ndarray, labels: np.ndarray) -> float:
    return 100 * float(np.mean([average_precision_score(labels[:, c], scores[:, c]) for c in range(labels.shape[1])]))


def train_alone_with_torch(data, name, lr, batch_size, seed, wd=0.0):
    """The reference recipe for one head; returns (val mAP per epoch, head state, loss state). `wd`: Adam's
    weight decay on the head's weight (not its bias)."""
    features, observed = data.train_features, data.train_observed
    torch.manual_seed(seed)
    head = torch.nn.Linear(features.shape[1], data.num_classes)
    loss = losses.build(name, num_classes=data.num_classes, dataset="voc", num_heads=1,
                        train_observed=observed, seed=seed)
    groups = [{"params": [head.weight], "lr": lr, "weight_decay": wd}, {"params": [head.bias], "lr": lr}]
    groups += [{"params": [p], "lr": lr * p.lr_mult} for p in loss.parameters()]
    optimiser = torch.optim.Adam(groups)
    generator = torch.Generator().manual_seed(seed)
    orders = [torch.randperm(len(features), generator=generator) for _ in range(EPOCHS)]
    val_maps = []
    for epoch in range(1, EPOCHS + 1):
        with torch.no_grad():
            train_logits = head(features) if loss.needs_train_logits else None
        loss.start_epoch(epoch, EPOCHS, train_logits)
        order = orders[epoch - 1]
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            labels = data.train_labels[rows] if loss.oracle else None
            value = loss(head(features[rows]), observed[rows], labels=labels, index=rows)
            optimiser.zero_grad()
            value.backward()
            optimiser.step()
        with torch.no_grad():
            scores = torch.sigmoid(head(data.eval_features[: data.num_val])).numpy()
        val_maps.append(sklearn_map(scores, data.val_targets.numpy()))
    return val_maps, head, loss


def train_stacked(data, name, lrs, batch_sizes, seed=0):
    run = SeedRun(name, {}, seed, SeedGrid(lrs, batch_sizes, EPOCHS), data)
    for epoch in range(1, EPOCHS + 1):
        run.run_epoch(epoch)
    return run


def head_of(run, lr, batch_size):
    """(heads, loss, index) of the head with this config in a SeedRun."""
    for stack in run.stacks:
        if stack.batch_size == batch_size:
            return stack.heads, stack.loss, [r.lr for r in stack.records].index(lr)
    raise KeyError((lr, batch_size))


@pytest.mark.parametrize("name", ["an", "role"])
def test_a_stacked_head_is_the_plain_pytorch_recipe(data, name):
    run = train_stacked(data, name, [1e-2, 1e-3], [8, 16], seed=3)
    for lr, batch_size in [(1e-2, 16), (1e-3, 8)]:
        val_maps, head, loss = train_alone_with_torch(data, name, lr, batch_size, seed=3)
        heads, stacked_loss, k = head_of(run, lr, batch_size)
        state = heads.linear_state(k)
        torch.testing.assert_close(state["weight"], head.weight.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state["bias"], head.bias.detach(), rtol=1e-4, atol=1e-5)
        for key, value in loss.state_dict().items():
            # ROLE's theta goes through the lazy Adam, whose replays are exact to float32 rounding
            # (tests/test_theta_exact.py): here within ~1e-6 on logits of size ~5
            torch.testing.assert_close(stacked_loss.head_state_dict(k)[key], value, rtol=1e-4, atol=1e-5)
        record = next(r for r in run.records if (r.lr, r.batch_size) == (lr, batch_size))
        np.testing.assert_allclose(record.val_map, val_maps, atol=1e-3)


@pytest.mark.parametrize("name", ["an", "role", "epr", "opml_sp"])
def test_a_head_in_a_stack_equals_the_head_alone(data, name):
    """Stack of 3 lrs x batch (8, 16) vs one head alone: the batch-16 head shares the batch-8 stream exactly,
    for batch-coupled losses (epr's batch mean, opml_sp's log det over the batch) and stateful ones too.

    Not bit for bit: a stack of 3 runs its ops on [3, B, C] tensors, the head alone on [1, B, C], and ATen's
    vector kernels round a tensor's last elements otherwise (linear_support.reordering_step). So the heads agree
    to float32 rounding accumulated over the ~20 steps (rtol 1e-5, atol 1e-6: a few ulp a step), and their val
    mAPs to 1e-4 points, below the 1.5e-3 that reordering two val scores would move them: the same rankings,
    hence the same best epochs."""
    assert 1e-4 < reordering_step(data.num_val, data.num_classes)
    stacked = train_stacked(data, name, [1e-2, 1e-3, 1e-4], [8, 16])
    for lr, batch_size in [(1e-3, 16), (1e-2, 8)]:
        alone = train_stacked(data, name, [lr], [batch_size])
        heads, loss, k = head_of(stacked, lr, batch_size)
        single_heads, single_loss, _ = head_of(alone, lr, batch_size)
        for key in ("weight", "bias"):
            torch.testing.assert_close(heads.linear_state(k)[key], single_heads.linear_state(0)[key], rtol=1e-5, atol=1e-6)
        for key, value in single_loss.head_state_dict(0).items():
            torch.testing.assert_close(loss.head_state_dict(k)[key], value, rtol=1e-5, atol=1e-6)
        mine = next(r for r in stacked.records if (r.lr, r.batch_size) == (lr, batch_size))
        np.testing.assert_allclose(mine.val_map, alone.records[0].val_map, atol=1e-4)
        assert mine.best_epoch == alone.records[0].best_epoch


@pytest.mark.parametrize("name", ["an", "role"])
def test_weight_decay_heads_share_the_stack_and_are_torch_adam_with_weight_decay(data, name):
    """`--wd`: one head per (lr, wd) in the stack of each batch size, each the plain recipe with
    torch.optim.Adam(weight_decay=wd) on the head's weight; a wd of 0 is the head without decay."""
    wds = [0.0, 0.3, 3.0]
    run = SeedRun(name, {}, 3, SeedGrid([1e-2, 1e-3], [8, 16], EPOCHS, wds), data)
    assert [stack.num_heads for stack in run.stacks] == [6, 6]
    assert [(r.lr, r.wd) for r in run.stacks[0].records] == [(lr, wd) for lr in (1e-2, 1e-3) for wd in wds]
    for epoch in range(1, EPOCHS + 1):
        run.run_epoch(epoch)
    plain = train_stacked(data, name, [1e-2], [16], seed=3)
    for lr, batch_size, wd in [(1e-2, 16, 3.0), (1e-3, 8, 0.3), (1e-2, 16, 0.0)]:
        val_maps, head, _ = train_alone_with_torch(data, name, lr, batch_size, seed=3, wd=wd)
        stack = next(stack for stack in run.stacks if stack.batch_size == batch_size)
        k = [(r.lr, r.wd) for r in stack.records].index((lr, wd))
        torch.testing.assert_close(stack.heads.linear_state(k)["weight"], head.weight.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(stack.heads.linear_state(k)["bias"], head.bias.detach(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(stack.records[k].val_map, val_maps, atol=1e-3)
        unchanged = torch.allclose(stack.heads.linear_state(k)["weight"],
                                   plain.stacks[0].heads.linear_state(0)["weight"], rtol=1e-5, atol=1e-6)
        assert unchanged == (wd == 0.0 and lr == 1e-2)  # a wd of 0 is the head of a grid without the axis


def test_batch_order_depends_on_seed_and_epoch_only(data):
    first = SeedRun("an", {}, 0, SeedGrid([1e-3], [8], EPOCHS), data).permutations
    other_grid = SeedRun("an", {}, 0, SeedGrid([1e-2, 1e-4], [16, 4], EPOCHS), data).permutations
    other_seed = SeedRun("an", {}, 1, SeedGrid([1e-3], [8], EPOCHS), data).permutations
    assert torch.equal(first, other_grid)
    assert not torch.equal(first, other_seed)
    assert not torch.equal(first[0], first[1])
    assert all(torch.equal(torch.sort(order).values, torch.arange(data.num_train)) for order in first)


def test_a_heads_scores_do_not_depend_on_the_stacks_scored_with_it(data, monkeypatch):
    """A job of one batch size (worker processes, torchrun, --resume) scores its stack alone, an in-process job
    with the others: the scores are the same bits. (ATen's AVX2 / AVX-512 kernels leave the last elements of a
    tensor to a scalar loop whose sigmoid rounds differently in ~4% of values, so the stacks' logits are not
    sigmoided as one tensor.)"""
    scored, average_precision = [], engine.average_precision
    monkeypatch.setattr(engine, "average_precision", lambda scores, *rest: scored.append(scores.clone())
                        or average_precision(scores, *rest))
    lrs = [1e-2, 1e-3]
    for batch_sizes in ([4, 8], [4]):  # the batch-4 stack first among two, then alone (its last rows: the tail)
        SeedRun("an", {}, 0, SeedGrid(lrs, batch_sizes, 1), data).run_epoch(1)
    together, alone = scored[:2], scored[2:]
    for mine, theirs in zip(together, alone):  # val, then test
        assert torch.equal(mine[: len(lrs)], theirs)
