"""`sc.report(...)`: the report from Python, its keywords named as `spml-cache report`'s flags (options/keywords.py),
giving back the table as an object: its rows as plain data, and every format the command line writes, by the
command line's own formatters (formats.py, tables.py, latex.py), so that `to_csv()` is `report --format csv`'s
output, byte for byte."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from spml_cache.options.keywords import documented, from_flag_keywords, no_positional
from spml_cache.options.report import ReportOptions
from spml_cache.report.collect import Run, collect_runs
from spml_cache.report.command import prepared, tabulate, write_figures, write_table
from spml_cache.report.formats import EVERY_METRIC, formatter
from spml_cache.report.tables import Table, footnotes
from spml_cache.runtime.errors import SpmlError
from spml_cache.runtime.progress import door_console


class ReportTable:
    """The report's table of the runs asked for: `rows` (one plain dict per loss and column), `columns`, `notes`;
    `to_markdown()`, `to_latex()`, `to_csv()`, `to_json()` (each what `spml-cache report --format md|tex|csv|json`
    writes), `to_pandas()` (the rows as a DataFrame, where pandas is installed) and `plots(folder)` (the figures
    `--plots` writes). A notebook shows it as its Markdown."""

    def __init__(self, options: ReportOptions, runs: list[Run], console: Console) -> None:
        self.options, self.runs, self._console = options, runs, console
        self._tables: dict[bool, Table] = {}

    def table(self, every: bool = True) -> Table:
        """The report's own `Table` (report/tables.py); `every`: with every metric beside the table's (what csv, md
        and json carry; the terminal's and tex's table compute only its own)."""
        if every not in self._tables:
            self._tables[every] = tabulate(self.options, self.runs, every)
        return self._tables[every]

    @property
    def rows(self) -> list[dict]:
        """One dict per loss and column (a tidy table): the loss, whether it is an oracle, the column's label,
        dataset, stage, backbone, weights, rule and cache id, then the cell: `mean` and `std` of the table's
        metric over seeds, `seeds`, `best` (the column's best single-positive loss), `paper` and `diff` (with
        `paper=True`), `interval` (with `ci=True`), `start` (a fine-tuning's epoch 0), `swept` (the selected
        swept values), `run` (its run directory), `key` (the result's key in it) and `metrics` ({name: [mean,
        std]} of every metric)."""
        table = self.table()
        columns = {column.label: column for column in table.columns}
        found = []
        for loss, cells in table.rows:
            for label, cell in cells.items():
                column = vars(columns[label])
                found.append({"loss": loss, "oracle": loss in table.oracles, "column": label,
                              **{key: value for key, value in column.items() if key != "label"},
                              **_cell_data(cell)})
        return found

    @property
    def columns(self) -> list[dict]:
        """Each column: its label, dataset, stage, cache id, weights, rule and backbone."""
        return [dict(vars(column)) for column in self.table().columns]

    @property
    def notes(self) -> list[str]:
        """What the command line prints under the table: the best marks, the notes, the runs left out."""
        return footnotes(self.table())

    def to_markdown(self) -> str:
        """The table as `spml-cache report --format md` writes it (with every metric's table after it)."""
        return self._rendered("md")

    def to_latex(self) -> str:
        """The table as `spml-cache report --format tex` writes it: a booktabs `tabular`, notes as comments."""
        return self._rendered("tex")

    def to_csv(self) -> str:
        """The table as `spml-cache report --format csv` writes it: one row per loss, every metric's columns."""
        return self._rendered("csv")

    def to_json(self) -> str:
        """The table as `spml-cache report --format json` writes it."""
        return self._rendered("json")

    def to_pandas(self):
        """`rows` as a pandas DataFrame, each metric of `metrics` a column of its own (`cf1`, `cf1 std`); pivot it
        as a paper's table: `frame.pivot(index="loss", columns="column", values="mean")`."""
        try:
            import pandas
        except ImportError:
            raise SpmlError("to_pandas needs pandas: pip install pandas (or use .rows, plain dicts)") from None
        flat = []
        for row in self.rows:
            metrics = row.pop("metrics") or {}
            for name, (mean, std) in metrics.items():
                row[name], row[f"{name} std"] = mean, std
            flat.append(row)
        return pandas.DataFrame(flat)

    def plots(self, folder: Path | str, *, figure_format: str | None = None, dpi: int | None = None,
              figure_width: str | float | None = None) -> list[Path]:
        """Write the figures `--plots FOLDER` writes (needs matplotlib); returns their paths.

        Parameters
        ----------
        folder : path
            Where the figures go (made if missing).
        figure_format : text
            png (the default), pdf or svg.
        dpi : whole number
            The figures' resolution, 50 to 600 (default 300).
        figure_width : text or number
            The width they are printed at: column (3.3 in), text (6.9 in, the default) or inches."""
        given = {"plots": folder, "figure_format": figure_format, "dpi": dpi, "figure_width": figure_width}
        (chosen,) = from_flag_keywords("plots", given, ReportOptions)
        options = replace(self.options, plots_dir=chosen.plots_dir, figure_format=chosen.figure_format, dpi=chosen.dpi,
                          figure_width=chosen.figure_width)
        _, files = prepared(options)
        return write_figures(self.table(False), self.runs, options, files, self._console)

    def _rendered(self, fmt: str) -> str:
        return formatter(fmt)(self.table(fmt in EVERY_METRIC))

    def __str__(self) -> str:
        return self._rendered(self.options.fmt or "md")

    def _repr_markdown_(self) -> str:
        return self.to_markdown()


def _cell_data(cell) -> dict:
    data = {key: copy.deepcopy(value) for key, value in vars(cell).items() if key != "run"}
    return {**data, "run": str(cell.run), "diff": cell.diff}


def report(*run_dirs, progress: bool = False, **keywords) -> ReportTable:
    """The report of the runs in `run_dirs` (run directories or folders of them; none: every run under `runs`) as
    a `ReportTable`: `spml-cache report` from Python. With `out`, the table is also written to that file (its
    format from `format` or the suffix), with `plots` the figures into that folder, as the command line does."""
    no_positional("sc.report", (), progress)
    if run_dirs:
        if "run_dirs" in keywords:
            raise SpmlError("sc.report: run directories given twice: by position and as run_dirs=; give one")
        keywords["run_dirs"] = [str(path) if isinstance(path, Path) else path for path in run_dirs]
    (options,) = from_flag_keywords("sc.report", keywords, ReportOptions, also=["progress"])
    shown = door_console(progress)
    fmt, files = prepared(options)
    made = ReportTable(options, collect_runs(options.run_dirs, runs_root=options.runs_root), shown)
    if options.output is not None:
        write_table(made.table(fmt in EVERY_METRIC), fmt, options.output, shown)
    if options.plots_dir is not None:
        write_figures(made.table(False), made.runs, options, files, shown)
    return made


documented(report, ReportOptions, varargs="run_dirs")
