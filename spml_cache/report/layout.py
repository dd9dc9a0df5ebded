"""The figures' layout at the width they are printed at (report/figure_files.py): text sizes set on each text
(tick labels and legends `MIN_POINTS`, axis labels and panel titles `LABEL_POINTS`, a figure's heading
`TITLE_POINTS`), panels as many side by side as the width holds, heights from what each holds, titles wrapped at
spaces to the width they have (none is cut off at the figure's edge). The figures are made with
`layout="constrained"`, which keeps a suptitle above every panel's title and room for a legend under an axes'
x label (`legend_under`)."""

from __future__ import annotations

import math
import textwrap

from spml_cache.report.figure_files import MIN_POINTS

GLYPH_EM = 0.6  # DejaVu Sans (matplotlib's default) averages under 0.6 em per character of these titles
LABEL_POINTS = 8  # axis labels and panel titles
TITLE_POINTS = 9  # a figure's heading (its suptitle, or its one axes' title)
LINE_SPACING = 1.3  # a text line's height in ems, with its leading
LEGEND_DROP = 31  # points from an axes' bottom to a legend under it: the ticks and tick labels, the x label
TICKS_AND_LABEL = 0.5  # inches under an axes for its ticks, tick labels and x label (and as much beside it)
AXES_SHARE = 0.75  # of a figure's width, what one axes' title has beside the y labels (a title centres on its axes)


def line_height(points: float, lines: int = 1) -> float:
    """Inches that `lines` lines of text at `points` take."""
    return lines * points * LINE_SPACING / 72


def legend_height(entries: list[str]) -> float:
    """Inches a legend of `entries` (each one line or more) takes at MIN_POINTS: their lines, and matplotlib's half
    an em between entries (`legend.labelspacing`) and at its border."""
    lines = sum(entry.count("\n") + 1 for entry in entries)
    return (lines * 1.25 + (len(entries) + 1) * 0.5) * MIN_POINTS / 72


def set_height(figure, inches: float) -> None:
    """`figure` `inches` high, rounded up to a tenth of an inch (its width kept): a size a paper's figure is given
    as, and a whole number of pixels at any dpi that is a multiple of 10."""
    figure.set_size_inches(figure.get_figwidth(), math.ceil(round(inches * 10, 6)) / 10)


def side_by_side(width: float, count: int, least: float) -> int:
    """How many panels of at least `least` inches a figure `width` inches wide holds in a row (1 at least, `count`
    at most)."""
    return max(1, min(count, int(width // least)))


def paper_text(figure, labels: float = LABEL_POINTS) -> None:
    """Each axes' tick labels at MIN_POINTS, its axis labels and title at `labels` points, set on the texts
    themselves (rcParams are read when a text is made), so that the figure reads the same however it is drawn. A
    log axis is labelled 0.01, 100, not 10^2 (a superscript is set at 70% of its text's size: 4.9 pt), at its
    decades only."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    for axes in figure.axes:
        axes.tick_params(labelsize=MIN_POINTS)
        for text in (axes.xaxis.label, axes.yaxis.label, axes.title):
            text.set_fontsize(labels)
        for axis in (axes.xaxis, axes.yaxis):
            if axis.get_scale() == "log":
                axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
                axis.set_minor_formatter(NullFormatter())


def legend_under(axes, **options):
    """The legend of `axes`, centred under its x label, without a frame: with a figure made with
    `layout="constrained"`, the layout keeps room for it (an axes' legend outside it counts there)."""
    from matplotlib.transforms import ScaledTranslation

    drop = ScaledTranslation(0, -LEGEND_DROP / 72, axes.figure.dpi_scale_trans)
    return axes.legend(loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=axes.transAxes + drop,
                       fontsize=MIN_POINTS, frameon=False, **options)


def fitted(text: str, inches: float, points: float = MIN_POINTS) -> str:
    """`text` wrapped at spaces to `inches` at `points` (a legend's entry: it may not reach past its panel)."""
    per_line = max(12, int(inches * 72 * 0.95 / (points * GLYPH_EM)))
    return "\n".join(textwrap.fill(line, per_line) for line in text.split("\n"))


def wrapped(text: str, figure, fontsize: float = 12.0, share: float = 1.0) -> str:
    """`text` with its lines wrapped at spaces to fit `share` of the figure's width at `fontsize` points (12:
    matplotlib's default title size)."""
    per_line = max(20, int(figure.get_figwidth() * 72 * share * 0.95 / (fontsize * GLYPH_EM)))
    return "\n".join(textwrap.fill(line, per_line) for line in text.split("\n"))


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`1 loss`, `4 losses`: a count with its noun in the number it takes."""
    if count != 1:
        noun = plural or (noun + "es" if noun.endswith(("s", "x", "ch", "sh")) else noun + "s")
    return f"{count} {noun}"
