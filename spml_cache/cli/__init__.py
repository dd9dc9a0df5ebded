"""The `spml-cache` command: parses flags, calls one function per command, prints with rich.

Every command's work lives in its module; this file only turns flags into arguments and results into
tables. Errors a user can fix arrive as `SpmlError` and leave as one red line (exit 1); `--debug` shows the
traceback instead.
"""

from __future__ import annotations

import os
import shlex
import sys
import warnings
from dataclasses import replace

import typer
from rich.markup import escape
from rich.text import Text

from spml_cache.cli.text import (  # noqa: F401 (parse_* are the command line's API, tested as cli.parse_*)
    CONSOLE as console,
    default_data_root,
    extract_report,
    finetune_summary,
    help_as_prose,
    last_line,
    no_type_for_flags,
    one_line_warning,
    parse_hparams,
    parse_list,
    parse_names,
    require_root,
)
from spml_cache.cli.check_loss import check_loss_command
from spml_cache.cli.declared import stage_command
from spml_cache.cli.tools import (
    datasets_command,
    demo_command,
    export_command,
    import_features_command,
    losses_command,
    make_demo_data_command,
    report_command,
)
from spml_cache.cli.stopping import exit_code, stopping_on_signals
from spml_cache.options import (
    ExtractOptions, ExtractPlacement, FinetuneOptions, FinetunePlacement, LinearOptions, LinearPlacement,
)
from spml_cache.options.demo import DemoData, DemoPlacement, DemoSizes
from spml_cache.options.extract import ImportOptions
from spml_cache.options.experiments import RunOptions
from spml_cache.options.report import ReportOptions
from spml_cache.runtime.errors import Interrupted, SpmlError, finished, stop_requested, work_finished
from spml_cache.runtime.install import mismatched_torchvision


def _command_returned(_result, **_flags) -> None:
    """Every command's work is done once its function returns (its last line printed): a stop that comes as the
    command line winds up has nothing to stop (`errors.finished`)."""
    finished()


app = typer.Typer(
    name="spml-cache",
    help="Single-positive multi-label learning on a cached feature matrix of a frozen backbone (ResNet-50 by"
    " default).\n\n"
    "Example: spml-cache demo",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    result_callback=_command_returned,
)
_debug = {"on": bool(os.environ.get("SPML_DEBUG"))}


@app.callback()
def _options(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback on errors."),
) -> None:
    if debug:
        _debug["on"] = True


# --- datasets, make-demo-data (datasets helper) ---
app.command("datasets")(datasets_command)
stage_command(app, "make-demo-data", DemoData)(make_demo_data_command)


# --- extract, import-features (extract helper) ---


@stage_command(app, "extract", ExtractOptions, ExtractPlacement)
def extract_command(options: ExtractOptions, placement: ExtractPlacement) -> None:
    """Stage one: run a frozen backbone (ResNet-50 by default) over a dataset once and write its features to an
    HDF5 cache; a clip:ARCH/TAG backbone also writes its image embeddings and the class prompts' text embeddings.

    An interrupted run resumes from <out>.partial; a complete cache is not recomputed unless --force. Under
    torchrun --nproc-per-node N -m spml_cache extract ..., each process extracts every N-th row and rank 0 joins
    them into the one cache.

    Example: spml-cache extract voc --root ~/data --observe entry:0.1,largest
    Example: spml-cache extract voc --root ~/data --features last4
    """
    placement = replace(placement, root=require_root(placement.root))
    from spml_cache.extract import run_extract

    report = run_extract(options, placement)
    if report is not None:  # under torchrun, rank 0 reports for every rank
        extract_report(report, console)


stage_command(app, "import-features", ImportOptions)(import_features_command)
app.command("export")(export_command)


# --- losses (losses helper) ---
app.command("losses")(losses_command)


app.command("check-loss")(check_loss_command)


# --- linear, demo (linear helper) ---


@stage_command(app, "linear", LinearOptions, LinearPlacement)
def linear_command(options: LinearOptions, placement: LinearPlacement) -> None:
    """Stage two: linear heads on cached features, every (lr, batch size) config at once; best val epoch, test mAP there.

    Every finished (loss, seed, batch size) is kept as it finishes: after Ctrl-C, --resume RUN goes on. A
    hyperparameter given as a comma list is swept, every value beside every lr and batch size.

    Example: spml-cache linear --dataset voc --loss an,ll_r --seeds 3
    Example: spml-cache linear --dataset voc --loss ll_r --hp delta=0.001,0.002
    Example: spml-cache linear --dataset voc --loss all --observe single,entry:0.1
    Example: spml-cache linear --dataset voc --loss all --wd 0,1e-4,1e-3
    Example: spml-cache linear --config RUN --cache cache/voc-vit_b_16-224.h5
    """
    if options.losses is None and placement.resume is None and placement.config is None:
        raise typer.BadParameter("missing: give a loss, a comma list or all (or --resume RUN, or --config"
                                 " RUN/config.json)", param_hint="--loss")
    from spml_cache import linear

    run = linear.run_linear(options, placement)
    if run is None:  # under torchrun, rank 0 reports for every process
        return
    console.print(linear.summary_table(run.results))
    for note in linear.summary_notes(run.results):
        console.print(Text(note, style="yellow"), soft_wrap=True)
    console.print(f"run directory: {escape(str(run.run_dir))}")


