"""Figures checked as they are saved, from matplotlib's own layout: every text drawn is at least `MIN_POINTS`
high, inside the figure, clear of every other text and of every legend it is not part of.

`layout_faults(figure, save)` renders the figure once (`save(figure)`: the report's own writer, or an Agg canvas
at the figure's size), records each text as it is actually drawn (tick labels outside the view and empty texts
are never drawn, so they are not judged) with its extent from that renderer, and returns one line per fault (an
empty list: the figure is clean).
"""

from __future__ import annotations

from itertools import combinations
from unittest import mock

MIN_POINTS = 7.0
SLACK_PX = 0.5  # extents are rounded to pixels: touching boxes may share half of one


def _draw(figure) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure).draw()


def drawn_texts(figure, save=_draw):
    """[(text, extent)] of every non-empty text `save(figure)` draws, [(legend, extent)] of the legends, and the
    figure's (width, height) in pixels as drawn."""
    from matplotlib.legend import Legend
    from matplotlib.text import Text

    texts, legends, size = {}, {}, []  # by id: a writer may draw the figure twice (the last drawing is saved)
    draw_text, draw_legend = Text.draw, Legend.draw

    def text_drawn(text, renderer):
        draw_text(text, renderer)
        if text.get_visible() and text.get_text().strip():
            texts[id(text)] = (text, text.get_window_extent(renderer))
            size[:] = [text.figure.bbox.width, text.figure.bbox.height]

    def legend_drawn(legend, renderer):
        draw_legend(legend, renderer)
        if legend.get_visible():
            legends[id(legend)] = (legend, legend.get_window_extent(renderer))

    with mock.patch.object(Text, "draw", text_drawn), mock.patch.object(Legend, "draw", legend_drawn):
        save(figure)
    return list(texts.values()), list(legends.values()), tuple(size)


def _overlap(a, b) -> bool:
    return min(a.x1, b.x1) - max(a.x0, b.x0) > SLACK_PX and min(a.y1, b.y1) - max(a.y0, b.y0) > SLACK_PX


def layout_faults(figure, save=_draw) -> list[str]:
    """What a reader of the saved figure would trip over, one line each."""
    texts, legends, (width, height) = drawn_texts(figure, save)
    faults = []
    for text, box in texts:
        name = repr(text.get_text()[:40])
        if text.get_fontsize() < MIN_POINTS:
            faults.append(f"{name} is {text.get_fontsize():g} pt, under {MIN_POINTS:g}")
        if box.x0 < -SLACK_PX or box.y0 < -SLACK_PX or box.x1 > width + SLACK_PX or box.y1 > height + SLACK_PX:
            faults.append(f"{name} reaches outside the figure ({box.bounds} in {width:g} x {height:g})")
    for (first, a), (second, b) in combinations(texts, 2):
        if _overlap(a, b):
            faults.append(f"{first.get_text()[:40]!r} overlaps {second.get_text()[:40]!r}")
    for legend, frame in legends:
        own = {id(text) for text in [*legend.get_texts(), legend.get_title()]}
        for text, box in texts:
            if id(text) not in own and _overlap(frame, box):
                faults.append(f"{text.get_text()[:40]!r} is drawn over a legend")
    for (_, a), (_, b) in combinations(legends, 2):
        if _overlap(a, b):
            faults.append("two legends overlap")
    return faults
