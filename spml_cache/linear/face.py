"""`sc.linear(...)`: stage two from Python, its keywords named as `spml-cache linear`'s flags and read and checked by
their declarations (options/keywords.py); quiet unless `progress=True`."""

from __future__ import annotations

from dataclasses import replace

from spml_cache.linear.run import run_linear
from spml_cache.options import LinearOptions, LinearPlacement
from spml_cache.options.keywords import documented, from_flag_keywords, no_positional
from spml_cache.runs.results import LinearRun
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.progress import door_console, reporting_to


def linear(*args, progress: bool = False, **keywords) -> LinearRun:
    """Stage two, `spml-cache linear` from Python: linear heads on a cache's features with each loss, every (lr,
    batch size) config at once, the best val epoch selected, test mAP there; the run directory is written as the
    command line writes it, with the same results for the same settings.

    Returns the `LinearRun`: `run.run_dir`, `run.results` (results.json), `run.losses[name]` (a `LossResult`:
    the selected config, val and test mAP with their spread over seeds, per-seed and per-config rows,
    `f1_family()`, `head()`). Under torchrun the other processes get None."""
    no_positional("sc.linear", args, progress)
    options, placement = from_flag_keywords("sc.linear", keywords, LinearOptions, LinearPlacement, also=["progress"])
    if options.losses is None and placement.resume is None:
        raise SpmlError("sc.linear: loss is missing: give a loss, a comma list (an,role) or all (or resume=RUN)")
    shown = door_console(progress)
    with reporting_to(shown):
        return run_linear(options, replace(placement, console=shown))


documented(linear, LinearOptions, LinearPlacement)
