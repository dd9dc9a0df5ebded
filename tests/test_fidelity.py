"""`--fidelity authors`: the authors' numerics (docs/fidelity.md), restated here the way their code writes them.

The reference loop below is Cole et al.'s linear regime written plainly: `nn.Linear` after `manual_seed(seed)`,
`torch.optim.Adam` (ROLE's label logits a dense parameter at 10x the lr), one permutation per epoch cut into
batches with the last partial one dropped, and every log taken as `-log(q + 1e-5)` on float32 probabilities.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
from rich.console import Console

from linear_support import write_synthetic_cache
from spml_cache import cache, losses
from spml_cache.linear import run_linear
from spml_cache.linear.engine import LinearData, SeedGrid, SeedRun

EPS = 1e-5  # Cole et al.'s LOG_EPSILON
EPOCHS = 8


def neg_log(q: torch.Tensor) -> torch.Tensor:
    return -torch.log(q + EPS)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    # 203 training rows: batch 8 leaves 3 rows out of every epoch, batch 16 leaves 11
    path = write_synthetic_cache(tmp_path_factory.mktemp("cache") / "voc-resnet50-448.h5", train=203, val=30, test=41)
    return LinearData.from_features(cache.load(path), torch.device("cpu"))


def test_an_saturates_as_the_authors_code_does():
    """Past |x| ~ 12 the authors' term stops at -log(1e-5) and its gradient is zero; the exact one does not."""
    observed = torch.tensor([[1, 0]])
    logits = torch.tensor([[-200.0, 200.0]], requires_grad=True)
    authors = losses.build("an", num_classes=2, fidelity="authors")(logits, observed)
    (grad,) = torch.autograd.grad(authors, logits)
    assert authors.item() == pytest.approx(-math.log(EPS), rel=1e-6)  # both terms capped, mean over 2 entries
    assert torch.equal(grad, torch.zeros_like(grad))
    exact = losses.build("an", num_classes=2)(logits, observed)
    (exact_grad,) = torch.autograd.grad(exact, logits)
    assert exact.item() == pytest.approx(200.0) and torch.all(exact_grad.abs() == 0.5)


@pytest.mark.parametrize("name", ["an", "role", "em", "gr"])
def test_authors_numerics_agree_with_exact_where_nothing_saturates(name):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 5, generator=generator) * 3
    observed = torch.zeros(6, 5, dtype=torch.int8)
    observed[torch.arange(6), torch.arange(6) % 5] = 1
    built = {f: losses.build(name, num_classes=5, dataset="voc", num_heads=2, train_observed=observed, fidelity=f)
             for f in ("exact", "authors")}
    values = {f: loss(logits, observed, index=torch.arange(6)) for f, loss in built.items()}
    eps = type(built["authors"]).authors_log_eps
    assert eps is not None
    torch.testing.assert_close(values["authors"], values["exact"], rtol=0, atol=50 * eps)


def reference_loop(data: LinearData, name: str, lr: float, batch_size: int, seed: int) -> torch.Tensor:
    """Cole et al.'s regime, plainly; returns the head's logits on the val and test rows."""
    features, observed = data.train_features, data.train_observed
    torch.manual_seed(seed)
    head = torch.nn.Linear(features.shape[1], data.num_classes)
    groups = [{"params": head.parameters(), "lr": lr}]
    if name == "role":
        low, high = math.log(0.4 / 0.6), math.log(0.6 / 0.4)
        theta = low + (high - low) * torch.rand(observed.shape, generator=torch.Generator().manual_seed(seed))
        theta[observed == 1] = math.log(0.995 / 0.005)
        theta = torch.nn.Parameter(theta)
        groups.append({"params": [theta], "lr": 10 * lr})
    optimiser = torch.optim.Adam(groups)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(EPOCHS):
        order = torch.randperm(len(features), generator=generator)
        for start in range(0, len(order) - batch_size + 1, batch_size):  # drop_last
            rows = order[start : start + batch_size]
            z = (observed[rows] == 1).float()
            p = torch.sigmoid(head(features[rows]))
            if name == "an":
                loss = (z * neg_log(p) + (1 - z) * neg_log(1 - p)).mean()
            else:
                q = torch.sigmoid(theta[rows])
                pos_f, pos_q = z * neg_log(p), z * neg_log(q)
                cross_f = q.detach() * neg_log(p) + (1 - q.detach()) * neg_log(1 - p)
                cross_q = p.detach() * neg_log(q) + (1 - p.detach()) * neg_log(1 - q)
                k, classes = 1.5, data.num_classes  # VOC's expected positives per image
                reg = ((p.sum(1).mean() - k) / classes) ** 2 + ((q.sum(1).mean() - k) / classes) ** 2
                loss = (0.5 * (pos_f + pos_q) + 0.5 * (cross_f + cross_q)).mean() + 0.5 * reg
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    with torch.no_grad():
        return head(data.eval_features)


