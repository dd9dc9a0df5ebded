"""`--log tensorboard,mlflow,wandb`: a run's options, its epochs and its results, in the experiment trackers its
users already watch (docs/trackers.md).

Each tracker is an entry of `TRACKERS` (its module imported, and its package, only when a run logs to it). A stage
opens them with `watching(names, run_dir, say)` around its training: the training waits (at most a minute) for the
trackers to open their runs, then every metrics line it writes (`runs.append_metrics`) goes to each tracker's own
thread, and once results.json is written, the results and the run's files; a stop or an error closes the
trackers' runs as such. A tracker never stops the training: what it raises is one line (`say`), and the run's own
files are whole. Each tracker's run ids, and how far it logged each head, are kept in the run directory
(trackers.json), so that `--resume` goes on in the same tracker runs and logs each epoch once.

The trackers are declared in options/trackers.py (`--log` is read as the command line is parsed, before any of
this is imported).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from spml_cache.options.trackers import TRACKERS
from spml_cache.runtime.errors import SpmlError
from spml_cache.trackers.base import TRACKERS_FILE


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
