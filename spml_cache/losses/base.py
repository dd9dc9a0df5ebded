"""The one contract every loss follows (docs/losses.md, "Notation and common rules").

A loss is a small `torch.nn.Module` whose `forward` builds the `[..., B, C]` matrix of per-entry terms and
reduces it with `mean_over_entries` (sum / (B*C)), so one learning-rate grid serves every loss; a simple loss
writes that once, as an `equation` of the blocks of `terms.Terms`, and gets `forward` and its closed-form
gradient (`loss_and_grad`) from it. Extra
trainable state (ROLE's `Theta`) is an `nn.Parameter` with an `lr_mult` attribute; per-example state that is
not trained (pseudo-labels, corrections) is a buffer. State carries a leading head dimension `K` so that the
trainer can stack heads; `logits` of shape `[B, C]` are one head.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from spml_cache.losses import loop
from spml_cache.losses.terms import Terms
# the terms every loss is written in, public here too (docs/your-own-loss.md)
from spml_cache.losses.terms import bce, entropy, mean_over_entries, neg_log_1mp, neg_log_p  # noqa: F401
from spml_cache.protocol import Fidelity  # how every loss is computed (the losses import it from here too)
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.registry import Param, Registry


def head_vector(value):
    """A hyperparameter as one value per head `[K]` where it is a per-head `[K, 1, 1]` tensor (for terms that
    are one number per head, not per entry); a plain number as it is."""
    return value.reshape(-1) if isinstance(value, torch.Tensor) else value


def as_tensor_like(value, like: torch.Tensor) -> torch.Tensor:
    """A number or a per-head tensor as a tensor of `like`'s dtype and device (for `torch.where`). A number is
    filled in on the device, never copied from the host: a captured step may run it (docs/internals.md,
    "Graph-safe steps")."""
    if isinstance(value, torch.Tensor):
        return value.to(like.dtype)
    return torch.full((), value, dtype=like.dtype, device=like.device)


@torch.no_grad()
def assign_(buffer: torch.Tensor, value) -> torch.Tensor:
    """Write a number or a tensor (broadcast) into `buffer` in place: a graph captured before keeps reading it."""
    return buffer.copy_(value) if isinstance(value, torch.Tensor) else buffer.fill_(value)


def rows_for_heads(state: torch.Tensor, index: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The batch's rows of per-head state `[K, N_train, C]`, shaped like `logits` (`[K, B, C]`, or `[B, C]` if K=1)."""
    num_heads = state.shape[0]
    if logits.dim() == 2 and num_heads == 1:
        return state[0, index]
    if logits.dim() != 3 or logits.shape[0] != num_heads:
        raise SpmlError(
            f"this loss keeps state for {num_heads} head(s); got logits {tuple(logits.shape)}:"
            f" pass [{num_heads}, B, C]" + (" or [B, C]" if num_heads == 1 else "")
        )
    return state[:, index]


