"""`spml-cache report`: the table (terminal or file) and the figures of the runs asked for."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape

from spml_cache.options.report import ReportOptions
from spml_cache.report.collect import collect_runs
from spml_cache.report.confidence import Resampling, add_intervals, compare
from spml_cache.report.figure_files import DEFAULT_DPI, DEFAULT_FORMAT, FigureFiles, figure_width
from spml_cache.report.measures import MAP, StoredTests, add_metrics
from spml_cache.report.pivot import pivot_backbone, plot_backbones
from spml_cache.report.plots import plot_runs, require_matplotlib
from spml_cache.report.formats import EVERY_METRIC, format_of_suffix, formatter
from spml_cache.report.tables import Table, build_table, by_metric
from spml_cache.report.terminal import print_comparisons, print_notes, print_table
from spml_cache.runs import replace_atomically
from spml_cache.runtime.devices import single_threaded
from spml_cache.runtime.errors import SpmlError, finished


def print_report(run_dirs: list[Path], *, paper: bool = False, console: Console | None = None) -> None:
    """The table of every run in `run_dirs` (run directories or folders of them; [] means ./runs)."""
    print_table(build_table(collect_runs(run_dirs), paper=paper), console or Console())


def report_command(options: ReportOptions, console: Console) -> None:
    """`spml-cache report`: what the flags say together checked first (each flag checked itself as the options
    were built), then the table (terminal or file), then the figures."""
    paths, runs_root, paper, fmt, output = options.run_dirs, options.runs_root, options.paper, options.fmt, options.output
    plots_dir, pivot, metric, pair = options.plots_dir, options.pivot, options.metric, options.pair
    if paper and metric != MAP:
        raise SpmlError(f"--paper: the papers publish mAP only; leave out --paper or --metric {options.metric}")
    if output is not None and fmt is None:
        fmt = format_of_suffix(output)
    render = formatter(fmt) if fmt is not None else None
    files = _figure_files(options)
    if plots_dir is not None:
        require_matplotlib()
    runs = collect_runs(paths, runs_root=runs_root)
    table = _measured(build_table(runs, paper=paper), options, metric, pair, every=fmt in EVERY_METRIC)
    table = pivot_backbone(table) if pivot == "backbone" else table
    if render is None:
        print_table(table, console)
    elif output is None:
        console.out(render(table), highlight=False, end="")
        if fmt == "csv":  # a CSV has no place for them: on stderr, so that stdout stays one CSV
            print_comparisons(table, Console(stderr=True))
    else:
        with _writing("--out", output):
            output.parent.mkdir(parents=True, exist_ok=True)
            replace_atomically(output, lambda file: file.write(render(table).encode("utf-8")))
        console.print(f"wrote {escape(str(output))} ({len(table.rows)} losses x {len(table.columns)} columns)")
        print_notes(table, console)
        print_comparisons(table, console)
    if plots_dir is not None:
        with _writing("--plots", plots_dir):
            written = [plot_backbones(require_matplotlib(), table, plots_dir, files)] if pivot else \
                plot_runs(runs, plots_dir, compare=pair, console=console, files=files)
        finished()  # every figure is written: a stop now has nothing to stop
        for path in written:
            console.print(f"wrote {escape(str(path))}")


def _figure_files(options: ReportOptions) -> FigureFiles:
    """The figures' width, format and resolution; any of their flags without --plots is refused (there is nothing
    to apply it to)."""
    given = [flag for flag, value in (("--figure-width", options.figure_width),
                                      ("--figure-format", options.figure_format), ("--dpi", options.dpi))
             if value is not None]
    if given and options.plots_dir is None:
        raise SpmlError(f"{' and '.join(given)}: only with --plots DIR (the folder the figures go into)")
    return FigureFiles((options.figure_format or DEFAULT_FORMAT).lower(),
                       DEFAULT_DPI if options.dpi is None else options.dpi, figure_width(options.figure_width))


def _measured(table: Table, options: ReportOptions, metric: str, pair, every: bool) -> Table:
    """`table` with the metrics beside mAP (for a file of `every` metric, or when `metric` is another), the table's
    metric, its intervals (--ci) and the paired comparison (--compare), from the runs' stored test scores."""
    tests = StoredTests()
    table.metric = metric
    with single_threaded(torch.device("cpu")):  # small tensor ops: a second thread only waits (devices.py)
        if every or metric != MAP:
            add_metrics(table, tests)
        if metric != MAP:
            by_metric(table, metric)
        if options.ci or pair is not None:
            resampling = Resampling(options.resamples, tests, metric)
            if options.ci:
                add_intervals(table, resampling)
            if pair is not None:
                table.comparisons = compare(table, pair, resampling)
    return table


@contextmanager
def _writing(flag: str, path: Path):
    """A file system refusal (read-only folder, a file where a folder should be, a full disk) as one line."""
    try:
        yield
    except OSError as err:
        where = Path(err.filename) if err.filename else path
        raise SpmlError(f"{flag} {path}: cannot write {where} ({err.strerror or err}); pick a writable place") from None
