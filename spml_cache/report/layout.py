"""Room for the figures' headings: titles wrapped at spaces to the width they have (none is cut off at the
figure's edge), and a suptitle above every panel's title (`tight_layout` alone leaves the panels' titles
touching a suptitle of two lines)."""

from __future__ import annotations

import textwrap

GAP = 0.008  # of the figure's height, between the suptitle and the panels' titles
GLYPH_EM = 0.6  # DejaVu Sans (matplotlib's default) averages under 0.6 em per character of these titles


def wrapped(text: str, figure, fontsize: float = 12.0, share: float = 1.0) -> str:
    """`text` with its lines wrapped at spaces to fit `share` of the figure's width at `fontsize` points (12:
    matplotlib's default title size)."""
    per_line = max(20, int(figure.get_figwidth() * 72 * share * 0.95 / (fontsize * GLYPH_EM)))
    return "\n".join(textwrap.fill(line, per_line) for line in text.split("\n"))


def under_suptitle(figure, heading) -> None:
    """Lay the panels of `figure` out below `heading` (what `figure.suptitle` returned): tight_layout, then the
    panels moved down by as much as their titles still reach into it."""
    figure.tight_layout()
    height = figure.bbox.height
    tops = [axes.title.get_window_extent().y1 for axes in figure.axes if axes.get_title()]
    reach = max(tops, default=0.0) - heading.get_window_extent().y0 + GAP * height
    if reach > 0:
        figure.tight_layout(rect=(0, 0, 1, 1 - reach / height))


def legend_below(figure, legend) -> None:
    """Lay `figure` out above `legend`, anchored at the bottom centre of the figure: tight_layout over all but a
    strip as tall as the legend is drawn (measured, whatever its rows), so that no axis label lands on it."""
    legend.set_in_layout(False)
    strip = (legend.get_window_extent().height + GAP * figure.bbox.height) / figure.bbox.height
    figure.tight_layout(rect=(0, strip, 1, 1))


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`1 loss`, `4 losses`: a count with its noun in the number it takes."""
    if count != 1:
        noun = plural or (noun + "es" if noun.endswith(("s", "x", "ch", "sh")) else noun + "s")
    return f"{count} {noun}"
