"""The graph-safe contract of docs/internals.md ("Graph-safe steps"), checked on EVERY registered loss.

Stage two may run a loss's training step as a captured CUDA graph, replayed in every epoch. A graph keeps what
the Python code computed while it was captured: the ops, their non-tensor arguments, the shapes, the branches
taken and the memory each tensor was read from. So, recording each aten op of a step (forward, penalty and the
gradient) in every epoch, for a full and a partial batch:

1. no op synchronises with the host or makes a tensor from Python data;
2. a step of a given shape records the same trace in every epoch, epoch 1 included, and reads its state from
   the same memory;
3. every parameter, buffer and tensor attribute of the loss keeps its storage and shape (updated in place);
4. the declarations `row_params`, `row_buffers` and `penalises_weight` say what the step touches.

The first step of each batch shape is an eager warm-up, as before any capture: a loss may make its buffers
there (the large-loss family's per-shape counts).
"""

import pytest
import torch
from trace_support import first_difference, record

from spml_cache import losses

# N_TRAIN differs from every other size, so that a dimension of size N_TRAIN is a per-training-row dimension
N_TRAIN, C, K, D, EPOCHS = 37, 5, 2, 3, 3
BATCHES = {"full": 8, "partial": 5}

# hyperparameters that start every phase of a loss in epoch 2 (the large losses and splc's switch do by default)
# and make it do something: pseudo-labels and corrections after one epoch, a few rejections per batch
PHASES = {
    "em_apl": {"warmup": 1},
    "opml_sp": {"warmup": 1},
    "ll_r": {"delta": 0.05},
    "ll_ct": {"delta": 0.05},
    "ll_cp": {"delta": 0.05},
}

def make_data():
    generator = torch.Generator().manual_seed(0)
    labels = (torch.rand(N_TRAIN, C, generator=generator) < 0.4).to(torch.uint8)
    positive = torch.randint(0, C, (N_TRAIN,), generator=generator)
    labels[torch.arange(N_TRAIN), positive] = 1
    observed = torch.zeros(N_TRAIN, C, dtype=torch.int8)
    observed[torch.arange(N_TRAIN), positive] = 1
    observed[(labels == 0) & (torch.rand(N_TRAIN, C, generator=generator) < 0.1)] = -1  # a few observed negatives
    return labels, observed


LABELS, OBSERVED = make_data()


def variants():
    for name in losses.names():
        yield pytest.param(name, False, id=name)
        if losses.get(name).per_head:
            yield pytest.param(name, True, id=f"{name}-per-head")


def build(name: str, per_head: bool) -> losses.Loss:
    hparams = dict(PHASES.get(name, {}))
    if losses.get(name).needs_similarity:  # the cache's text side: fixed image-text similarities
        hparams["train_similarity"] = torch.rand(N_TRAIN, C, generator=torch.Generator().manual_seed(2)) * 0.3
    if per_head:  # a second value for every per-head key: the loss then holds them as [K, 1, 1] tensors
        resolved = losses.build(name, num_classes=C, dataset="voc", train_observed=OBSERVED, **hparams).hparams
        hparams = {**hparams, **{key: [resolved[key], resolved[key] * 0.5 if resolved[key] else 0.5]
                                 for key in losses.get(name).per_head}}
    return losses.build(name, num_classes=C, dataset="voc", num_heads=K, train_observed=OBSERVED, seed=[0, 1],
                        **hparams)


def tensors_of(loss: losses.Loss) -> dict[str, torch.Tensor]:
    """Every tensor the loss holds: parameters, buffers and plain tensor attributes."""
    held = {f"attribute {key}": value for key, value in vars(loss).items() if isinstance(value, torch.Tensor)}
    held.update({f"parameter {key}": value for key, value in loss.named_parameters()})
    held.update({f"buffer {key}": value for key, value in loss.named_buffers()})
    return held


def layout(loss: losses.Loss) -> dict[str, tuple]:
    return {key: (value.untyped_storage().data_ptr(), tuple(value.shape), value.dtype)
            for key, value in tensors_of(loss).items()}


