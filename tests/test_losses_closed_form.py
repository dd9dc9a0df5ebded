"""Closed-form gradients (`Loss.loss_and_grad`, `penalty_and_grad`): each against autograd of the loss's own
`forward` (`penalty`), in float64, within 1e-6 relative entry by entry: on random logits, saturated ones (|x| 30
and 200, where p rounds to 0 or 1), ties (every logit alike), an observed matrix of all positives and one of none,
in both fidelities and every epoch's phase (pseudo-labels, rejections, corrections), with per-head values."""

import pytest
import torch

from spml_cache import losses

N_TRAIN, C, K, EPOCHS = 29, 6, 2, 3
RTOL = 1e-6
# every phase within EPOCHS (as tests/test_losses_graph_safe.py), and a few rejections per batch
PHASES = {"em_apl": {"warmup": 1}, "opml_sp": {"warmup": 1}, "ll_r": {"delta": 0.05}, "ll_ct": {"delta": 0.05},
          "ll_cp": {"delta": 0.05}}
CLOSED = [name for name in losses.names() if losses.get(name).closed_form()]
PENALISED = [name for name in losses.names() if losses.get(name).closed_form_penalty()]


def problem(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    labels = (torch.rand(N_TRAIN, C, generator=generator) < 0.4).to(torch.uint8)
    positive = torch.randint(0, C, (N_TRAIN,), generator=generator)
    labels[torch.arange(N_TRAIN), positive] = 1
    observed = torch.zeros(N_TRAIN, C, dtype=torch.int8)
    observed[torch.arange(N_TRAIN), positive] = 1
    observed[(labels == 0) & (torch.rand(N_TRAIN, C, generator=generator) < 0.2)] = -1
    return labels, observed, torch.rand(N_TRAIN, C, generator=generator) * 0.3


LABELS, OBSERVED, SIMILARITY = problem()


def build(name: str, fidelity: str, per_head: bool, observed=OBSERVED) -> losses.Loss:
    hparams = dict(PHASES.get(name, {}))
    if losses.get(name).needs_similarity:
        hparams["train_similarity"] = SIMILARITY
    if per_head:  # a second value for every per-head key: the loss then holds them as [K, 1, 1] tensors
        resolved = losses.build(name, num_classes=C, dataset="voc", train_observed=observed, **hparams).hparams
        hparams.update({key: [resolved[key], resolved[key] * 0.5 if resolved[key] else 0.5]
                        for key in losses.get(name).per_head})
    loss = losses.build(name, num_classes=C, dataset="voc", num_heads=K, train_observed=observed, seed=[0, 1],
                        fidelity=fidelity, **hparams)
    return loss.double()


def logit_cases(size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    random = torch.randn(K, size, C, generator=generator, dtype=torch.float64) * 3
    signs = torch.where(torch.rand(K, size, C, generator=generator) < 0.5, -1.0, 1.0).double()
    return {"random": random, "saturated 30": signs * 30, "saturated 200": signs * 200,
            "mixed": torch.where(random.abs() > 3, signs * 40, random), "ties": torch.full_like(random, 0.7)}


def compare(name: str, loss: losses.Loss, logits: torch.Tensor, rows: torch.Tensor, observed: torch.Tensor,
            what: str) -> None:
    kept = {key: value.clone() for key, value in loss.state_dict().items()}
    z = logits.clone().requires_grad_()
    labels = LABELS.index_select(0, rows) if loss.oracle else None
    expected = loss(z, observed, labels=labels, index=rows)
    (expected_grad,) = torch.autograd.grad(expected.sum(), z)
    after = {key: value.clone() for key, value in loss.state_dict().items()}
    loss.load_state_dict(kept)
    value, grad, *row_grads = loss.loss_and_grad(logits.clone(), observed, labels=labels, index=rows)
    assert not value.requires_grad and not grad.requires_grad, f"{name}: the closed form built an autograd graph"
    torch.testing.assert_close(value, expected.detach(), rtol=RTOL, atol=0, msg=lambda m: f"{name}, {what}: {m}")
    if row_grads:  # per-row parameters (role's theta): their rows' gradients, autograd's of the whole parameter
        params = dict(loss.named_parameters())
        assert set(row_grads[0]) == set(params) == set(type(loss).row_params)
        wrt = [z] + list(params.values())
        expected_grads = torch.autograd.grad(loss(*wrt[:1], observed, labels=labels, index=rows).sum(), wrt)
        loss.load_state_dict(kept)
        for key, whole in zip(params, expected_grads[1:]):
            torch.testing.assert_close(row_grads[0][key], whole[:, rows], rtol=RTOL, atol=0,
                                       msg=lambda m: f"{name} {key}'s gradient, {what}: {m}")
            assert not whole.index_fill(1, rows, 0.0).any()  # nothing outside the batch's rows
    # Where autograd's gradient is NaN (asl in authors mode at p = 1: a torch.where's unchosen branch has the slope
    # 0 * inf there, which its backward multiplies by 0), the closed form, which chooses first, need not be.
    finite = ~expected_grad.isnan()
    torch.testing.assert_close(grad[finite], expected_grad[finite], rtol=RTOL, atol=0,
                               msg=lambda m: f"{name} gradient, {what}: {m}")
    for key, value in loss.state_dict().items():  # a loss that writes state (ll_cp) writes the same
        assert torch.equal(value, after[key]), f"{name}, {what}: the closed form left {key} otherwise than forward"


@pytest.mark.parametrize("fidelity", ["exact", "authors"])
@pytest.mark.parametrize("per_head", [False, True], ids=["", "per-head"])
@pytest.mark.parametrize("name", CLOSED)
def test_the_closed_form_is_autograd_of_forward(name, per_head, fidelity):
    if per_head and not losses.get(name).per_head:
        pytest.skip("no per-head hyperparameter")
    loss = build(name, fidelity, per_head)
    generator = torch.Generator().manual_seed(1)
    for epoch in range(1, EPOCHS + 1):
        train_logits = torch.randn(K, N_TRAIN, C, generator=generator, dtype=torch.float64) * 2
        loss.start_epoch(epoch, EPOCHS, train_logits if loss.needs_train_logits else None)
        for size in (8, 5):
            rows = torch.randperm(N_TRAIN, generator=generator)[:size]
            for case, logits in logit_cases(size, generator).items():
                compare(name, loss, logits, rows, OBSERVED.index_select(0, rows), f"epoch {epoch}, {case}, B {size}")


@pytest.mark.parametrize("observed_value", [0, 1], ids=["none observed", "all positive"])
@pytest.mark.parametrize("name", CLOSED)
def test_the_closed_form_holds_when_every_label_is_alike(name, observed_value):
    observed = torch.full((N_TRAIN, C), observed_value, dtype=torch.int8)
    loss = build(name, "exact", False, observed)
    generator = torch.Generator().manual_seed(2)
    for epoch in (1, 2):
        loss.start_epoch(epoch, EPOCHS, torch.randn(K, N_TRAIN, C, generator=generator, dtype=torch.float64)
                         if loss.needs_train_logits else None)
        rows = torch.randperm(N_TRAIN, generator=generator)[:8]
        for case, logits in logit_cases(8, generator).items():
            compare(name, loss, logits, rows, observed.index_select(0, rows), f"epoch {epoch}, {case}")


@pytest.mark.parametrize("per_head", [False, True], ids=["", "per-head"])
@pytest.mark.parametrize("name", PENALISED)
def test_the_closed_form_penalty_is_autograd_of_penalty(name, per_head):
    loss = build(name, "exact", per_head)
    weight = torch.randn(K, 7, C, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    weight[0, 0, 0] = 0.0  # |w| at 0: autograd's sign is 0 there
    z = weight.clone().requires_grad_()
    (expected_grad,) = torch.autograd.grad(loss.penalty(z).sum(), z)
    value, grad = loss.penalty_and_grad(weight)
    torch.testing.assert_close(value, loss.penalty(weight), rtol=RTOL, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=RTOL, atol=0)


@pytest.mark.parametrize("name", losses.names())
def test_a_built_in_states_its_closed_form_or_says_why_it_has_none(name):
    """Stage two trains a built-in by autograd only where the class says why (`no_closed_form`); a closed form lost
    by accident (a subclass's `forward`, an `equation` overridden by a `forward`) fails here."""
    cls = losses.get(name)
    assert cls.closed_form() != bool(cls.no_closed_form), (name, cls.no_closed_form)


def test_the_weight_penalties_state_their_closed_form():
    assert PENALISED == [name for name in losses.names() if losses.get(name).penalises_weight] == ["l1r", "l2r"]


def test_a_subclass_that_rewrites_forward_alone_trains_by_autograd():
    class Doubled(losses.get("an")):
        name = "doubled_an"

        def forward(self, logits, observed, *, labels=None, index=None):
            return 2 * super().forward(logits, observed)

    class Restated(Doubled):
        name = "restated_an"

        def loss_and_grad(self, logits, observed, *, labels=None, index=None):
            value, grad = super().loss_and_grad(logits, observed)
            return 2 * value, 2 * grad

    assert losses.get("an").closed_form() and not Doubled.closed_form() and Restated.closed_form()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_mean_over_entries_is_their_sum_divided_by_their_count_bit_for_bit(dtype):
    """`mean_over_entries` is one op (torch's mean), the sum over (B, C) then a division by B*C on the CPU: the same
    bits as the two ops it replaced, on the logits' layout (`HeadMatrix.__call__`'s [K, B, C] view of [B, K*C]), a
    contiguous one and values of many magnitudes (the vector width of the sum's kernel, ATEN_CPU_CAPABILITY, must
    not matter: the sum is the same kernel either way)."""
    generator = torch.Generator().manual_seed(0)
    for heads, rows, classes in [(4, 8, 20), (3, 33, 80), (1, 7, 3), (2, 64, 1000)]:
        flat = torch.randn(rows, heads * classes, generator=generator, dtype=dtype)
        flat *= 10.0 ** torch.randint(-4, 5, (rows, 1), generator=generator)
        for terms in (flat.as_strided((heads, rows, classes), (classes, heads * classes, 1)),
                      flat.view(rows, heads, classes).transpose(0, 1).contiguous()):
            reference = terms.sum(dim=(-2, -1)) / (rows * classes)
            assert torch.equal(losses.base.mean_over_entries(terms), reference)
