"""The losses in a plain training loop of your own (docs/your-own-loop.md): a loss that changes between epochs refuses
a training call before any start_epoch and warns once when an epoch's rows pass without the next; stateful losses
that need no start_epoch train without it; `param_groups` hands a loss's own parameters over at their multiplier;
`train_logits` is every training row's logits in eval mode, as a restatement computes them."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spml_cache import losses
from spml_cache.losses import contract
from spml_cache.runtime.errors import SpmlError

B, EPOCHS = 8, 3
SCHEDULED = [name for name in losses.names() if losses.get(name).needs_start_epoch()]
STATEFUL = [name for name in losses.names() if losses.get(name).state or losses.reads_whole_observed(name)]
WARM = {"em_apl": {"warmup": 1}, "opml_sp": {"warmup": 1}}  # relabelling from epoch 2, within EPOCHS
DATA = contract.problem()  # check-loss's small problem: observed positives and negatives, similarities
LABELS, OBSERVED, SIMILARITY = DATA.labels, DATA.observed, DATA.similarity
N, C = OBSERVED.shape


def build(name: str) -> losses.Loss:
    extra = {"train_similarity": SIMILARITY} if losses.get(name).needs_similarity else {}
    return losses.build(name, num_classes=C, dataset="voc", train_observed=OBSERVED, **WARM.get(name, {}), **extra)


def plain_loop(loss: losses.Loss, epochs: int, start: str = "every epoch") -> list[float]:
    """A plain loop over a linear model on random features, with `start_epoch` before `every epoch`, the `first`
    only, or `never`: each epoch's loss."""
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(N, 7, generator=generator)
    model = torch.nn.Linear(7, C)
    optimizer = torch.optim.Adam([{"params": model.parameters(), "lr": 1e-2}] + loss.param_groups(1e-2))
    values = []
    for epoch in range(1, epochs + 1):
        if start == "every epoch" or start == "first" and epoch == 1:
            every = losses.train_logits(model, features) if loss.needs_train_logits else None
            loss.start_epoch(epoch, epochs, every)
        total = 0.0
        for index in torch.randperm(N, generator=generator).split(B):
            value = loss(model(features[index]), OBSERVED[index], labels=LABELS[index], index=index)
            optimizer.zero_grad()
            value.backward()
            optimizer.step()
            total += value.item()
        values.append(total)
    return values


@pytest.mark.parametrize("name", SCHEDULED)
def test_a_loss_that_changes_between_epochs_refuses_a_training_call_before_start_epoch(name):
    loss = build(name)
    with pytest.raises(SpmlError) as refused:
        plain_loop(loss, EPOCHS, start="never")
    message = str(refused.value)
    assert "\n" not in message and f"loss '{name}'" in message and "loss.start_epoch(epoch, num_epochs" in message
    assert ("train_logits=losses.train_logits(" in message) == loss.needs_train_logits
    with torch.no_grad():  # an evaluation is not a training call
        loss(torch.zeros(B, C), OBSERVED[:B], labels=LABELS[:B], index=torch.arange(B))


@pytest.mark.parametrize("name", SCHEDULED)
def test_a_loss_that_changes_between_epochs_trains_quietly_when_started_every_epoch(name):
    loss = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", losses.EpochWarning)
        values = plain_loop(loss, EPOCHS)
    assert len(values) == EPOCHS and all(torch.isfinite(torch.tensor(values)))
    assert loss.epoch_use.epoch == EPOCHS


@pytest.mark.parametrize("name", SCHEDULED)
def test_a_loss_started_once_warns_once_when_a_new_epoch_passes_without_start_epoch(name):
    loss = build(name)
    with pytest.warns(losses.EpochWarning) as warned:
        plain_loop(loss, EPOCHS, start="first")
    (warning,) = [w for w in warned if issubclass(w.category, losses.EpochWarning)]  # once, though two epochs passed
    message = str(warning.message)
    assert f"loss '{name}'" in message and f"more than the {N} of its training set" in message
    assert "loss.start_epoch(epoch, num_epochs" in message and warning.filename == __file__


