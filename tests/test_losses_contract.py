"""The contract of docs/internals.md "losses", checked on EVERY registered loss, and `spml-cache losses`."""

import copy
import io
import json
import os
import re

import pytest
import torch
from cli_support import run_cli, run_main

from spml_cache import losses
from spml_cache.runtime.errors import SpmlError

N, C, B, K, EPOCHS = 8, 5, 4, 3, 6
DATASETS = {"voc", "coco", "nus", "cub"}


def make_data():
    generator = torch.Generator().manual_seed(0)
    labels = (torch.rand(N, C, generator=generator) < 0.4).to(torch.uint8)
    labels[torch.arange(N - 1), torch.arange(N - 1) % C] = 1  # every row but the last has a positive
    labels[N - 1] = 0  # a training image without any positive (NUS-WIDE has them): no observed label
    observed = torch.zeros(N, C, dtype=torch.int8)
    observed[torch.arange(N - 1), torch.arange(N - 1) % C] = 1
    train_logits = torch.randn(EPOCHS, K, N, C, generator=generator, dtype=torch.float64)
    batch_logits = torch.randn(K, B, C, generator=generator, dtype=torch.float64)
    return labels, observed, train_logits, batch_logits


LABELS, OBSERVED, TRAIN_LOGITS, BATCH_LOGITS = make_data()
INDEX = torch.tensor([1, 3, 6, 7])


def text_side(name, rows, classes):
    """A stand-in for the cache's text side, for the losses that need one: fixed image-text similarities."""
    if not losses.get(name).needs_similarity:
        return {}
    return {"train_similarity": torch.rand(rows, classes, generator=torch.Generator().manual_seed(1)) * 0.3}


def build(name, num_heads=1, **kwargs):
    kwargs.setdefault("dataset", "voc")
    return losses.build(name, num_classes=C, num_heads=num_heads, train_observed=OBSERVED, seed=0,
                        **text_side(name, N, C), **kwargs)


def advance(loss, heads):
    """Run the epoch hooks through a short schedule, with these heads' logits where the loss asks for them."""
    for epoch in range(1, EPOCHS + 1):
        train_logits = TRAIN_LOGITS[epoch - 1, heads] if loss.needs_train_logits else None
        loss.start_epoch(epoch, EPOCHS, train_logits)


def call(loss, logits, index=INDEX):
    return loss(logits, OBSERVED[index], labels=LABELS[index], index=index)


ALL = losses.names()


def test_registry_holds_every_family():
    expected = {"bce", "bce_ls", "iun", "an", "an_ls", "an_ls_neg", "wan", "l1r", "l2r", "entmin", "pr", "epr"}
    expected |= {"role", "em", "em_apl"}
    assert expected <= set(ALL)
    assert len(ALL) == len(set(ALL))


@pytest.mark.parametrize("name", ALL)
def test_metadata(name):
    cls = losses.get(name)
    assert cls.name == name
    assert cls.description and "\n" not in cls.description
    assert re.search(r"et al\.|, [A-Z][a-z]+ and [A-Z]", cls.reference), "the reference names the paper's authors"
    assert not re.search(r"seed 00|seeds/|spec/", cls.reference), "the reference cites what a user can find"
    assert re.search(r"Eq\.|Table|Sec\.|Algorithm|appendix", cls.reference), "and the equation, table or section"
    assert isinstance(cls.state, str)
    assert all(isinstance(flag, bool) for flag in (cls.oracle, cls.needs_train_logits, cls.reconstructed))
    assert set(cls.dataset_defaults) <= DATASETS
    for values in cls.dataset_defaults.values():
        assert set(values) <= set(cls.defaults)
    assert all(cls.derived.get(key) for key, value in cls.defaults.items() if value is None)


@pytest.mark.parametrize("name", ALL)
def test_builds_for_every_dataset_with_resolved_hparams(name):
    observed = torch.zeros(N, 40, dtype=torch.int8)  # 40 classes: room for CUB's k = 31.4
    observed[torch.arange(N), torch.arange(N)] = 1
    for dataset in DATASETS:
        loss = losses.build(name, num_classes=40, dataset=dataset, train_observed=observed,
                            **text_side(name, N, 40))
        assert set(loss.hparams) == set(loss.defaults)
        assert all(value is not None for value in loss.hparams.values())
        for key, value in loss.dataset_defaults.get(dataset, {}).items():
            assert loss.hparams[key] == value


def test_unknown_loss_lists_the_valid_names():
    with pytest.raises(SpmlError) as err:
        losses.build("an-ls", num_classes=C)
    assert "an-ls" in str(err.value) and all(name in str(err.value) for name in ALL)


@pytest.mark.parametrize("name", ALL)
def test_unknown_hyperparameter_lists_the_valid_ones(name):
    with pytest.raises(SpmlError) as err:
        build(name, not_a_knob=1.0)
    message = str(err.value)
    assert "not_a_knob" in message and name in message
    assert all(key in message for key in losses.get(name).defaults)


