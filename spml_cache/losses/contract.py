"""`spml-cache check-loss`: the contract every built-in loss meets (docs/your-own-loss.md), checked on any loss.

Each check builds the loss on a small random problem (C classes, N training rows, one observed positive per row
and a few observed negatives) and runs steps as stage two takes them: the loss of K stacked heads, the penalty on
the head's weight, and the gradient of their sum with respect to the logits and the loss's own parameters.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import BrokenExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from spml_cache.losses.base import Loss
from spml_cache.losses.closed_form_contract import closed_step, same_as_autograd
from spml_cache.losses.loop import EpochWarning
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.step_trace import first_difference, flat, record

N_TRAIN, C, K, D, EPOCHS = 37, 5, 3, 4, 2  # N_TRAIN unlike every other size: a per-row dimension stands out
BATCHES = (8, 5)  # a full and a partial batch
DIRECTIONS = 8  # random directions the gradient is checked along
EXTREME = 30.0  # |z| of the extreme logits: sigmoid is 1 - 1e-13 there, where a naive log(1 - p) is inf
# rules drawn from the labels alone (no instance areas), each with observed negatives or unobserved positives
RULES = ("single", "uniform:pos=1,neg=2", "entry:0.3", "keep-pos:0.5", "per-class:3")
GUIDE = "docs/your-own-loss.md"


@dataclass(frozen=True)
class Problem:
    """A small training set: full labels, the observed matrix (1 / 0 / -1) and, for losses that read one, the
    image-text similarities of the rows."""

    labels: torch.Tensor  # uint8 [N, C]
    observed: torch.Tensor  # int8 [N, C]
    similarity: torch.Tensor  # float32 [N, C]


class Failed(Exception):
    """A check that did not hold: what was seen, and the fix."""


def problem(observed: torch.Tensor | None = None) -> Problem:
    generator = torch.Generator().manual_seed(0)
    labels = (torch.rand(N_TRAIN, C, generator=generator) < 0.4).to(torch.uint8)
    positive = torch.randint(0, C, (N_TRAIN,), generator=generator)
    labels[torch.arange(N_TRAIN), positive] = 1
    if observed is None:
        observed = torch.zeros(N_TRAIN, C, dtype=torch.int8)
        observed[torch.arange(N_TRAIN), positive] = 1
        observed[(labels == 0) & (torch.rand(N_TRAIN, C, generator=generator) < 0.2)] = -1
    return Problem(labels, observed, torch.rand(N_TRAIN, C, generator=generator) * 0.3)


def build(cls: type[Loss], data: Problem, *, num_heads: int = K, seed=None) -> Loss:
    seed = list(range(num_heads)) if seed is None else seed
    extra = {"train_similarity": data.similarity} if cls.needs_similarity else {}
    return cls(num_classes=C, dataset="voc", num_heads=num_heads, train_observed=data.observed, seed=seed, **extra)


def values_of(loss: Loss, data: Problem, rows: torch.Tensor, logits: torch.Tensor, weight: torch.Tensor):
    """The per-head values a step takes the gradient of: the loss, plus its penalty on the head's weight."""
    per_head = loss(logits, data.observed.index_select(0, rows),
                    labels=data.labels.index_select(0, rows) if loss.oracle else None, index=rows)
    if not isinstance(per_head, torch.Tensor):
        raise Failed(f"forward returned a {type(per_head).__name__}, not a tensor; return one value per head, a [K]"
                     " tensor computed from the logits (mean_over_entries(terms) of the [K, B, C] terms)")
    return per_head + loss.penalty(weight) if loss.penalises_weight else per_head


def step(loss: Loss, data: Problem, rows: torch.Tensor, logits: torch.Tensor, weight: torch.Tensor):
    """One training step: per-head loss values and the gradients w.r.t. the logits, parameters and weight."""
    per_head = values_of(loss, data, rows, logits, weight)
    wrt = [logits, *loss.parameters()] + ([weight] if loss.penalises_weight else [])
    grads = torch.autograd.grad(per_head.sum(), wrt, allow_unused=True) if per_head.requires_grad else ()
    return per_head, grads


