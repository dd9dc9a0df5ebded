"""`spml-cache report --format tex`: the table as a LaTeX `tabular` with booktabs' rules, to `\\input` into a
paper's own `table` float (its caption is the paper's to write).

The cells are the terminal table's: the table's metric, `$\\pm$` the seeds' spread, the bootstrap interval with
--ci, the best single-positive loss of each column in bold (as Markdown's `**`), `--paper`'s published number and
difference beside the columns that have them. The columns are grouped by dataset under its name (a `\\multicolumn`
over its columns, a `\\cmidrule` under it), each headed by the rest of its label (`linear`, `fine-tuned`); the
losses are named as their papers write them (`AN-LS`, `EM+APL`). Names are escaped (`my_set`, `R&D`, `50%`,
`#1`), the oracles are set apart by a `\\midrule` as the papers set them, and what the terminal prints under the
table (what a cell holds, the notes, --compare's differences) comes first as `%` comments. Needs
`\\usepackage{booktabs}`.
"""

from __future__ import annotations

import re

from spml_cache.report.collect import DATASET_LABELS, Column
from spml_cache.report.tables import ZERO_SHOT, Cell, CellStyle, Table, cell_text, footnotes, heading, row_name

SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
           "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "<": r"\textless{}",
           ">": r"\textgreater{}", "|": r"\textbar{}"}
_SPECIAL = re.compile("|".join(re.escape(character) for character in SPECIAL))


def escape(text: str) -> str:
    """`text` as LaTeX typesets it literally (every special character in one pass, so none is escaped twice)."""
    return _SPECIAL.sub(lambda found: SPECIAL[found.group(0)], text)


TYPESET = CellStyle(missing="--", spread=r" $\pm$ ", below_start=r" $\downarrow$", diverged=r" $^\dagger$",
                    swept="{key} = {value:g}", between=", ", name=escape)


def cell_tex(cell: Cell | None) -> str:
    """A cell as the terminal shows it, typeset: `85.00 $\\pm$ 0.82 [84.10, 85.90]`, bold where best."""
    text = cell_text(cell, TYPESET)
    return rf"\textbf{{{text}}}" if cell is not None and cell.mean is not None and cell.best else text


def by_dataset(columns: list[Column]) -> list[tuple[str, list[tuple[Column, str]]]]:
    """The columns grouped by dataset, in the order the datasets first come (within one, the table's order), each
    with what its label says beside the dataset's name (`linear`, `fine-tuned [vit_b_16]`; a pivot's backbone)."""
    groups: dict[str, list[tuple[Column, str]]] = {}
    for column in columns:
        name = DATASET_LABELS.get(column.dataset, column.dataset)
        rest = column.label[len(name) + 1:] if column.label.startswith(f"{name} ") else column.label
        groups.setdefault(name, []).append((column, rest))
    return list(groups.items())


def _header(groups, published: set[str]) -> list[str]:
    """The two header rows, a dataset's name over its columns (booktabs' `\\cmidrule` under each), then theirs."""
    top, spans, below, first = [""], [], ["Loss"], 2
    for name, members in groups:
        width = sum(3 if column.label in published else 1 for column, _ in members)
        top.append(rf"\multicolumn{{{width}}}{{c}}{{{escape(name)}}}")
        spans.append(rf"\cmidrule(lr){{{first}-{first + width - 1}}}")
        below += [item for column, rest in members
                  for item in [escape(rest)] + (["Paper", r"$\Delta$"] if column.label in published else [])]
        first += width
    return [_row(top), " ".join(spans), _row(below)]


def to_latex(table: Table) -> str:
    published = {label for _, cells in table.rows for label, cell in cells.items() if cell.paper is not None}
    groups = by_dataset(table.columns)
    columns = [column for _, members in groups for column, _ in members]
    width = 1 + sum(3 if column.label in published else 1 for column in columns)
    lines = [f"% {line}" for line in _comments(table)]
    lines += [r"\begin{tabular}{l" + "r" * (width - 1) + "}", r"\toprule", *_header(groups, published), r"\midrule"]
    previous = None
    for loss, cells in table.rows:
        if previous in table.oracles and loss not in table.oracles or loss == ZERO_SHOT and previous is not None:
            lines.append(r"\midrule")  # the papers' break after the oracles; the zero-shot reference apart
        row = [escape(row_name(table, loss))]
        for column in columns:
            cell = cells.get(column.label)
            row.append(cell_tex(cell))
            if column.label in published:
                has_paper = cell is not None and cell.paper is not None
                row += [str(cell.paper), f"{cell.diff:+.2f}"] if has_paper else ["", ""]
        lines.append(_row(row))
        previous = loss
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def _row(cells: list[str]) -> str:
    return " & ".join(cells) + r" \\"


def _comments(table: Table) -> list[str]:
    """What the terminal prints around the table, one comment line each (LaTeX skips a comment whole)."""
    found = [r"spml-cache report --format tex: needs \usepackage{booktabs}; bold: " + (
        "the best single-positive loss per column (oracles excluded)" if table.rows else "none"), heading(table)]
    found += footnotes(table)[1:] if table.rows else footnotes(table)
    found += [comparison.text() for comparison in table.comparisons]
    return [" ".join(line.split()) for line in found]  # a note's own line breaks would end the comment