@pytest.mark.parametrize("name", ALL)
def test_shapes_and_stacked_heads_equal_separate_heads(name):
    stacked = build(name, num_heads=K)
    advance(stacked, list(range(K)))
    alone = []
    for head in range(K):
        loss = build(name)
        advance(loss, [head])
        alone.append(loss)
    # two batches, so that state a loss writes during forward is exercised too
    for index in (INDEX, torch.tensor([0, 2, 3, 5])):
        values = call(stacked, BATCH_LOGITS, index)
        assert values.shape == (K,)
        for head, loss in enumerate(alone):
            value = call(loss, BATCH_LOGITS[head], index)
            assert value.shape == ()
            torch.testing.assert_close(values[head], value.to(values.dtype), rtol=1e-5, atol=1e-6)
    weight = torch.randn(K, 3, C)
    penalties = torch.as_tensor(stacked.penalty(weight)).expand(K)  # a loss without a penalty returns 0.0
    for head, loss in enumerate(alone):
        assert float(loss.penalty(weight[head])) == pytest.approx(float(penalties[head]), rel=1e-5)
        for key, value in stacked.head_state_dict(head).items():
            torch.testing.assert_close(value, loss.state_dict()[key])


# Losses whose gradient is by design not the derivative of their value: some terms see a detached input.
# gradcheck must fail on them (the stop-gradient is live); their own tests pin the gradient in closed form.
STOP_GRADIENT = {
    "role": "cross_q = BCE(q, stopgrad(p)) moves with the logits in value only",
    "gr": "k(p) and v(p) are computed from the detached p",
    "gpr": "GR's k(p) and v(p), and the pseudo-positives' weight 1 - clip(v), from the detached p",
}


@pytest.mark.parametrize("name", ALL)
def test_gradcheck_float64(name):
    loss = build(name, num_heads=1).double()
    advance(loss, [0])
    logits = BATCH_LOGITS[0].clone().requires_grad_(True)

    def value(x):  # a fresh copy each time where a loss keeps state: some update it in forward
        return call(copy.deepcopy(loss) if loss.state else loss, x)

    torch.manual_seed(0)  # fast mode checks random projections of the Jacobian: keep them the same every run
    matches = torch.autograd.gradcheck(
        value, (logits,), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True, raise_exception=False
    )
    assert matches == (name not in STOP_GRADIENT), STOP_GRADIENT.get(name, "gradient != derivative of the value")


@pytest.mark.parametrize("name", ALL)
def test_finite_at_extreme_logits_and_with_observed_negatives(name):
    loss = build(name)
    advance(loss, [0])
    row = torch.tensor([30.0, -30.0, 0.0, 80.0, -80.0])
    logits = torch.stack([row, -row, 0.5 * row, 2 * row]).requires_grad_(True)
    observed = OBSERVED[INDEX].clone()
    observed[0, 1] = -1  # the partial-label setting: one observed negative
    value = loss(logits, observed, labels=LABELS[INDEX], index=INDEX)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("name", [name for name in ALL if losses.get(name).oracle])
def test_oracles_refuse_to_run_without_labels(name):
    with pytest.raises(SpmlError, match="labels"):
        build(name)(BATCH_LOGITS[0], OBSERVED[INDEX], index=INDEX)


@pytest.mark.parametrize("name", [name for name in ALL if losses.get(name).state])
def test_stateful_losses_need_train_observed_and_index(name):
    with pytest.raises(SpmlError, match="train_observed"):
        losses.build(name, num_classes=C, dataset="voc")
    with pytest.raises(SpmlError, match="index"):
        build(name)(BATCH_LOGITS[0], OBSERVED[INDEX], labels=LABELS[INDEX])


@pytest.mark.parametrize("name", ALL)
def test_state_dict_round_trip_with_weights_only(name):
    trained = build(name)
    advance(trained, [1])
    call(trained, BATCH_LOGITS[1])
    buffer = io.BytesIO()
    torch.save(trained.state_dict(), buffer)
    buffer.seek(0)
    fresh = build(name)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    for loss in (fresh, trained):  # schedules kept outside the state follow the epoch hook
        loss.start_epoch(EPOCHS, EPOCHS, TRAIN_LOGITS[EPOCHS - 1, [1]] if loss.needs_train_logits else None)
    index = torch.tensor([0, 4, 5, 7])
    torch.testing.assert_close(call(fresh, BATCH_LOGITS[2], index), call(trained, BATCH_LOGITS[2], index))
    for parameter in trained.parameters():
        assert getattr(parameter, "lr_mult", None), "trainable loss state carries its learning-rate multiplier"


