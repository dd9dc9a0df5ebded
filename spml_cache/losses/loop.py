"""A loss in a training loop of your own (docs/your-own-loop.md): what the loop owes it, checked, and the helpers
that pay it.

- A loss that changes between epochs (its class defines `start_epoch`: `Loss.needs_start_epoch()`) needs
  `loss.start_epoch(epoch, num_epochs, train_logits=...)` before each epoch's first batch. `EpochUse` holds the loss
  to it at every training call (logits that require grad, with grad enabled; an evaluation under `torch.no_grad()`
  is not one), by Python bookkeeping alone: no tensor op and no host read, so a captured step is unchanged (stage two
  calls `start_epoch` itself, and its closed forms never go through `Loss.__call__`). A training call before any
  `start_epoch` is refused; once the training calls since the last `start_epoch` have shown more rows than the
  training set has (`num_train`), a new epoch has begun without it, or the loop shows rows more than once an epoch:
  it warns once, naming the call to make.
- `train_logits(model, inputs, batch_size)`: every training row's logits, what `start_epoch` wants of a loss with
  `needs_train_logits`.
- `Loss.param_groups(lr)` (base.py): a loss's own parameters (ROLE's theta) for the optimiser, at their multipliers.
"""

from __future__ import annotations

import functools
import warnings

import torch

from spml_cache.runtime.errors import SpmlError

GUIDE = "docs/your-own-loop.md"


class EpochWarning(UserWarning):
    """A loss that changes between epochs was shown more rows than an epoch has since its last `start_epoch`."""


def start_call(loss) -> str:
    """The call a loss wants before each epoch, as the user writes it."""
    logits = ", train_logits=losses.train_logits(model, train_inputs)" if loss.needs_train_logits else ""
    return f"loss.start_epoch(epoch, num_epochs{logits})"


class EpochUse:
    """The epoch a loss was last started for (`start_epoch`), and the rows of the training calls since."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.rows = 0
        self.warned = False

    def started(self, epoch: int) -> None:
        self.epoch, self.rows = epoch, 0

    def training_call(self, loss, rows: int) -> None:
        """One training call of `rows` rows (a Python int: the logits' shape): refused before any `start_epoch`;
        past an epoch's rows since the last one, a warning, once."""
        if self.epoch is None:
            raise SpmlError(f"loss '{loss.name}' changes between epochs and was used before its first start_epoch:"
                            f" call {start_call(loss)} before each epoch's first batch, from epoch 1 ({GUIDE})")
        self.rows += rows
        if loss.num_train is not None and self.rows > loss.num_train and not self.warned:
            self.warned = True
            warnings.warn(f"loss '{loss.name}' has been shown {self.rows} training rows since start_epoch({self.epoch}),"
                          f" more than the {loss.num_train} of its training set: a new epoch without"
                          f" {start_call(loss)}? Call it before each epoch's first batch ({GUIDE}); a loop that shows"
                          " rows more than once an epoch may ignore this", EpochWarning, stacklevel=3)


def counted(start_epoch):
    """A loss class's `start_epoch`, noting in the loss's `EpochUse` which epoch it was started for once it ran."""

    @functools.wraps(start_epoch)
    def started(self, epoch, num_epochs, *args, **kwargs):
        done = start_epoch(self, epoch, num_epochs, *args, **kwargs)
        if self.epoch_use is not None:
            self.epoch_use.started(epoch)
        return done

    return started


@torch.no_grad()
def train_logits(model, inputs, batch_size: int = 256, device: torch.device | str | None = None) -> torch.Tensor:
    """Every training row's logits, what `start_epoch` wants of a loss with `needs_train_logits`: `model` (anything
    that maps a batch of inputs to logits `[B, C]`; an `nn.Module` is run in eval mode, then put back in the mode it
    was in) on `inputs` (`[N_train, ...]`: a tensor, or anything `len()` and slices read; row i is the training row
    that `index` i names in the loss's calls), `batch_size` rows at a time, each moved to `device` (default: the
    model's, where it has parameters). Returns float32 logits `[N_train, C]` on that device."""
    if batch_size < 1:
        raise SpmlError(f"train_logits: batch_size={batch_size}; give at least 1")
    if len(inputs) == 0:
        raise SpmlError("train_logits: no inputs; give every training row's inputs, in training-row order")
    module = model if isinstance(model, torch.nn.Module) else None
    if device is None:
        first = next(module.parameters(), None) if module is not None else None
        device = first.device if first is not None else getattr(inputs, "device", "cpu")
    was_training = module is not None and module.training
    if module is not None:
        module.eval()
    try:
        parts = [model(inputs[start : start + batch_size].to(device)).float()
                 for start in range(0, len(inputs), batch_size)]
    finally:
        if module is not None:
            module.train(was_training)
    return torch.cat(parts)