@pytest.mark.parametrize("name", ["an", "role"])
def test_the_engine_in_authors_mode_is_the_authors_loop(data, name):
    """A few hundred steps (8 epochs of 25 batches): the same logits up to float rounding."""
    run = SeedRun(name, {}, 2, SeedGrid([1e-2, 1e-3], [8], EPOCHS), data, fidelity="authors")
    for epoch in range(1, EPOCHS + 1):
        run.run_epoch(epoch)
    (stack,) = run.stacks
    logits = stack.heads.logits(data.eval_features)
    for k, lr in enumerate([1e-2, 1e-3]):
        expected = reference_loop(data, name, lr, 8, seed=2)
        torch.testing.assert_close(logits[k], expected, rtol=0, atol=2e-6 * expected.abs().max().item())
    exact = SeedRun(name, {}, 2, SeedGrid([1e-2], [8], EPOCHS), data)
    for epoch in range(1, EPOCHS + 1):
        exact.run_epoch(epoch)
    # the exact mode trains the partial batch too: a different model, so the comparison above can fail
    assert not torch.allclose(exact.stacks[0].heads.logits(data.eval_features)[0], logits[0], atol=1e-3)


def test_authors_evaluation_scores_all_but_the_last_partial_batch(data):
    from spml_cache.metrics import average_precision

    run = SeedRun("an", {}, 0, SeedGrid([1e-3], [16], 1), data, fidelity="authors")
    (line,) = run.run_epoch(1)
    (stack,) = run.stacks
    scores = torch.sigmoid(stack.heads.logits(data.eval_features))[0]
    val_rows = data.num_val - data.num_val % 16  # 30 -> 16
    test_rows = len(data.test_labels) - len(data.test_labels) % 16  # 41 -> 32
    val = 100 * average_precision(scores[:val_rows], data.val_targets[:val_rows]).mean().item()
    test = 100 * average_precision(scores[data.num_val : data.num_val + test_rows], data.test_labels[:test_rows])
    assert line["val_map"] == pytest.approx(val, abs=1e-9) and line["test_map"] == pytest.approx(test.mean().item())


@pytest.mark.parametrize("name, rule", [("em", ("no_gain", 0.0)), ("gr", ("drop", 2.0)), ("ll_r", ("drop", 3.0))])
def test_each_papers_early_stopping_in_authors_mode(tmp_path, name, rule):
    """Zhou et al. stop at the first epoch without improvement, Chen et al. once val mAP falls 2 below its best,
    Kim et al. 3 below: restated on the val curve the run recorded."""
    path = write_synthetic_cache(tmp_path / "voc-resnet50-448.h5", train=60, val=20, test=20, noise=3.0)
    run = run_linear(cache=path, losses=name, lrs=[1e-1, 1e-2], batch_sizes=[4], epochs=12, fidelity="authors",
                     out=tmp_path / "runs", console=Console(file=io.StringIO()))
    assert losses.get(name).authors_early_stop == rule
    metrics = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    for lr in (1e-1, 1e-2):
        curve = [m["val_map"] for m in metrics if m["lr"] == lr]
        expected_stop = None
        for epoch in range(1, len(curve) + 1):
            best = max(curve[:epoch])
            stop = curve[epoch - 1] <= max(curve[: epoch - 1], default=-1) if rule[0] == "no_gain" else \
                best - curve[epoch - 1] > rule[1]
            if stop:
                expected_stop = epoch
                break
        config = next(c for c in run.results["losses"][name]["configs"] if c["lr"] == lr)
        assert config.get("stopped_epoch") == expected_stop
        assert len(curve) == (expected_stop or 12)  # nothing trained after the stop
        assert config["best_epoch"] == int(np.argmax(curve)) + 1
    config = json.loads((run.run_dir / "config.json").read_text())
    assert config["fidelity"] == "authors" and run.results["fidelity"] == "authors"


