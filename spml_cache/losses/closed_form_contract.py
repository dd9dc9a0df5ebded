"""What check-loss's closed-form check (losses/contract.py `check_closed_form`) runs: the training step of a loss
that states its gradient (`loss_and_grad`, `penalty_and_grad`), which the capture-safe check traces too, and its
comparison with autograd of `forward` on one step of contract.py's small problem (`data`: its observed labels
and full labels)."""

from __future__ import annotations

import torch

from spml_cache.losses.base import Loss


def closed_step(loss: Loss, data, rows: torch.Tensor, logits: torch.Tensor, weight: torch.Tensor):
    """The step stage two takes for a loss that states its gradient (`loss_and_grad`, and `penalty_and_grad` when it
    has one): per-head values and the gradients as `step` orders them: the logits', the per-row parameters' (their
    rows placed in the whole parameter, zero elsewhere, as autograd gives it) and, for a penalty, the weight's."""
    values, grad, *row_grads = loss.loss_and_grad(logits.detach(), data.observed.index_select(0, rows),
                                                  labels=data.labels.index_select(0, rows) if loss.oracle else None,
                                                  index=rows)
    grads = [grad] + [torch.zeros_like(param).index_copy_(1, rows, row_grads[0][name])
                      for name, param in loss.named_parameters() if row_grads]
    if not loss.penalises_weight:
        return values, tuple(grads)
    if type(loss).closed_form_penalty():
        penalty, weight_grad = loss.penalty_and_grad(weight.detach())
    else:
        penalty = loss.penalty(weight)
        (weight_grad,) = torch.autograd.grad(penalty.sum(), [weight])
    return values + penalty, (*grads, weight_grad)


def same_as_autograd(loss: Loss, data, rows, logits, weight, step) -> tuple[float, str | None]:
    """The worst relative difference of the closed form's values and gradients from those of `step` (autograd's),
    on one step from one state; and what is wrong, if anything: a difference past 1e-6, or state written
    otherwise."""
    kept = {key: value.clone() for key, value in loss.state_dict().items()}
    values, grads = step(loss, data, rows, logits, weight)
    written = {key: value.clone() for key, value in loss.state_dict().items()}
    loss.load_state_dict(kept)
    closed_values, closed_grads = closed_step(loss, data, rows, logits, weight)
    worst = 0.0
    pairs = [("value", values.detach(), closed_values), ("gradient", grads[0], closed_grads[0])]
    penalised = int(loss.penalises_weight)
    pairs += [(f"{name}'s gradient", grads[1 + i], closed) for i, ((name, _), closed) in
              enumerate(zip(loss.named_parameters(), closed_grads[1 : len(closed_grads) - penalised]))]
    pairs += [("penalty's gradient", grads[-1], closed_grads[-1])] if loss.penalises_weight else []
    for name, expected, got in pairs:
        finite = ~expected.isnan()  # autograd's NaN where a torch.where's unchosen branch has an infinite slope
        error = ((got - expected).abs() / expected.abs().clamp(min=1e-300))[finite]
        worst = max(worst, error.max().item() if error.numel() else 0.0)
        if not torch.allclose(got[finite], expected[finite], rtol=1e-6, atol=0):
            return worst, (f"loss_and_grad's {name} differs from autograd of forward by up to {worst:.1e} relative;"
                           " state the derivative of forward's terms exactly (losses/terms.py gives the built-ins'),"
                           " or leave loss_and_grad out: stage two then uses autograd")
    if any(not torch.equal(value, written[key]) for key, value in loss.state_dict().items()):
        return worst, "loss_and_grad leaves the loss's state otherwise than forward does"
    return worst, None
