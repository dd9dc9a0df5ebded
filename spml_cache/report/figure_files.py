"""How `spml-cache report --plots` writes its figures: the width (`--figure-width column|text|INCHES`), format
(`--figure-format png|pdf|svg`) and resolution (`--dpi`), one for every figure, each file written through a
temporary name and renamed whole.

Every figure is laid out at the width asked for, the size it will be printed at: a two-column paper's column
(3.3 in) or its text width (6.9 in, the default), or any width in inches; its height follows from what it holds.
At that size no text is under `MIN_POINTS` (7 pt, what conference templates ask of figure text), so a figure is
included at its own size, never scaled down. PNG is 300 dpi by default, the resolution journals ask of raster
figures at their printed size. PDF and SVG are vector: `--dpi` sets only the
resolution of what a vector file would rasterise (none of the report's figures has such a part). PDF embeds its
fonts as TrueType (Type 42), not matplotlib's default Type 3, which conference submission checks refuse; PDF and
SVG leave out their creation date, so the same runs give the same files.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from spml_cache.options.report import DEFAULT_WIDTH, WIDTH_RANGE, WIDTHS  # declared there; the figures read them here
from spml_cache.runs import replace_atomically

DEFAULT_FORMAT = "png"
DEFAULT_DPI = 300
MIN_POINTS = 7  # the smallest text of any figure at its saved size (tests/figure_support.py checks every figure)
_UNDATED = {"pdf": {"CreationDate": None}, "svg": {"Date": None}}


@dataclass(frozen=True)
class FigureFiles:
    """The width, format and resolution of the figures' files (each checked by its option's declaration,
    options/report.py: `WIDTH_RANGE`, `FIGURE_FORMATS`, `DPI_RANGE`)."""

    format: str = DEFAULT_FORMAT
    dpi: int = DEFAULT_DPI
    width: float = WIDTHS[DEFAULT_WIDTH]  # inches (`figure_width` reads the flag)

    def path(self, folder: Path, stem: str) -> Path:
        return folder / f"{stem}.{self.format}"

    def write(self, path: Path, figure) -> None:
        """`figure` at its own size into `path`, whole or not at all."""
        from matplotlib import rc_context

        with rc_context({"pdf.fonttype": 42, "ps.fonttype": 42}):
            replace_atomically(path, lambda file: figure.savefig(
                file, format=self.format, dpi=self.dpi, metadata=_UNDATED.get(self.format)))


@contextmanager
def names_as_text():
    """Within it (or a function it decorates) matplotlib makes every text it is given to be drawn as written: a `$`
    in a class, loss or dataset name is a dollar sign, never the start of mathtext (a class `$5-$10` was drawn
    "5 - 10", and one named `$\\frac{1}{0$` raised mathtext's ParseException and left no figure). The mathtext
    matplotlib's own tick formatters write (10^2 on a log axis) is drawn as such by `report_figure`'s figures,
    which every drawing here makes. Without matplotlib it does nothing: the figures' own check says what to
    install."""
    try:
        from matplotlib import rc_context
    except ImportError:
        yield
        return
    with rc_context({"text.parse_math": False}):  # read by each text as it is made
        yield


# What matplotlib's own formatters write as tick labels and offsets where they use mathtext: `$\mathdefault{...}$`.
FORMATTERS_MATH = re.compile(r"\$\\mathdefault\{.*\}\$", re.DOTALL)


@cache
def report_figure():
    """matplotlib's Figure whose texts are drawn as written (`names_as_text`), the mathtext of matplotlib's own
    tick formatters apart, at every layout and drawing (a tick's label is set anew from its formatter at each)."""
    from matplotlib.figure import Figure
    from matplotlib.text import Text

    def as_written(figure) -> None:
        for axes in figure.axes:
            for axis in (axes.xaxis, axes.yaxis):
                axis.get_ticklabels(which="both")  # the ticks as they are drawn now: made, their texts set
        for text in figure.findobj(Text):
            text.set_parse_math(bool(FORMATTERS_MATH.fullmatch(text.get_text())))

    class ReportFigure(Figure):
        def tight_layout(self, *args, **kwargs):
            as_written(self)
            return super().tight_layout(*args, **kwargs)

        def draw(self, renderer):
            as_written(self)
            return super().draw(renderer)

    return ReportFigure
