"""The report's table on the terminal (rich): every cell and every column label whole at any width.

rich shares out a table's width without regard to the longest word of a column, and cuts what no longer fits
(`[resnet50+las…`, two long backbones' labels alike). So the widths are shared out here: each column gets at least
its longest word (the losses' column its longest name), the rest of the room goes where the text is longest; where
even that does not fit, a label also breaks after a backbone family's prefix (`[timm:`) and before a feature kind
(`+last4`); and a piece still wider than its column goes on at the next line, never cut.
"""

from __future__ import annotations

import re

from rich.console import Console
from rich.table import Table as RichTable
from rich.text import Text

from spml_cache.report.tables import Table, footnotes, heading, text_grid

FAMILY_PREFIX = re.compile(r"((?:^|[\[ ])[a-z]+:)")  # `timm:` in a column label's `[timm:vit_base...]`


def print_table(table: Table, console: Console) -> None:
    # Text, never markup: column labels hold backbones in brackets ([clip:ViT-B-32]) that markup would eat
    header, rows = text_grid(table, lambda text: Text(f"{text} *", style="bold green"))
    title = heading(table)
    rich_table = RichTable(title=title, title_justify="left", min_width=len(title))
    labels, widths = column_widths(header, [[str(cell) for cell in row] for row in rows], console.width)
    for i, label in enumerate(labels):  # the losses' names whole on their line: the cells wrap first
        rich_table.add_column(Text(label), justify="left" if i == 0 else "right", overflow="fold", no_wrap=i == 0,
                              style="dim" if label == "paper" else None, width=widths[i] if widths else None)
    losses = [loss for loss, _ in table.rows] + [None]
    for i, row in enumerate(rows):
        cells = [cell if isinstance(cell, Text) else Text(cell) for cell in row]
        # the papers' break between the oracles and the single-positive losses
        rich_table.add_row(*cells, end_section=losses[i] in table.oracles and losses[i + 1] not in table.oracles)
    console.print(rich_table if rows else "no complete runs to tabulate")
    print_notes(table, console)
    print_comparisons(table, console)


def column_widths(header: list[str], rows: list[list[str]], width: int) -> tuple[list[str], list[int] | None]:
    """The column labels (broken at a backbone's family prefix and feature kind where the words alone do not fit)
    and each column's width inside its padding; None where every text fits whole on one line and rich can lay
    the table out alone."""
    room = width - 3 * len(header) - 1  # each column's padding and rule, and the last rule
    least, most = _extent(header, rows)
    if sum(most) <= room:
        return header, None
    if sum(least) > room:
        header = [header[0], *(FAMILY_PREFIX.sub(r"\1\n", label).replace("+", "\n+") for label in header[1:])]
        least, most = _extent(header, rows)
    if sum(least) <= room:  # every word whole: the widest columns give up what they have beyond their longest word
        return header, _capped(least, most, room)
    return header, _capped([least[0]] + [1] * (len(least) - 1), most, room)  # the longest words go on below


def _capped(low: list[int], high: list[int], room: int) -> list[int]:
    """Widths from `low` to `high` per column, within `room` in all: each column up to one common cap, the highest
    that fits, so that narrow columns stay whole and only the widest give way."""
    for cap in range(max(high), 0, -1):
        widths = [max(lowest, min(highest, cap)) for lowest, highest in zip(low, high)]
        if sum(widths) <= room:
            return widths
    return low


def _extent(header: list[str], rows: list[list[str]]) -> tuple[list[int], list[int]]:
    """Per column, its narrowest width (the longest word; the losses' column: its longest name) and its widest
    (the longest line)."""
    columns = [[label, *(row[i] for row in rows)] for i, label in enumerate(header)]
    most = [max(len(line) for text in texts for line in text.split("\n")) for texts in columns]
    least = [most[0], *(max(len(word) for text in texts for word in text.split()) for texts in columns[1:])]
    return least, most


def print_notes(table: Table, console: Console) -> None:
    for note in footnotes(table):
        console.print(Text(note, style="dim"))  # Text: paths and names are not rich markup


def print_comparisons(table: Table, console: Console) -> None:
    for comparison in table.comparisons:
        console.print(Text(comparison.text()))
