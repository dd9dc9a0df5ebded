"""`spml-cache report`: the table (terminal or file) and the figures of the runs asked for."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape

from spml_cache.options.report import ReportOptions, figure_width
from spml_cache.report.collect import collect_runs
from spml_cache.report.confidence import Resampling, add_intervals, compare
from spml_cache.report.figure_files import DEFAULT_DPI, DEFAULT_FORMAT, FigureFiles
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
    fmt, files = prepared(options)
    render = formatter(fmt) if fmt is not None else None
    runs = collect_runs(options.run_dirs, runs_root=options.runs_root)
    table = tabulate(options, runs, every=fmt in EVERY_METRIC)
    if render is None:
        print_table(table, console)
    elif options.output is None:
        console.out(render(table), highlight=False, end="")
        if fmt == "csv":  # a CSV has no place for them: on stderr, so that stdout stays one CSV
            print_comparisons(table, Console(stderr=True))
    else:
        write_table(table, fmt, options.output, console)
    if options.plots_dir is not None:
        written = write_figures(table, runs, options, files, console)
        finished()  # every figure is written: a stop now has nothing to stop
        for path in written:
            console.print(f"wrote {escape(str(path))}")


def prepared(options: ReportOptions) -> tuple[str | None, FigureFiles]:
    """What the flags say together, checked before any run is read: the table's format (--format, else --out's
    suffix; None: the terminal's) and the figures' files."""
    if options.paper and options.metric != MAP:
        raise SpmlError(f"--paper: the papers publish mAP only; leave out --paper or --metric {options.metric}")
    fmt = options.fmt
    if options.output is not None and fmt is None:
        fmt = format_of_suffix(options.output)
    files = _figure_files(options)
    if options.plots_dir is not None:
        require_matplotlib()
    return fmt, files


def tabulate(options: ReportOptions, runs: list, every: bool) -> Table:
    """The table of `runs` the options ask for: its cells, their metrics (`every` one, for csv, md and json), the
    intervals and the comparison, pivoted with --pivot."""
    table = _measured(build_table(runs, paper=options.paper), options, options.metric, options.pair, every=every)
    return pivot_backbone(table) if options.pivot == "backbone" else table


def write_table(table: Table, fmt: str, output: Path, console: Console) -> None:
    """`--out FILE`: the table rendered as `fmt`, written atomically; then its notes and comparisons."""
    with _writing("--out", output):
        output.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(output, lambda file: file.write(formatter(fmt)(table).encode("utf-8")))
    console.print(f"wrote {escape(str(output))} ({len(table.rows)} losses x {len(table.columns)} columns)")
    print_notes(table, console)
    print_comparisons(table, console)


def write_figures(table: Table, runs: list, options: ReportOptions, files: FigureFiles, console: Console) -> list[Path]:
    """`--plots DIR`: the figures of `runs` (with --pivot, the table's own), their paths."""
    plots_dir = options.plots_dir
    with _writing("--plots", plots_dir):
        if options.pivot:
            return [plot_backbones(require_matplotlib(), table, plots_dir, files)]
        return plot_runs(runs, plots_dir, compare=options.pair, console=console, files=files)


def _figure_files(options: ReportOptions) -> FigureFiles:
    """The figures' width, format and resolution; any of their flags without --plots is refused (there is nothing
    to apply it to)."""
    given = [flag for flag, value in (("--figure-width", options.figure_width),
                                      ("--figure-format", options.figure_format), ("--dpi", options.dpi))
             if value is not None]
    if given and options.plots_dir is None:
        raise SpmlError(f"{' and '.join(given)}: only with --plots DIR (the folder the figures go into)")
    return FigureFiles(options.figure_format or DEFAULT_FORMAT,
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