class Loss(torch.nn.Module):
    """Base class: metadata for `spml-cache losses`, hyperparameter resolution, input validation.

    Subclasses set the class attributes and write the loss once, in one of two ways. A simple loss (its terms
    built from the blocks of `losses.terms.Terms`: nl(p), nl(1 - p), BCE, the entropy, ...) writes
    `equation(x, observed, *, labels=None, index=None)`, from which this class derives both `forward` (the
    values, differentiated by autograd) and `loss_and_grad` (each block's values with their slopes: the closed
    form). Any other loss implements `forward(logits, observed, *, labels=None, index=None)` itself.

    A training step (`forward`, its backward, `penalty`) must be replayable as a captured CUDA graph
    (docs/internals.md, "Graph-safe steps"): no host synchronisation, no tensor made from Python data, no
    Python value or branch or shape that changes between epochs. What changes between epochs lives in buffers
    that `start_epoch` updates in place (`assign_`). Three declarations tell the trainer what a step touches:
    `row_params`, the `nn.Parameter`s indexed by training row on dim 1 (`[K, N_train, ...]`, ROLE's theta);
    `row_buffers`, the buffers of per-training-row state that `forward` reads or writes through `index`; and
    `penalises_weight`, True when `penalty` adds a term on the head's weight.
    A loss that writes its own `forward` and whose gradient with respect to the logits is cheap to state may also
    define `loss_and_grad(logits, observed, *, labels=None, index=None)`, returning `forward`'s value `[K]` and that
    gradient `[K, B, C]` from one pass (and `penalty_and_grad(weight)` likewise beside `penalty`): stage two
    then takes no autograd graph for the loss (`closed_form`). It must agree with autograd of `forward`
    (`check-loss` checks it in float64). A loss whose trainable parameters are all `row_params` returns a third
    item, `{name: gradient with respect to the rows index selects, [K, B, ...]}`; one with other trainable
    parameters trains by autograd. A built-in without a closed form says why in `no_closed_form`.
    Hyperparameters become attributes (`self.alpha`), resolved as: class `defaults`, then
    `dataset_defaults[dataset]`, then the caller's overrides. A default of `None` is derived at build time
    (from the class count, the dataset, ...); `derived` says how, for `spml-cache losses`, and the subclass
    fills it in with `set_hparam` so that `hparams` always holds the values in use.
    """

    name: ClassVar[str]
    display_name: ClassVar[str] = ""  # as the papers write it (AN-LS, EM+APL, LL-R), for tables and legends; "": name
    description: ClassVar[str]
    reference: ClassVar[str]
    defaults: ClassVar[dict[str, float | None]] = {}
    derived: ClassVar[dict[str, str]] = {}  # how each `None` default is derived, e.g. {"gamma": "1/(C-1)"}
    dataset_defaults: ClassVar[dict[str, dict[str, float]]] = {}
    state: ClassVar[str] = ""  # what per-example state the loss keeps; "" when it keeps none
    oracle: ClassVar[bool] = False  # reads the full labels: an upper bound, not an SPML method
    needs_train_logits: ClassVar[bool] = False  # start_epoch wants the current logits of every training row
    reconstructed: ClassVar[bool] = False  # no public code: implemented from the spec's reconstruction
    # Learns from an image only through an observed positive (its terms pair one with the other labels): an
    # observation rule that leaves images with a positive but none observed is refused for it (observation/).
    needs_positive: ClassVar[bool] = False
    # What the loss does with an observed negative (z = -1, from observation rules other than `single`), as its
    # term in docs/losses.md's notation; every loss states it (`spml-cache losses` shows it). Where the paper has
    # none, the natural reading: an observed negative is a known 0, never an unknown.
    observed_negative: ClassVar[str] = ""
    # Reads the cache's text side: `train_similarity`, each training row's cosine similarity with each class's text
    # embedding (a CLIP cache); refused on a cache without one, left out of `--loss all` there.
    needs_similarity: ClassVar[bool] = False
    # `--fidelity authors`: the eps the authors' code adds inside its logs (None: their code is stable from logits,
    # or there is no code), and the early stopping rule of the paper that proposes the loss: ("no_gain", 0) stops
    # at the first epoch whose val mAP does not improve, ("drop", d) once it falls d below its best.
    authors_log_eps: ClassVar[float | None] = None
    authors_early_stop: ClassVar[tuple[str, float] | None] = None
    authors_drop_last: ClassVar[bool] = False  # the authors' loaders drop each epoch's last partial batch
    authors_defaults: ClassVar[dict[str, float]] = {}  # defaults of the authors' code where they differ from ours
    # Sweeps (`--hp key=v1,v2`): the hyperparameters whose values may differ between the heads of one stack (the
    # loss then holds them as `[K, 1, 1]` tensors and broadcasts them in `forward`); each hyperparameter's valid
    # range, declared as observation rules declare theirs (`Param.between("rho", 0, 1, "[)")` for 0 <= rho < 1;
    # a plugin may give `bounds = {"rho": (0.0, 1.0, "[)")}` instead, read the same way); and the search space
    # the paper states, if it states one, with where it says so.
    per_head: ClassVar[tuple[str, ...]] = ()
    params: ClassVar[tuple[Param, ...]] = ()
    bounds: ClassVar[dict[str, tuple[float, float, str]]] = {}
    paper_grid: ClassVar[dict[str, tuple[float, ...]]] = {}
    paper_grid_source: ClassVar[str] = ""
    # What a step touches (see the docstring): the trainer reads these instead of guessing from shapes.
    row_params: ClassVar[tuple[str, ...]] = ()
    row_buffers: ClassVar[tuple[str, ...]] = ()
    penalises_weight: ClassVar[bool] = False
    # Why stage two differentiates this loss by autograd, where it states no closed form (`closed_form()` is False);
    # every built-in either has one or says why (tests/test_losses_closed_form.py).
    no_closed_form: ClassVar[str] = ""

    def __init__(
        self,
        *,
        num_classes: int,
        num_train: int | None = None,
        dataset: str | None = None,
        num_heads: int = 1,
        train_observed: torch.Tensor | None = None,
        seed: int | Sequence[int] = 0,
        fidelity: Fidelity | str | None = None,
        train_similarity: torch.Tensor | None = None,
        train_crop_similarity: torch.Tensor | None = None,
        **hparams: float,
    ) -> None:
        super().__init__()
        # which epoch it was started for, for a loss that changes between epochs (loop.py: a loop must say so)
        self.epoch_use = loop.EpochUse() if type(self).needs_start_epoch() else None
        self.fidelity = fidelity = Fidelity.check(fidelity)
        authors = fidelity is Fidelity.AUTHORS
        self.log_eps = self.authors_log_eps if authors else None  # what every log term passes on
        # The rules a trainer follows (linear/engine.py, finetune/run.py): drop each epoch's (and each
        # evaluation's) last partial batch; stop early by the paper's rule, (kind, threshold), or never (None).
        self.drops_last = authors and self.authors_drop_last
        self.early_stop = self.authors_early_stop if authors else None
        unknown = sorted(set(hparams) - set(self.defaults))
        if unknown:
            valid = ", ".join(sorted(self.defaults)) or "none"
            raise SpmlError(
                f"loss '{self.name}' has no hyperparameter {', '.join(unknown)}; valid: {valid}"
            )
        if train_observed is not None:
            train_observed = torch.as_tensor(train_observed).to(torch.int8)
            if num_train is not None and num_train != train_observed.shape[0]:
                raise SpmlError(
                    f"loss '{self.name}': num_train={num_train} but train_observed has {train_observed.shape[0]} rows"
                )
            num_train = train_observed.shape[0]
        if self.state and train_observed is None:
            raise SpmlError(f"loss '{self.name}' keeps per-example state: build it with train_observed=[N_train, C]")
        if isinstance(seed, Sequence) and len(seed) != num_heads:
            raise SpmlError(f"loss '{self.name}': got {len(seed)} seeds for num_heads={num_heads}; give one per head")
        self.num_classes = num_classes
        self.num_train = num_train
        self.dataset = dataset
        self.num_heads = num_heads
        self.seed = seed  # one int for every head, or one per head (ROLE's Theta init draws from it)
        self.train_observed = train_observed  # int8 [N_train, C] as given; stateful losses copy it into buffers
        # float32 [N_train, C] and [N_train, G*G, C]: image-text cosine similarities (needs_similarity), or None
        self.train_similarity, self.train_crop_similarity = self._similarities(
            train_similarity, train_crop_similarity, num_train, num_classes)
        self.hparams = {**self.defaults, **(self.authors_defaults if authors else {}), **self.dataset_defaults.get(dataset or "", {}), **hparams}
        for key, value in self.hparams.items():
            values = list(value) if isinstance(value, (list, tuple)) else [value]
            for one in values:
                self.check_bound(key, one)
            if not isinstance(value, (list, tuple)):
                setattr(self, key, value)
            elif key not in self.per_head or len(values) != num_heads:
                raise SpmlError(f"loss '{self.name}': {key} cannot take one value per head here (it does for"
                                f" {', '.join(self.per_head) or 'no hyperparameter'}, one value for each of the"
                                f" {num_heads} heads)")
            else:  # not saved with the state: a head's values travel in its results and best.pt entry
                self.register_buffer(key, torch.tensor(values, dtype=torch.float32).view(-1, 1, 1), persistent=False)

    def _similarities(self, similarity, crops, num_train: int | None, num_classes: int):
        """The training rows' image-text similarities as float32 tensors, checked against the rows and classes."""
        if similarity is None:
            if self.needs_similarity:
                raise SpmlError(f"loss '{self.name}' needs the cache's text side (image-text similarities of the"
                                " training rows): extract the cache with --backbone clip:ViT-B-16/openai")
            return None, None
        similarity = torch.as_tensor(similarity).float()
        rows = num_train if num_train is not None else similarity.shape[0]
        if tuple(similarity.shape) != (rows, num_classes):
            raise SpmlError(f"loss '{self.name}': train_similarity has shape {tuple(similarity.shape)}, expected"
                            f" [{rows}, {num_classes}] (one row per training row, one column per class)")
        if crops is not None:
            crops = torch.as_tensor(crops).float()
            if crops.dim() != 3 or crops.shape[0] != rows or crops.shape[2] != num_classes:
                raise SpmlError(f"loss '{self.name}': train_crop_similarity has shape {tuple(crops.shape)},"
                                f" expected [{rows}, G*G, {num_classes}]")
        return similarity, crops

    def check_bound(self, key: str, value) -> None:
        """A value outside the hyperparameter's valid range is a clear error naming the flag."""
        param = self.constraints().get(key)
        if value is not None and param is not None and not param.valid(value):
            interval = param.must.removeprefix("in ")
            raise SpmlError(f"--hp {self.name}.{key}={value:g}: outside its valid range {interval}")

    @classmethod
    def constraints(cls) -> dict[str, Param]:
        """Each constrained hyperparameter's `Param`: the class's `params`, and a plugin's `bounds` as Params."""
        found = {param.name: param for param in cls.params}
        found.update({key: Param.between(key, *bound) for key, bound in cls.bounds.items()})
        return found

    def set_hparam(self, key: str, value: float) -> None:
        """Fill in (or normalise) a resolved hyperparameter, keeping `hparams` and the attribute in step."""
        self.hparams[key] = value
        setattr(self, key, value)

    def __call__(
        self,
        logits: torch.Tensor,
        observed: torch.Tensor,
        *,
        labels: torch.Tensor | None = None,
        index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`loss(logits, observed, index=rows)`: the loss of each head `[K]` (a scalar for `[B, C]` logits) of a batch's
        `logits` and `observed` labels (1 / 0 / -1), `index` the batch's training-row ids (a loss with per-example
        state needs them), `labels` the full labels (an oracle's); checked, then `forward`. A training call of a loss
        that `needs_start_epoch()` is refused before its first `start_epoch`."""
        if logits.shape[-1] != self.num_classes or observed.shape[-1] != self.num_classes:
            raise SpmlError(
                f"loss '{self.name}' was built for {self.num_classes} classes; got logits {tuple(logits.shape)}"
                f" and observed {tuple(observed.shape)}"
            )
        if self.oracle and labels is None:
            raise SpmlError(f"loss '{self.name}' is an oracle: it needs the full labels (labels=...)")
        if self.state and index is None:
            raise SpmlError(f"loss '{self.name}' keeps per-example state: pass the batch's training-row ids (index=...)")
        if self.epoch_use is not None and logits.requires_grad and torch.is_grad_enabled():  # a training call
            self.epoch_use.training_call(self, logits.shape[-2])
        return super().__call__(logits, observed, labels=labels, index=index)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "start_epoch" in vars(cls):  # whatever the class's hook does, the epoch it was started for is noted
            cls.start_epoch = loop.counted(vars(cls)["start_epoch"])

    def forward(self, logits, observed, *, labels=None, index=None) -> torch.Tensor:
        """The loss of each head `[K]` (a scalar for `[B, C]` logits): `equation` over plain tensors."""
        return self.equation(Terms(logits, self.log_eps), observed, labels=labels, index=index)

    def loss_and_grad(self, logits, observed, *, labels=None, index=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s value `[K]` and its gradient with respect to the logits `[K, B, C]`: `equation` over its
        blocks' values and slopes (no autograd graph)."""
        value, slope = self.equation(Terms(logits, self.log_eps, slopes=True), observed, labels=labels, index=index)
        return value, slope

    def equation(self, x: Terms, observed, *, labels=None, index=None):
        """A simple loss, written once: its value per head from the blocks of `x`, the batch's logits as `Terms`
        (`x.mean(x.where(observed == 1, x.nl_p, x.nl_1mp))` is `an`). A loss that writes `forward` instead
        needs none."""
        raise NotImplementedError(f"loss '{self.name}' defines neither forward nor equation: write one of them"
                                  " (docs/your-own-loss.md)")

    def start_epoch(self, epoch: int, num_epochs: int, train_logits: torch.Tensor | None = None) -> None:
        """Advance schedules and pseudo-labelling; called before the first batch of epoch `epoch` (1-indexed).

        `train_logits` (`[K, N_train, C]`, or `[N_train, C]` for one head) are the current model's logits on every
        training row, i.e. after epoch `epoch - 1`; the trainer computes them only when `needs_train_logits`
        (`losses.train_logits` in a loop of your own). A class that defines it `needs_start_epoch()`: its training
        calls are refused before the first one, and warn once past an epoch's rows without the next (loop.py).
        """

    @classmethod
    def needs_start_epoch(cls) -> bool:
        """Whether the loss changes between epochs (its class defines `start_epoch`), so that a loop must call
        `start_epoch` before each epoch's first batch."""
        return _owner(cls, "start_epoch") is not Loss

    def param_groups(self, lr: float) -> list[dict]:
        """The loss's own trainable parameters (ROLE's theta) as torch optimiser param groups, each at its learning
        rate: `lr` times the parameter's `lr_mult` (1 where it has none); [] for a loss that learns none. For a loop of
        your own: `torch.optim.Adam([{"params": model.parameters(), "lr": lr}] + loss.param_groups(lr))`."""
        return [{"params": [param], "lr": lr * getattr(param, "lr_mult", 1.0)} for param in self.parameters()]

    @classmethod
    def closed_form(cls) -> bool:
        """Whether `loss_and_grad` states the gradient of this class's `forward`: both derived from an `equation`,
        or `loss_and_grad` defined by the class that defines `forward` or by one below it (a subclass that rewrites
        `forward` alone trains by autograd)."""
        if _owner(cls, "forward") is Loss:
            return _owner(cls, "equation") is not Loss
        return _defined_below(cls, "loss_and_grad", "forward")

    @classmethod
    def closed_form_penalty(cls) -> bool:
        """Whether `penalty_and_grad` states the gradient of this class's `penalty` (as `closed_form`)."""
        return _defined_below(cls, "penalty_and_grad", "penalty")

    def penalty(self, weight: torch.Tensor) -> torch.Tensor | float:
        """A regulariser on the linear head's weight (`[K, D, C]` or `[D, C]`, bias excluded); 0 for most losses."""
        return 0.0

    def head_state_dict(self, head: int) -> dict[str, torch.Tensor]:
        """The state of head `head` alone: what a `num_heads=1` loss's `state_dict()` holds (every state tensor
        leads with the head dimension K)."""
        return {key: value[head : head + 1].clone() for key, value in self.state_dict().items()}

    @torch.no_grad()
    def load_head_state(self, state: dict[str, torch.Tensor]) -> None:
        """Start every head from one head's state (`head_state_dict` of some head, leading dimension 1)."""
        own = self.state_dict()
        for key, value in state.items():
            own[key].copy_(value.to(own[key].device, own[key].dtype).expand_as(own[key]))

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.hparams.items())


def _owner(cls: type, method: str) -> type | None:
    """The class of `cls`'s MRO whose `method` `cls` has (None: none defines it)."""
    return next((klass for klass in cls.__mro__ if method in vars(klass)), None)


def _defined_below(cls: type, method: str, of: str) -> bool:
    """Whether `cls` has `method`, from the class that defines `of` or from a subclass of it."""
    owner = _owner(cls, method)
    return owner is not None and issubclass(owner, _owner(cls, of))


# Every built-in loss, in the order of docs/losses.md (the order the family modules are imported in).
LOSSES: Registry[type[Loss]] = Registry("loss", listing="valid:")


def register(cls: type[Loss]) -> type[Loss]:
    """Class decorator: make a loss available to `build` under `cls.name`."""
    return LOSSES.register(cls)