def test_large_loss_counts_as_kims_code_rounds():
    """Kim et al. subtract delta from a clean rate once per epoch: where B*C*(t-1)*delta is a whole number the
    float subtraction leaves a hair above it, and the ceiling is one higher (VOC, B=8, delta 0.005, epoch 6)."""
    counts = {}
    for fidelity in ("exact", "authors"):
        loss = losses.build("ll_r", num_classes=20, fidelity=fidelity, delta=0.005)
        loss.start_epoch(6, 10)
        counts[fidelity] = loss.rejection_count(8 * 20)
    assert counts == {"exact": 4, "authors": 5}
    clean_rate = 1.0
    for _ in range(5):
        clean_rate -= 0.005
    assert math.ceil(160 * (1 - clean_rate)) == 5 and 160 * 5 * 0.005 == 4.0


def test_ll_cp_in_authors_mode_is_ll_ct_as_their_code_runs():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 5, generator=generator) * 2
    observed = torch.zeros(6, 5, dtype=torch.int8)
    observed[torch.arange(6), torch.arange(6) % 5] = 1
    built = {name: losses.build(name, num_classes=5, train_observed=observed, fidelity="authors", delta=0.05)
             for name in ("ll_cp", "ll_ct")}
    for loss in built.values():
        loss.start_epoch(3, 10)
    index = torch.arange(6)
    assert torch.equal(built["ll_cp"](logits, observed, index=index), built["ll_ct"](logits, observed, index=index))
    assert torch.equal(built["ll_cp"].corrected_observed[0], observed)  # nothing corrected for good


def test_gr_without_a_dataset_takes_its_codes_defaults_in_authors_mode():
    authors, exact = (losses.build("gr", num_classes=3, fidelity=f) for f in ("authors", "exact"))
    assert (authors.wT, authors.bT) == (2.0, -2.0) and (exact.wT, exact.bT) == (10.0, -8.0)
    assert losses.build("gr", num_classes=3, dataset="coco", fidelity="authors").wT == 10.0  # Table 6 still rules


def test_asl_clamps_as_its_code_does():
    logits = torch.tensor([[-30.0, 0.0]], requires_grad=True)
    observed = torch.tensor([[1, 0]])
    value = losses.build("asl", num_classes=2, fidelity="authors")(logits, observed)
    (grad,) = torch.autograd.grad(value, logits)
    negative = 0.45**4 * -math.log(0.55)  # p = 0.5 shifted by clip 0.05, focusing gn = 4
    assert value.item() == pytest.approx((-math.log(1e-8) + negative) / 2, rel=1e-5) and grad[0, 0] == 0


def test_only_the_losses_whose_authors_drop_the_last_batch_drop_it(data):
    """Cole et al.'s loaders drop it; Zhou et al.'s (em) keep it: 203 rows in batches of 8 are 25 or 26 steps."""
    steps = {}
    for name in ("an", "em"):
        run = SeedRun(name, {}, 0, SeedGrid([1e-3], [8], 1), data, fidelity="authors")
        run.run_epoch(1)
        steps[name] = run.stacks[0].heads.steps
    assert steps == {"an": 25, "em": 26}