@pytest.mark.parametrize("name", [name for name in STATEFUL if name not in SCHEDULED])
def test_a_stateful_loss_that_needs_no_start_epoch_trains_without_it(name):
    assert not losses.get(name).needs_start_epoch()
    for start in ("never", "every epoch"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", losses.EpochWarning)
            assert len(plain_loop(build(name), EPOCHS, start=start)) == EPOCHS


def test_the_losses_that_change_between_epochs_are_those_whose_class_defines_start_epoch():
    assert SCHEDULED == ["em_apl", "splc", "ll_r", "ll_ct", "ll_cp", "gr", "opml_sp", "crisp", "gpr"]

    class Counting(losses.Loss):  # a plugin's hook, and a subclass that calls it
        name = "counting"

        def equation(self, x, observed, *, labels=None, index=None):
            return x.mean(x.nl_p)

        def start_epoch(self, epoch, num_epochs, train_logits=None):
            self.seen = epoch

    class Below(Counting):
        name = "below"

        def start_epoch(self, epoch, num_epochs, train_logits=None):
            super().start_epoch(epoch, num_epochs, train_logits)

    assert not losses.get("an").needs_start_epoch() and Counting.needs_start_epoch() and Below.needs_start_epoch()
    loss = Below(num_classes=C)
    with pytest.raises(SpmlError, match="used before its first start_epoch"):
        loss(torch.zeros(B, C, requires_grad=True), OBSERVED[:B])
    loss.start_epoch(2, 4)
    assert loss.seen == 2 and loss.epoch_use.epoch == 2
    loss(torch.zeros(B, C, requires_grad=True), OBSERVED[:B])


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_check_is_bookkeeping_that_runs_no_op():
    loss = build("gr")
    loss.start_epoch(1, EPOCHS)
    logits = torch.randn(B, C, requires_grad=True)
    seen = []
    for check in (loss.epoch_use, None):
        loss.epoch_use = check
        with Ops() as recorded:
            loss(logits, OBSERVED[:B])
        seen.append(recorded.ops)
    assert seen[0] == seen[1] and seen[0]


def test_role_hands_its_label_estimates_over_at_ten_times_the_learning_rate():
    loss = build("role")
    (group,) = loss.param_groups(1e-3)
    assert group["params"] == [loss.theta] and group["lr"] == pytest.approx(1e-2) and loss.hparams["lr_mult"] == 10
    grad = torch.randn(loss.theta.shape, generator=torch.Generator().manual_seed(2))
    restated = torch.nn.Parameter(loss.theta.detach().clone())
    for param, optimizer in ((loss.theta, torch.optim.Adam(loss.param_groups(1e-3))),
                             (restated, torch.optim.Adam([restated], lr=1e-2))):
        param.grad = grad.clone()
        optimizer.step()
    assert torch.equal(loss.theta, restated)
    assert [name for name in losses.names() if losses.get(name).row_params] == ["role"]
    assert build("an").param_groups(1e-3) == [] and build("em_apl").param_groups(1e-3) == []


class SmallNet(torch.nn.Module):
    """A model whose eval mode differs from its training mode (batch norm, dropout)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                        torch.nn.Dropout(0.5), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                        torch.nn.Linear(4, C))

    def forward(self, x):
        return self.body(x)


def test_train_logits_are_every_rows_logits_in_eval_mode_as_a_restatement_computes_them():
    torch.manual_seed(3)
    model, inputs = SmallNet(), torch.randn(10, 3, 6, 6)
    model.train()
    model(inputs)  # batch-norm statistics moved away from their start
    got = losses.train_logits(model, inputs, batch_size=3)
    assert model.training and not got.requires_grad and got.dtype == torch.float32 and got.shape == (10, C)
    model.eval()
    with torch.no_grad():
        restated = torch.cat([model(inputs[row : row + 1]) for row in range(len(inputs))])
    torch.testing.assert_close(got, restated, rtol=1e-5, atol=1e-6)  # batches of 3 against batches of 1
    model.train()
    double = losses.train_logits(copy.deepcopy(model).double(), inputs.double(), batch_size=4)
    assert double.dtype == torch.float32  # float32 out, whatever the model computes in
    torch.testing.assert_close(double, restated, rtol=1e-5, atol=1e-6)
    # any callable from a batch of inputs to logits
    torch.testing.assert_close(losses.train_logits(lambda x: x.sum(dim=(2, 3)), inputs, batch_size=4),
                               inputs.sum(dim=(2, 3)))


def test_train_logits_refuse_what_cannot_be_scored():
    with pytest.raises(SpmlError, match="batch_size=0; give at least 1"):
        losses.train_logits(torch.nn.Identity(), torch.zeros(3, 2), batch_size=0)
    with pytest.raises(SpmlError, match="no inputs"):
        losses.train_logits(torch.nn.Identity(), torch.zeros(0, 2))
