"""The experiment trackers `--log` takes (spml_cache/trackers/ logs to them): each declared by its name, the
package it needs and where its class is, so that the options check `--log` without importing a tracker."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.registry import Registry


@dataclass(frozen=True)
class Declared:
    """A tracker: its name (that of the pip extra that installs it, too), the package it imports, where its class
    is (`module:class`), and what it writes, for --help."""

    name: str
    package: str
    where: str
    summary: str

    def installed(self) -> bool:
        return importlib.util.find_spec(self.package) is not None

    def missing(self, where: str) -> str:
        return f"{where}: needs the {self.package} package: pip install \"spml-cache[{self.name}]\""

    def build(self):
        module, _, name = self.where.partition(":")
        return getattr(importlib.import_module(module), name)()


TRACKERS: Registry[Declared] = Registry("tracker")
for _declared in (
    Declared("tensorboard", "tensorboard", "spml_cache.trackers.tensorboard_log:TensorBoard",
             "event files in RUN/tensorboard"),
    Declared("mlflow", "mlflow", "spml_cache.trackers.mlflow_log:MLflow",
             "a run with a child run per head at MLFLOW_TRACKING_URI"),
    Declared("wandb", "wandb", "spml_cache.trackers.wandb_log:WandB",
             "one W&B run, RUN/wandb when WANDB_MODE=offline"),
):
    TRACKERS.register(_declared)

TRACKERS_HELP = ("Log the run to experiment trackers, a comma list: " +
                 "; ".join(f"{one.name} ({one.summary})" for one in TRACKERS.values()) +
                 "; or none. Default: none, or what a resumed run logged to (docs/trackers.md).")


def read_trackers(value, flag: str) -> tuple[str, ...]:
    """`--log`'s trackers from a comma list (or a list of names): each known and its package installed, or one line
    naming it and the fix; `none` alone: no tracker (beside --resume too)."""
    if not isinstance(value, str) and not value:  # none, as read already (a declaration reads what it holds again)
        return ()
    names = [name.strip() for name in (value.split(",") if isinstance(value, str) else value) if name.strip()]
    if names == ["none"]:
        return ()
    if not names:
        raise SpmlError(f"{flag} is empty: give {', '.join(TRACKERS.names())} (a comma list), or none")
    for name in names:
        declared = TRACKERS.get(name, where=f"{flag} {value if isinstance(value, str) else name}: ", hint=", or none")
        if not declared.installed():
            raise SpmlError(declared.missing(f"{flag} {name}"))
    return tuple(dict.fromkeys(names))
