"""The report: Table-1 style tables beside the published numbers, and figures, from run directories.

Its door is `report_command` (`spml-cache report`); `print_report` and `write_plots` serve the demo and scripts.
Reads only the files the stages write, never their objects.
`sc.report(...)` (face.py: keywords named as the flags, a `ReportTable` back) is this package called.
"""

from spml_cache.report.collect import Run, collect_runs, read_run, select_newest
from spml_cache.report.command import ReportOptions, print_report, report_command
from spml_cache.report.plots import write_plots
from spml_cache.report.tables import build_table, cell_text
from spml_cache.report.terminal import print_table
from spml_cache.report.face import ReportTable, report as face_door
from spml_cache.options.keywords import callable_stage

__all__ = [
    "ReportOptions", "ReportTable", "Run", "build_table", "cell_text", "collect_runs", "print_report", "print_table", "read_run", "report_command",
    "select_newest", "write_plots",
]

callable_stage(__name__, face_door)