def test_cli_losses_table_lists_every_loss(tmp_path):
    result = run_cli("losses", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for name in ALL:
        assert re.search(rf"│ {re.escape(name)}\s+│", result.stdout), name
    assert "Cole et al., CVPR 2021" in result.stdout and "1/(C-1)" in result.stdout and "voc: alpha=0.2" in result.stdout


def test_cli_losses_names_shows_just_those(tmp_path, monkeypatch, capsys):
    result = run_cli("losses", "role", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    shown = [name for name in ALL if re.search(rf"│ {re.escape(name)}\s+│", result.stdout)]
    assert shown == ["role"] and "1 loss" in result.stdout
    result = run_cli("losses", "wan,an", "role", "--json", cwd=tmp_path)  # apart, or comma-separated as --loss
    assert [row["name"] for row in json.loads(result.stdout)] == ["wan", "an", "role"]
    code, err = run_main("losses", "role", "rolee", cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    (line,) = err.strip().splitlines()
    assert code == 1 and line.startswith("error: unknown loss 'rolee' (did you mean role?)"), line


def test_cli_losses_json(tmp_path):
    result = run_cli("losses", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [row["name"] for row in rows] == ALL
    by_name = {row["name"]: row for row in rows}
    assert by_name["wan"]["defaults"] == {"gamma": "1/(C-1)"}
    assert by_name["em_apl"]["dataset_defaults"]["cub"] == {"alpha": 0.01, "beta": 0.4, "warmup": 3}
    assert by_name["em_apl"]["needs_train_logits"] is True and by_name["bce"]["oracle"] is True
    assert "theta" in by_name["role"]["state"]
    for row in rows:
        assert set(row) == {
            "name", "display_name", "description", "reference", "defaults", "dataset_defaults", "state", "oracle",
            "needs_train_logits", "reconstructed", "needs_similarity", "authors", "paper_grid", "per_head",
            "observed_negative", "origin", "error",
        }
        assert row["origin"] is None and row["error"] is None  # a built-in loss: no plugin origin, and it loads
    assert by_name["vlpl"]["needs_similarity"] is True and by_name["crisp"]["needs_similarity"] is False
    assert [by_name[name]["display_name"] for name in ("an_ls", "em_apl", "ll_r", "opml_sp")] == [
        "AN-LS", "EM+APL", "LL-R", "OPML-SP"]
    assert by_name["ll_r"]["paper_grid"]["values"] == {"delta": [0.001, 0.002, 0.003, 0.004, 0.005]}
    assert "issue 8" in by_name["ll_r"]["paper_grid"]["source"] and by_name["an"]["paper_grid"] is None
    assert by_name["gr"]["authors"] == {"log_eps": 1e-7, "early_stop": ["drop", 2.0], "drop_last": False,
                                        "defaults": {"wT": 2.0, "bT": -2.0}}
    assert list(os.listdir(tmp_path)) == []  # printing writes nothing


SWEPT = [name for name in ALL if losses.get(name).per_head]


def other_valid_value(loss_cls, key, value):
    """A second value of `key` inside its bounds (and of k inside (0, C])."""
    param = loss_cls.constraints().get(key)
    low, high = (param.low, param.high) if param is not None else (float("-inf"), float("inf"))
    candidate = value * 0.5 if value not in (None, 0) else 0.5
    return min(max(candidate, low + 1e-3 if low > float("-inf") else candidate), high - 1e-3 if high < 1e9 else candidate)


@pytest.mark.parametrize("name", SWEPT)
def test_heads_with_their_own_hyperparameters_equal_separate_losses(name):
    """A sweep trains heads that differ only in a hyperparameter in one stack: each head of the stacked loss is
    the loss built with that head's values (every per-head key at once, through the epoch hooks)."""
    cls = losses.get(name)
    base = build(name).hparams
    values = {key: [base[key], other_valid_value(cls, key, base[key]), base[key]] for key in cls.per_head}
    stacked = build(name, num_heads=K, **values)
    advance(stacked, list(range(K)))
    for head in range(K):
        alone = build(name, **{key: vals[head] for key, vals in values.items()})
        advance(alone, [head])
        for index in (INDEX, torch.tensor([0, 2, 3, 5])):
            got, want = call(stacked, BATCH_LOGITS, index)[head], call(alone, BATCH_LOGITS[head], index)
            torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-6)
        weight = torch.randn(K, 3, C, generator=torch.Generator().manual_seed(head))
        penalty = torch.as_tensor(stacked.penalty(weight)).expand(K)[head]
        assert float(alone.penalty(weight[head])) == pytest.approx(float(penalty), rel=1e-5)


def test_a_value_outside_its_range_or_a_per_head_key_that_is_not_one_is_refused():
    with pytest.raises(SpmlError, match=r"--hp ll_r.delta=1.5: outside its valid range \(0, 1\)"):
        build("ll_r", delta=1.5)
    with pytest.raises(SpmlError, match="warmup cannot take one value per head"):
        build("em_apl", num_heads=2, warmup=[3, 4])