def inputs(seed: int, size: int, heads: int = K, scale: float = 3.0, dtype=torch.float32):
    """A batch's rows, logits `[heads, size, C]` and head weight `[heads, D, C]`, both requiring gradients."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randperm(N_TRAIN, generator=generator)[:size]
    logits = (torch.randn(heads, size, C, generator=generator, dtype=dtype) * scale).requires_grad_()
    weight = torch.randn(heads, D, C, generator=generator, dtype=dtype).requires_grad_()
    return rows, logits, weight


def train_logits(loss: Loss, epoch: int, heads: int = K) -> torch.Tensor | None:
    if not loss.needs_train_logits:
        return None
    return torch.randn(heads, N_TRAIN, C, generator=torch.Generator().manual_seed(1000 + epoch)) * 2


def epochs_of_steps(loss: Loss, data: Problem, heads: int = K) -> Iterator[tuple]:
    """EPOCHS epochs of a full and a partial batch, the loss's epoch hooks called: each step's results."""
    for epoch in range(1, EPOCHS + 1):
        loss.start_epoch(epoch, EPOCHS, train_logits(loss, epoch, heads))
        for size in BATCHES:
            rows, logits, weight = inputs(100 * epoch + size, size, heads)
            yield (rows, logits, weight, *step(loss, data, rows, logits, weight))


def _finite(what: str, values: torch.Tensor, grads) -> None:
    if values.shape != (K,):
        raise Failed(f"{what}: returned shape {tuple(values.shape)} for logits [K={K}, B, C]; return one value per"
                     " head, e.g. mean_over_entries(terms) of the [K, B, C] terms")
    if not torch.isfinite(values).all():
        raise Failed(f"{what}: the loss is {values.tolist()}; compute it from the logits stably (neg_log_p,"
                     " neg_log_1mp, bce from spml_cache.losses.base), never log(sigmoid(z)) or log(1 - p)")
    for grad in grads:
        if grad is not None and not torch.isfinite(grad).all():
            raise Failed(f"{what}: a gradient is not finite; compute the loss from the logits stably (neg_log_p,"
                         " neg_log_1mp, bce from spml_cache.losses.base)")


def check_finite(cls: type[Loss]) -> str:
    data = problem()
    loss = build(cls, data)
    for rows, logits, weight, values, grads in epochs_of_steps(loss, data):
        _finite("random logits", values, grads)
    rows, logits, weight = inputs(7, BATCHES[0])
    signs = torch.where(logits.detach() > 0, EXTREME, -EXTREME)
    extreme = signs.clone().requires_grad_()
    _finite(f"logits at |z| = {EXTREME:g}", *step(loss, data, rows, extreme, weight))
    return f"finite values and gradients on random logits and at |z| = {EXTREME:g}, {EPOCHS} epochs"


class HeldFixed(TorchFunctionMode):
    """What a loss cuts from the gradient on purpose (a `.detach()`, a `no_grad` block, a comparison, a sort's
    indices: a result without a gradient computed from one with), recorded at the base point and replayed at the
    shifted ones: so the finite differences are those of the function autograd differentiates."""

    def __init__(self, recorded: list | None = None):
        super().__init__()
        self.replaying = recorded is not None
        self.recorded = [] if recorded is None else recorded
        self.position = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = flat((args, list((kwargs or {}).values())))
        if not any(isinstance(value, torch.Tensor) and value.requires_grad for value in given):
            return out
        if isinstance(out, torch.Tensor):
            return self._held(out)
        if isinstance(out, tuple) and out and all(isinstance(item, torch.Tensor) for item in out):
            items = [self._held(item) for item in out]
            return type(out)(items) if hasattr(out, "_fields") or type(out) is not tuple else tuple(items)
        return out

    def _held(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.requires_grad:
            return tensor
        if not self.replaying:
            self.recorded.append(tensor.clone())
            return tensor
        if self.position >= len(self.recorded):
            raise Failed("the loss runs other ops when its logits move by 1e-6; keep the ops the same for every"
                         " value of the logits (torch.where, not a Python branch on a tensor)")
        self.position += 1
        return self.recorded[self.position - 1]


def check_gradient(cls: type[Loss]) -> str:
    data = problem()
    loss = build(cls, data).double()
    loss.start_epoch(1, EPOCHS, None if not cls.needs_train_logits else train_logits(loss, 1).double())
    rows, logits, weight = inputs(3, BATCHES[0], dtype=torch.float64)
    kept = {key: value.clone() for key, value in loss.state_dict().items()}

    def value(z, recorded=None):  # from the same state each time: a loss that writes state is judged on one step
        loss.load_state_dict(kept)
        # one batch, many times over: not a new epoch begun without start_epoch (losses/loop.py)
        with HeldFixed(recorded) as mode, warnings.catch_warnings():
            warnings.simplefilter("ignore", EpochWarning)
            return values_of(loss, data, rows, z.detach().requires_grad_(), weight).sum(), mode.recorded

    with HeldFixed() as mode:
        loss.load_state_dict(kept)
        base, recorded = values_of(loss, data, rows, logits, weight).sum(), mode.recorded
    analytic = torch.autograd.grad(base, logits)[0]
    generator, eps, worst = torch.Generator().manual_seed(4), 1e-6, 0.0
    for _ in range(DIRECTIONS):  # directional derivatives along random directions: gradcheck's fast mode
        direction = torch.randn(logits.shape, generator=generator, dtype=torch.float64)
        high, low = (value(logits.detach() + sign * eps * direction, recorded)[0] for sign in (1, -1))
        numeric, exact = ((high - low) / (2 * eps)).item(), (analytic * direction).sum().item()
        worst = max(worst, abs(numeric - exact))
        if abs(numeric - exact) > 1e-7 + 1e-4 * abs(exact):
            raise Failed(f"the gradient along a random direction is {exact:.6g} but central finite differences in"
                         f" float64 give {numeric:.6g}; compute the loss with differentiable torch ops (a custom"
                         " backward must agree with forward)")
    return (f"the logits' gradient equals finite differences in float64 along {DIRECTIONS} random directions"
            f" (up to {worst:.1e})")


def check_closed_form(cls: type[Loss]) -> str:
    if not cls.closed_form():
        return "no closed form (loss_and_grad): stage two differentiates it by autograd"
    data = problem()
    loss = build(cls, data).double()
    worst = 0.0
    for epoch in range(1, EPOCHS + 1):
        every = train_logits(loss, epoch)
        loss.start_epoch(epoch, EPOCHS, None if every is None else every.double())
        for size in BATCHES:
            rows, logits, weight = inputs(100 * epoch + size, size, dtype=torch.float64)
            extreme = torch.where(logits.detach() > 0, EXTREME, -EXTREME).to(logits.dtype).requires_grad_()
            for what, z in ((f"epoch {epoch}", logits), (f"epoch {epoch}, |z| = {EXTREME:g}", extreme)):
                error, failure = same_as_autograd(loss, data, rows, z, weight, step)
                if failure:
                    raise Failed(f"{what}: {failure}")
                worst = max(worst, error)
    return f"loss_and_grad gives forward's value and autograd's gradient in float64 (up to {worst:.1e} relative)"


def check_stacked(cls: type[Loss]) -> str:
    data = problem()
    stacked = build(cls, data)
    alone = [build(cls, data, num_heads=1, seed=[head]) for head in range(K)]
    for epoch in range(1, EPOCHS + 1):
        every = train_logits(stacked, epoch)
        stacked.start_epoch(epoch, EPOCHS, every)
        for head, one in enumerate(alone):
            one.start_epoch(epoch, EPOCHS, None if every is None else every[head : head + 1])
        for size in BATCHES:
            rows, logits, weight = inputs(100 * epoch + size, size)
            values, grads = step(stacked, data, rows, logits, weight)
            for head, one in enumerate(alone):
                own = [tensor.detach()[head : head + 1].clone().requires_grad_() for tensor in (logits, weight)]
                _same_head(head, (values, grads), step(one, data, rows, *own))
    for head, one in enumerate(alone):
        for key, value in one.state_dict().items():
            if not torch.allclose(stacked.head_state_dict(head)[key], value, rtol=1e-5, atol=1e-6):
                raise Failed(f"head {head}: its state {key} stacked differs from alone; keep per-head state as"
                             " [K, ...] and update each head's slice from that head alone")
    return f"{K} stacked heads equal {K} heads trained alone (values, gradients, state over {EPOCHS} epochs)"


def _same_head(head: int, stacked: tuple, alone: tuple) -> None:
    (values, grads), (value, grads_alone) = stacked, alone
    if not torch.allclose(values[head], value.reshape(()), rtol=1e-5, atol=1e-6):
        raise Failed(f"head {head} of {K} stacked heads gets {values[head].item():.6g}, alone {value.item():.6g};"
                     " compute each head's value from its own slice of the [K, B, C] logits, reduce over (B, C)"
                     " only (mean_over_entries), and keep state with a leading head dimension")
    if not torch.allclose(grads[0][head], grads_alone[0][0], rtol=1e-4, atol=1e-6):
        raise Failed(f"head {head}: the gradient of its logits stacked differs from alone; a head's loss must not"
                     " read another head's logits")


def check_capture_safe(cls: type[Loss]) -> str:
    data = problem()
    loss = build(cls, data)
    loss.start_epoch(1, EPOCHS, train_logits(loss, 1))
    for size in BATCHES:  # the eager warm-up of each shape, before any capture
        rows, logits, weight = inputs(size, size)
        step(loss, data, rows, logits, weight)
    steps = [step] + ([closed_step] if cls.closed_form() else [])  # stage two runs the closed form's
    traces: dict[tuple, list] = {(size, way): [] for size in BATCHES for way in steps}
    for epoch in range(1, EPOCHS + 2):
        if epoch > 1:
            loss.start_epoch(epoch, EPOCHS + 1, train_logits(loss, epoch))
        for size, way in traces:
            rows, logits, weight = inputs(100 * epoch + size, size)
            _, recorder = record(lambda: way(loss, data, rows, logits, weight),
                                 {"logits": logits, "index": rows, "weight": weight},
                                 {value.untyped_storage().data_ptr(): key for key, value in loss.state_dict().items()})
            if recorder.forbidden:
                raise Failed(f"epoch {epoch}: {recorder.forbidden[0]}; a captured step cannot wait on the device or"
                             " copy from the host: no .item(), bool(tensor), torch.tensor(...), nonzero or boolean"
                             " indexing in a step (use torch.where, and buffers updated in start_epoch)")
            traces[size, way].append(recorder.trace)
    for (size, _), by_epoch in traces.items():
        for epoch, trace in enumerate(by_epoch[1:], start=2):
            if trace != by_epoch[0]:
                where = first_difference(by_epoch[0], trace, ("epoch 1", f"epoch {epoch}")).replace("\n", " ")
                raise Failed(f"a batch of {size} runs other ops in epoch {epoch} than in epoch 1 ({where}); keep"
                             " what changes between epochs in buffers updated in place (assign_) by start_epoch")
    return "capture-safe: no host sync in a step, the same ops in every epoch (what CUDA graphs replay)"


def check_deterministic(cls: type[Loss]) -> str:
    data = problem()
    first, second = (list(epochs_of_steps(build(cls, data, seed=[5, 6, 7]), data)) for _ in range(2))
    for (*_, values, grads), (*_, again, grads_again) in zip(first, second):
        same = torch.equal(values, again) and all(
            (a is None and b is None) or torch.equal(a, b) for a, b in zip(grads, grads_again))
        if not same:
            raise Failed("two builds with the same seed give different values; draw random numbers only from a"
                         " torch.Generator seeded by the loss's seed (self.seed)")
    return "deterministic under a seed (two builds, the same values and gradients)"


def check_rules(cls: type[Loss]) -> str:
    from spml_cache.observation import parse_rule

    labels = problem().labels
    for text in RULES:
        observed = torch.from_numpy(parse_rule(text).draw(labels.numpy()))
        data = problem(observed)
        if cls.needs_positive and bool(((observed == 1).sum(1) == 0).any()):
            continue  # refused by stage two as well: some row has no observed positive
        for rows, logits, weight, values, grads in epochs_of_steps(build(cls, data), data):
            _finite(f"under --observe {text}", values, grads)
    return f"finite under each observation rule's masks ({', '.join(RULES)})"


CHECKS: tuple[Callable[[type[Loss]], str], ...] = (
    check_finite, check_gradient, check_closed_form, check_stacked, check_capture_safe, check_deterministic,
    check_rules)


def run_checks(cls: type[Loss], checks: tuple[Callable[[type[Loss]], str], ...] = CHECKS
               ) -> Iterator[tuple[bool, str]]:
    """(passed, one line) per check, in order, stopping after the first failure."""
    for check in checks:
        try:
            yield True, check(cls)
        except Failed as failure:
            yield False, f"{check.__name__.removeprefix('check_')}: {failure}"
            return
        except SpmlError as err:
            yield False, f"{check.__name__.removeprefix('check_')}: {err}"
            return
        except Exception as err:  # the loss itself raised: the line says what, the fix is in the guide
            said = str(err).strip().split("\n")[0][:300]
            yield False, (f"{check.__name__.removeprefix('check_')}: the loss raised {type(err).__name__}: {said};"
                          f" see {GUIDE} for what forward receives")
            return


def training_failure(names: list[str], err: BaseException) -> str:
    """Why training `names` (one loss, or the losses of stacks trained in lockstep) failed (`err`, what it raised),
    in one line: the line check-loss gives for the first check a loss fails on a small problem (the same fault, in
    the same words), naming that loss, its file and how to check it (a built-in's: a bug to report); else what
    training raised."""
    from spml_cache import losses

    for name in names:
        failed = next((line for passed, line in run_checks(losses.get(name), (check_finite,)) if not passed), None)
        if failed is not None:
            return _failed_loss(name, failed)
    said = " ".join(str(err).split())[:300]
    raised = f"training it raised {type(err).__name__}" + (f": {said}" if said else "")
    if len(names) == 1:
        return _failed_loss(names[0], raised)
    return f"--loss {','.join(names)} (trained together) failed: {raised}; run with --debug for the traceback"


def _failed_loss(name: str, failed: str) -> str:
    from spml_cache.losses import plugins

    origin = plugins.origin(name)
    if origin is None:
        return (f"--loss {name} failed: {failed}; a bug in spml-cache's {name}: please report it with the"
                " traceback (--debug)")
    spec = origin.get("spec", name)
    return (f"--loss {name} ({origin.get('path') or spec}) failed: {failed}; fix the plugin (spml-cache check-loss"
            f" {spec} checks it on a small problem)")


class LossFailed(SpmlError):
    """A loss failed while it trained (its forward raised, returned no [K] tensor, its construction raised): one
    line naming it, its file and what went wrong (losses.contract.training_failure, check-loss's words); `names`:
    the losses that were training."""

    def __init__(self, names: list[str], err: BaseException) -> None:
        super().__init__(training_failure(names, err))
        self.names = list(names)


# What training raises that is no fault of the loss's: said as the command says it everywhere else.
NOT_THE_LOSS = (SpmlError, MemoryError, OSError, torch.OutOfMemoryError, BrokenExecutor)


@contextmanager
def loss_faults(names: list[str]):
    """Whatever else the code training `names` raises (a loss's forward, its construction, what a step makes of
    what it returned) is `LossFailed`, one line naming the loss."""
    try:
        yield
    except NOT_THE_LOSS:
        raise
    except Exception as err:
        raise LossFailed(names, err) from err