stage_command(app, "demo", DemoSizes, DemoPlacement)(demo_command)


# --- finetune (finetune helper) ---


@stage_command(app, "finetune", FinetuneOptions, FinetunePlacement)
def finetune_command(options: FinetuneOptions, placement: FinetunePlacement) -> None:
    """Stage three: fine-tune the cache's backbone end to end from the best linear head (LinearInit) or a fresh head.

    Images, splits and observed labels are the cache's rows; torchvision and timm trunks fine-tune. For data
    parallel, launch it with torchrun --nproc-per-node N -m spml_cache finetune ... (the global batch is shared by
    the processes).

    Example: spml-cache finetune --dataset voc --loss role --root ~/data --lr 1e-5
    Example: spml-cache finetune --config RUN/config.json --seeds 3
    """
    from spml_cache.finetune import run_finetune

    if placement.root is None and placement.resume is None and placement.config is None:
        placement = replace(placement, root=default_data_root())  # a resumed or rerun run reads its own root
    run = run_finetune(options, replace(placement, log=lambda line: console.print(
        line, markup=False, highlight=False, soft_wrap=True)))
    if run is not None:  # other torchrun processes return nothing
        for line in finetune_summary({**run.results, "run_dir": str(run.run_dir)}):
            console.print(line, soft_wrap=True)


# --- report (report helper) ---
stage_command(app, "report", ReportOptions)(report_command)


# --- run: an experiment file's stages ---


@stage_command(app, "run", RunOptions)
def run_command(options: RunOptions) -> None:
    """Run an experiment file: its stages (extract, import-features, linear, finetune, report) over its axes, each
    step the command you would type; every mistake in the file is said before anything runs.

    Run again, it reuses every cache and finished run, goes on with an interrupted one and trains only what is
    missing; --dry-run prints the plan as commands. The file's format: docs/experiments.md.

    Example: spml-cache run examples/table1.toml --dry-run
    Example: spml-cache run examples/frozen_table.toml --log tensorboard
    """
    from spml_cache.experiments.run import run_experiment

    run_experiment(options.file, dry_run=options.dry_run, trackers=options.trackers, console=console)


help_as_prose(app)  # last: every command's docstring wraps at the terminal's width


def _same_command() -> str:
    """The command line as it was typed (what goes on after a stop that no stage described)."""
    return shlex.join(["spml-cache", *sys.argv[1:]])


def main() -> None:
    """Console-script entry point: run the app; a user error, Ctrl-C, SIGTERM and a warning each become one
    line (exit 1, 130, 143)."""
    before_separator = sys.argv[: sys.argv.index("--")] if "--" in sys.argv else sys.argv
    if "--debug" in before_separator[1:]:  # anywhere, not only before the command
        _debug["on"] = True
        sys.argv[:] = [arg for i, arg in enumerate(sys.argv) if not (arg == "--debug" and i < len(before_separator))]
    no_type_for_flags()
    with stopping_on_signals(ending_the_process=True):
        try:
            with warnings.catch_warnings():
                warnings.showwarning = one_line_warning
                app()
        except Interrupted as stop:
            command = stop.command or _same_command()
            last_line(Text(f"interrupted: {stop.kept}; go on with: {command}", style="yellow"), exit_code())
        except KeyboardInterrupt:  # before a stage said what it keeps: the same command goes on (or starts again)
            last_line(Text(f"interrupted; go on with: {_same_command()}", style="yellow"), exit_code())
        except SystemExit as done:  # typer turns a KeyboardInterrupt it sees (one during an import) into exit 130
            if stop_requested() is None or work_finished() or not isinstance(done.__context__, typer.Exit):
                raise
            last_line(Text(f"interrupted; go on with: {_same_command()}", style="yellow"), exit_code())
        except SpmlError as err:
            if _debug["on"]:
                raise
            last_line(Text("error: ", style="bold red") + Text(str(err), style="red"), 1)
        except Exception as err:  # a bug or an environment failure: still one line unless --debug
            if _debug["on"]:
                raise
            known = mismatched_torchvision(err)  # a broken install, met as the command starts: the fix
            if known is not None:
                last_line(Text("error: ", style="bold red") + Text(str(known), style="red"), 1)
            message = f"{type(err).__name__}: {err} (run with --debug for the traceback)"
            last_line(Text("error: ", style="bold red") + Text(message, style="red"), 1)

