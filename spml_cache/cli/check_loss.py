"""`spml-cache check-loss SPEC`: the contract checks of losses/contract.py, one line each."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.text import Text

from spml_cache.cli.text import ERR_CONSOLE


def check_loss_command(
    spec: str = typer.Argument(..., help="A loss: a built-in's name, path/to/file.py:Class, package.module:Class or an installed plugin's name."),
) -> None:
    """Hold a loss to the contract the built-in losses meet, one line per check; exit 1 at the first failure.

    Finite values and gradients (random logits and |z| = 30), the gradient against finite differences in float64,
    a closed form (loss_and_grad, if defined) against autograd, K stacked heads equal to K heads alone, a
    capture-safe step (no host sync), determinism under a seed, and every observation rule's masks (observed
    negatives too). docs/your-own-loss.md says what each one asks.

    Example: spml-cache check-loss examples/masked_focal.py:MaskedFocal
    """
    from spml_cache import losses
    from spml_cache.losses.contract import run_checks
    from spml_cache.runtime.plugins import given_as_argument

    with given_as_argument():  # refusals name SPEC as typed: no --loss was given
        cls = losses.get(spec)
    console = Console(soft_wrap=True, highlight=False)
    console.print(f"checking {cls.name} ({spec})", markup=False)
    for passed, line in run_checks(cls):
        if passed:
            console.print(Text("ok    ", style="green") + Text(line))
        else:
            ERR_CONSOLE.print(Text("FAIL  ", style="bold red") + Text(line, style="red"))
            raise typer.Exit(1)
    console.print(f"{cls.name} meets the contract: train it with spml-cache linear --loss {spec}", markup=False)
