"""`spml-cache report`'s options (`report.report_command`): which runs, the table's format, file and metric, the
figures, the intervals and the paired comparison; each declared once (its flag, default, help and check), so that
the command line builds `report` from them as it builds the stages' commands, without importing the report (and
torch). What two flags say together (--paper with another metric, --dpi without --plots) is the report's to
check."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Sequence

from spml_cache.options.declared import Options, at_least, between, option
from spml_cache.runtime.errors import SpmlError, unknown_name

TABLE_FORMATS = ("csv", "md", "json", "tex")  # report/formats.py renders each
PIVOTS = ("backbone",)
MAP = "map"
RANKINGS = ("map11", "lrap")  # VOC 2007's 11-point interpolated mAP (DINOv3's map_voc2007); MTEB's multi-label LRAP
DEFAULT_RESAMPLES = 1000
MIN_RESAMPLES = 100  # below this the 2.5th and 97.5th percentiles rest on two or three resamples
FIGURE_FORMATS = ("png", "pdf", "svg")  # report/figure_files.py writes each
DPI_RANGE = (50, 600)  # above 600, a 24-inch figure is a 14,400-pixel-wide PNG: a vector format serves better
WIDTHS = {"column": 3.3, "text": 6.9}  # inches: a two-column paper's column and text width (CVPR's, NeurIPS' 5.5)
DEFAULT_WIDTH = "text"
WIDTH_RANGE = (2.0, 24.0)  # inches: below 2 no panel holds its labels at 7 pt


def _read_format(value: str, flag: str) -> str:
    if value not in TABLE_FORMATS:
        raise SpmlError(f"{flag} {value}: {unknown_name('format', value, TABLE_FORMATS)}; use one of"
                        f" {', '.join(TABLE_FORMATS)}")
    return value


def _read_figure_format(value: str, flag: str) -> str:
    if not isinstance(value, str) or value.lower() not in FIGURE_FORMATS:
        raise SpmlError(f"{flag} {value}: use one of {', '.join(FIGURE_FORMATS)}")
    return value.lower()


def figure_width(text: str | float | None, flag: str = "--figure-width") -> float:
    """`--figure-width`'s value in inches: `column` (3.3), `text` (6.9, also when not given) or a number of inches
    within WIDTH_RANGE (from Python, a number too)."""
    given = str(DEFAULT_WIDTH if text is None else text).strip().lower()
    if given in WIDTHS:
        return WIDTHS[given]
    try:
        inches = float(given.removesuffix("in").strip())
    except ValueError:
        raise SpmlError(f"{flag} {text}: use column ({WIDTHS['column']} in), text ({WIDTHS['text']} in) or a width in"
                        " inches, e.g. 5.5") from None
    low, high = WIDTH_RANGE
    if not low <= inches <= high:
        raise SpmlError(f"{flag} {inches:g}: use {low:g} to {high:g} inches, or column ({WIDTHS['column']} in) or text"
                        f" ({WIDTHS['text']} in)")
    return inches


def _read_figure_width(value, flag: str) -> str:
    figure_width(value, flag)
    return str(value).strip().lower()


def _read_pivot(value: str, flag: str) -> str:
    if value not in PIVOTS:
        raise SpmlError(f"{flag} {value}: use backbone (rows losses, a column per backbone and feature kind)")
    return value


def parse_metric(text: str, flag: str = "--metric") -> str:
    """`--metric`'s value as a metric name: `map`, `cf1`, ..., or `cf1@K` (K >= 1: the top K labels per image)."""
    from spml_cache import metrics

    name, at, k = text.strip().lower().partition("@")
    if name in metrics.F1_FAMILY and (not at or k.isdigit() and int(k) >= 1):
        return f"{name}@{int(k)}" if at else name
    if name in (MAP, *RANKINGS) and not at:
        return name
    raise SpmlError(f"{flag} {text}: use {', '.join((MAP, *RANKINGS, *metrics.F1_FAMILY))}, or one of"
                    f" {', '.join(metrics.F1_FAMILY)} with @K for the top K labels of each image (e.g."
                    f" cf1@{metrics.TOP_K})")