def run_step(loss: losses.Loss, size: int, seed: int, record_it: bool):
    """One training step as HeadStack takes it: forward, the penalty on the head's weight, and the gradient
    of their sum w.r.t. the logits, the loss's parameters and the weight. Returns the recorder (or None)."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randperm(N_TRAIN, generator=generator)[:size]
    logits = torch.randn(K, size, C, generator=generator).requires_grad_()
    weight = torch.randn(K, D, C, generator=generator).requires_grad_()
    observed, labels = OBSERVED.index_select(0, rows), LABELS.index_select(0, rows)
    params = list(loss.parameters())
    inputs = {"logits": logits, "observed": observed, "labels": labels, "index": rows, "weight": weight}

    def step():
        per_head = loss(logits, observed, labels=labels if loss.oracle else None, index=rows)
        if loss.penalises_weight:
            per_head = per_head + loss.penalty(weight)
        wrt = [logits, *params] + ([weight] if loss.penalises_weight else [])
        return per_head, torch.autograd.grad(per_head.sum(), wrt, allow_unused=True)

    recorder = None
    if record_it:
        (per_head, grads), recorder = record(step, inputs, {ptr: key for key, (ptr, _, _) in layout(loss).items()})
    else:
        per_head, grads = step()
    assert per_head.shape == (K,) and torch.isfinite(per_head).all() and torch.isfinite(grads[0]).all()
    return recorder


def train_logits(loss: losses.Loss, epoch: int):
    if not loss.needs_train_logits:
        return None
    return torch.randn(K, N_TRAIN, C, generator=torch.Generator().manual_seed(1000 + epoch)) * 2


@pytest.mark.parametrize("name, per_head", list(variants()))
def test_a_step_is_graph_safe_in_every_epoch(name, per_head):
    loss = build(name, per_head)
    loss.start_epoch(1, EPOCHS, train_logits(loss, 1))
    for size in BATCHES.values():  # the eager warm-up of each shape, before any capture
        run_step(loss, size, seed=0, record_it=False)
    kept = layout(loss)
    traces: dict[str, list] = {shape: [] for shape in BATCHES}
    for epoch in range(1, EPOCHS + 1):
        if epoch > 1:
            loss.start_epoch(epoch, EPOCHS, train_logits(loss, epoch))
        assert layout(loss) == kept, f"{name}: start_epoch({epoch}) replaced a tensor instead of updating it in place"
        for shape, size in BATCHES.items():
            recorder = run_step(loss, size, seed=100 * epoch + size, record_it=True)
            assert not recorder.forbidden, f"{name}, epoch {epoch}, {shape} batch:\n" + "\n".join(recorder.forbidden)
            traces[shape].append(recorder.trace)
            assert layout(loss) == kept, f"{name}: a step of epoch {epoch} replaced a tensor instead of updating it"
    for shape, by_epoch in traces.items():
        for epoch, trace in enumerate(by_epoch[1:], start=2):
            assert trace == by_epoch[0], f"{name}, {shape} batch: epoch {epoch} differs from epoch 1\n" + first_difference(
                by_epoch[0], trace, ("epoch 1", "later"))


@pytest.mark.parametrize("name", losses.names())
def test_declarations_name_what_a_step_touches(name):
    loss = build(name, per_head=False)
    cls = type(loss)
    for key, param in loss.named_parameters():
        assert (key in cls.row_params) == (N_TRAIN in param.shape), f"{name}: row_params and parameter {key}"
        if key in cls.row_params:
            assert param.shape[:2] == (K, N_TRAIN)
    for key, buffer in loss.named_buffers():
        assert (key in cls.row_buffers) == (N_TRAIN in buffer.shape), f"{name}: row_buffers and buffer {key}"
        if key in cls.row_buffers:
            assert buffer.shape[:2] == (K, N_TRAIN)
    assert set(cls.row_params) <= dict(loss.named_parameters()).keys()
    assert set(cls.row_buffers) <= dict(loss.named_buffers()).keys()
    assert cls.penalises_weight == (cls.penalty is not losses.Loss.penalty)
