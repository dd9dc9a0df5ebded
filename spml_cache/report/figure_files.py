"""How `spml-cache report --plots` writes its figures: the format (`--figure-format png|pdf|svg`) and resolution
(`--dpi`), one for every figure, each file written through a temporary name and renamed whole.

PNG is 300 dpi by default, the resolution journals ask of raster figures at their printed size (the figures are
laid out for use at their saved size: no text under `MIN_POINTS`). PDF and SVG are vector: `--dpi` sets only the
resolution of what a vector file would rasterise (none of the report's figures has such a part). PDF embeds its
fonts as TrueType (Type 42), not matplotlib's default Type 3, which conference submission checks refuse; PDF and
SVG leave out their creation date, so the same runs give the same files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spml_cache.runs import replace_atomically

DEFAULT_FORMAT = "png"
DEFAULT_DPI = 300
MIN_POINTS = 8  # the smallest text of any figure (tests/figure_support.py checks every figure against it)
_UNDATED = {"pdf": {"CreationDate": None}, "svg": {"Date": None}}


@dataclass(frozen=True)
class FigureFiles:
    """The format and resolution of the figures' files (each checked by its option's declaration, options/report.py:
    `FIGURE_FORMATS`, `DPI_RANGE`)."""

    format: str = DEFAULT_FORMAT
    dpi: int = DEFAULT_DPI

    def path(self, folder: Path, stem: str) -> Path:
        return folder / f"{stem}.{self.format}"

    def write(self, path: Path, figure) -> None:
        """`figure` at its own size into `path`, whole or not at all."""
        from matplotlib import rc_context

        with rc_context({"pdf.fonttype": 42, "ps.fonttype": 42}):
            replace_atomically(path, lambda file: figure.savefig(
                file, format=self.format, dpi=self.dpi, metadata=_UNDATED.get(self.format)))