def parse_compare(compare: str | None, flag: str = "--compare") -> tuple[str, str] | None:
    """`--compare a,b` as a pair of two different loss names (None when not given); a plugin spec is known by its
    class's name from here on."""
    from spml_cache import losses

    names = [losses.canonical(name.strip()) for name in (compare or "").split(",") if name.strip()]
    if compare is not None and (len(names) != 2 or names[0] == names[1]):
        raise SpmlError(f"{flag} {compare}: give two different loss names separated by a comma, e.g. an,role")
    return (names[0], names[1]) if names else None


@dataclass(frozen=True)
class ReportOptions(Options):
    """The flags of `spml-cache report`: which runs (`run_dirs`, none: every run under `runs_root`), the table's format
    and file, the figures' folder and files, `compare` (two losses: their paired difference per column, and the
    per-class figure's pair), `pivot` (the loss x backbone table of one dataset, pivot.py; with `plots_dir` its
    figure alone), the table's `metric`, and `ci` (bootstrap intervals from `resamples`)."""

    run_dirs: Sequence[Path] = option((), "Run directories or folders of them (default: every run under --runs).",
                                      argument=True, many=True, kind=Path)
    _: KW_ONLY
    runs_root: Path = option(Path("runs"), "Where to look for runs when none are named.", flag="--runs")
    paper: bool = option(False, "Add the papers' published numbers and our difference.", switch=True)
    fmt: str | None = option(None, "csv, md, json or tex (a LaTeX tabular with booktabs rules) instead of the terminal"
                             " table.", flag="--format", read=_read_format)
    output: Path | None = option(None, "Write the table to FILE (format from --format or the suffix: .csv, .md, .json,"
                                 " .tex).", flag="--out", kind=Path)
    plots_dir: Path | None = option(None, "Also write the figures into DIR (needs matplotlib).", flag="--plots",
                                    kind=Path)
    figure_format: str | None = option(None, "The figures' format: png (the default), pdf or svg (vector; pdf's fonts"
                                       " embedded as TrueType).", read=_read_figure_format)
    figure_width: str | None = option(None, "The figures' width as printed: column (3.3 in), text (6.9 in, the"
                                      " default) or inches, e.g. 5.5; each is laid out for it, every text at least 7"
                                      " pt there.", read=_read_figure_width)
    dpi: int | None = option(None, "The figures' resolution in dots per inch, 50 to 600 (default: 300; pdf and svg"
                             " are vector whatever it says).", kind=int, check=between(
                                 *DPI_RANGE, f"use {DPI_RANGE[0]} to {DPI_RANGE[1]} (for any size, --figure-format"
                                 " pdf or svg: vector)"))
    compare: str | None = option(
        None, "Two losses a,b, e.g. an,role: their paired difference a - b per dataset and stage (bootstrap interval,"
        " p-value), and the per-class AP figure's pair (default there: the best two).",
        read=lambda value, flag: ",".join(parse_compare(value, flag)))
    pivot: str | None = option(None, "backbone: one dataset's linear runs as losses x backbones (with their feature"
                               " kind); --plots then draws that table.", read=_read_pivot)
    metric: str = option(MAP, "The table's metric: map (the default), map11 (VOC07's 11-point interpolated mAP), lrap"
                         " (label ranking average precision), cp, cr, cf1, op, or, of1 (labels scoring 0.5 or more), or"
                         " one of those six with @K (cf1@3: of each image's K highest, those at 0.5 or more). csv, md"
                         " and json carry every one.", read=parse_metric)
    ci: bool = option(False, "Add each cell's 95% bootstrap interval over the test images (the same resamples for"
                      " every loss of a dataset).", switch=True)
    resamples: int = option(DEFAULT_RESAMPLES, "Bootstrap resamples of the test images for --ci and --compare"
                            f" (default: {DEFAULT_RESAMPLES:,}).", check=at_least(
                                MIN_RESAMPLES, fix=f"a 95% interval needs at least {MIN_RESAMPLES} resamples"
                                f" ({DEFAULT_RESAMPLES:,} by default)"))

    @property
    def pair(self) -> tuple[str, str] | None:
        """`compare`'s two losses (None: not given)."""
        return tuple(self.compare.split(",")) if self.compare else None
