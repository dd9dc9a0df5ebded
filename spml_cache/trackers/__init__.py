"""`--log tensorboard,mlflow,wandb`: a run's options, its epochs and its results, in the experiment trackers its
users already watch (docs/trackers.md).

Each tracker is an entry of `TRACKERS` (its module imported, and its package, only when a run logs to it). A stage
opens them with `watching(names, run_dir, say)` around its training: the training waits (at most a minute) for the
trackers to open their runs, then every metrics line it writes (`runs.append_metrics`) goes to each tracker's own
thread, and once results.json is written, the results and the run's files; a stop or an error closes the
trackers' runs as such. A tracker never stops the training: what it raises is one line (`say`), and the run's own
files are whole. Each tracker's run ids, and how far it logged each head, are kept in the run directory
(trackers.json), so that `--resume` goes on in the same tracker runs and logs each epoch once.

No torch here (the options read `--log` with `read_trackers` as the command line is parsed).
"""

from __future__ import annotations

import importlib
import importlib.util
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.registry import Registry
from spml_cache.trackers.base import TRACKERS_FILE


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


def recorded(run_dir: Path | str) -> list[str]:
    """The trackers a run directory logged to (its trackers.json), each checked as `--log` checks them: what a
    resumed run goes on logging to when --log is not given."""
    from spml_cache import runs

    path = Path(run_dir) / TRACKERS_FILE
    names = list(runs.read_json(path, dict)) if path.is_file() else []
    for name in names:
        declared = TRACKERS.find(name)
        if declared is not None and not declared.installed():
            raise SpmlError(declared.missing(f"{run_dir} logs to {name} ({TRACKERS_FILE})") + ", or go on without"
                            " it: --log none")
    return [name for name in names if name in TRACKERS]


@contextmanager
def watching(names: Sequence[str] | None, run_dir: Path | str, say: Callable[[str], None]) -> Iterator[None]:
    """Log the run in `run_dir` to the trackers `names` (None: those it logged to before, `recorded`) while the
    block trains it: its epochs as they are written, its results once results.json is. `say` prints a tracker's
    line (a failure, where its run is)."""
    names = recorded(run_dir) if names is None else list(names)
    if not names:
        yield
        return
    from spml_cache import runs
    from spml_cache.runtime.errors import Interrupted
    from spml_cache.trackers.session import Session

    session = Session([TRACKERS.get(name).build() for name in names], Path(run_dir), say)
    try:
        session.wait_started()
        with runs.watch_metrics(run_dir, session.lines):
            yield
    except BaseException as err:
        session.stop(failed=not isinstance(err, (KeyboardInterrupt, SystemExit, Interrupted)))
        raise
    if runs.is_complete(run_dir):
        session.finish()
    else:
        session.stop(failed=False)
