"""The table's file formats by name (`report --format`, or `--out`'s suffix): csv, md and json carry every metric
(report/tables.py), tex is the table as a paper sets it (report/latex.py)."""

from __future__ import annotations

from pathlib import Path

from spml_cache.report.latex import to_latex
from spml_cache.report.tables import to_csv, to_json, to_markdown
from spml_cache.runtime.errors import SpmlError

FORMATS = {"csv": to_csv, "md": to_markdown, "json": to_json, "tex": to_latex}
EVERY_METRIC = ("csv", "md", "json")  # the formats that carry every metric beside the table's
SUFFIXES = {".csv": "csv", ".md": "md", ".json": "json", ".tex": "tex"}


def formatter(fmt: str):
    """The function that renders a table as `fmt` (one of `options.report.TABLE_FORMATS`, checked by `--format`'s
    declaration)."""
    return FORMATS[fmt]


def format_of_suffix(output: Path) -> str:
    """`--out FILE`'s format when --format is not given, from its suffix."""
    fmt = SUFFIXES.get(output.suffix.lower())
    if fmt is None:
        raise SpmlError(f"--out {output}: cannot tell the format from the suffix; add --format {'|'.join(FORMATS)}")
    return fmt
