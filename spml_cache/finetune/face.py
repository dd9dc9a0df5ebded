"""`sc.finetune(...)`: stage three from Python, its keywords named as `spml-cache finetune`'s flags and read and
checked by their declarations (options/keywords.py); quiet unless `progress=True`."""

from __future__ import annotations

from dataclasses import replace

from spml_cache.finetune.run import run_finetune
from spml_cache.options import FinetuneOptions, FinetunePlacement
from spml_cache.options.keywords import default_data_root, documented, from_flag_keywords, no_positional
from spml_cache.runs.results import FinetuneRun
from spml_cache.runtime.progress import door_console, reporting_to


def finetune(*args, progress: bool = False, **keywords) -> FinetuneRun:
    """Stage three, `spml-cache finetune` from Python: fine-tune the cache's backbone end to end from the best
    linear head (LinearInit) or a fresh head, on the cache's rows read as images under `root` (default:
    $SPML_DATA); the run directory is written as the command line writes it, with the same results for the same
    settings.

    Returns the `FinetuneRun`: `run.run_dir`, `run.results` (results.json), `run.init` (the head it started
    from), `run.losses[name]` (a `LossResult`, with `start`: epoch 0's val and test mAP). Under torchrun the
    other processes get None."""
    no_positional("sc.finetune", args, progress)
    options, placement = from_flag_keywords("sc.finetune", keywords, FinetuneOptions, FinetunePlacement,
                                            also=["progress"])
    if placement.root is None and placement.resume is None:
        placement = replace(placement, root=default_data_root())  # a resumed run reads its own root
    shown = door_console(progress)
    with reporting_to(shown):
        return run_finetune(options, replace(placement, log=lambda line: shown.print(
            line, markup=False, highlight=False, soft_wrap=True)))


documented(finetune, FinetuneOptions, FinetunePlacement)
