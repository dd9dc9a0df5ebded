"""`spml-cache report --format tex`: a booktabs tabular that LaTeX reads as written, its cells the table's (the best
bold where Markdown's are), names with LaTeX's special characters escaped. The structure is checked here by a
reader of its own; with pdflatex on the machine, the table is also compiled."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from cli_support import run_cli, run_main
from test_report import make_run, parse_markdown

from spml_cache import report
from spml_cache.report.latex import escape
from spml_cache.report.tables import to_markdown

ODD_LOSS = "focal_50%#&{x}"  # a plugin's name: LaTeX's special characters, every one to escape


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    make_run(root, "voc", "linear", {"bce": [90.0, 90.0], "an": [84.0, 86.0], "role": [86.0, 88.0]},
             stamp="20250101-000000")
    odd = make_run(root, "my_set", "finetune", {"an": [60.0], ODD_LOSS: [61.0]}, stamp="20250102-000000")
    results = json.loads((odd / "results.json").read_text())
    results["losses"]["an"].update(start={"test_map": 70.0})  # fine-tuning ended below its start: a down arrow
    (odd / "results.json").write_text(json.dumps(results))
    return root


def tabular(text: str) -> tuple[str, list[str], list[list[str]]]:
    """(column spec, rules in order, rows of cells) of the one tabular in `text`, read as LaTeX would: comment
    lines dropped, rows ended by `\\\\`, cells split at `&` that no backslash escapes."""
    body = "\n".join(line for line in text.splitlines() if not line.startswith("%"))
    found = re.fullmatch(r"\s*\\begin\{tabular\}\{([lcr]+)\}(.*)\\end\{tabular\}\s*", body, re.S)
    assert found, body
    spec, inner = found.groups()
    rules, rows = [], []
    for line in inner.strip().splitlines():
        if line in (r"\toprule", r"\midrule", r"\bottomrule") or line.startswith(r"\cmidrule"):
            rules.append((line, len(rows)))
            continue
        assert line.endswith(r" \\"), line
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)&", line[:-3])])
    return spec, rules, rows


def width(row: list[str]) -> int:
    """The columns a row spans: a `\\multicolumn{n}` cell spans n."""
    return sum(int(found.group(1)) if (found := re.match(r"\\multicolumn\{(\d+)\}", cell)) else 1 for cell in row)


def full_labels(top: list[str], below: list[str]) -> list[str]:
    """Each column's label as the other formats write it: its dataset's name (the group over it) and its own."""
    names = []
    for cell in top[1:]:
        span, name = re.fullmatch(r"\\multicolumn\{(\d+)\}\{c\}\{(.*)\}", cell).groups()
        names += [name] * int(span)
    return [below[0]] + [f"{name} {own}" for name, own in zip(names, below[1:])]


def balanced(cell: str) -> bool:
    depth = 0
    for character in re.sub(r"\\[{}]", "", cell):
        depth += {"{": 1, "}": -1}.get(character, 0)
        if depth < 0:
            return False
    return depth == 0


def test_the_tex_table_is_a_booktabs_tabular_of_the_table(runs, tmp_path):
    done = run_cli("report", "--format", "tex", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    spec, rules, rows = tabular(done.stdout)
    top, header, *body = rows
    assert spec == "l" + "r" * 2 and all(width(row) == len(spec) for row in rows)
    # grouped by dataset: its name over its columns, each headed by the rest of its label
    assert top == ["", r"\multicolumn{1}{c}{VOC}", r"\multicolumn{1}{c}{my\_set}"]
    assert header == ["Loss", "linear", "fine-tuned"]
    # booktabs: a rule above, one under each dataset's name, under the header, between the oracles and the rest, at
    # the end
    assert rules == [(r"\toprule", 0), (r"\cmidrule(lr){2-2} \cmidrule(lr){3-3}", 1), (r"\midrule", 2),
                     (r"\midrule", 3), (r"\bottomrule", len(rows))]
    cells = {row[0]: row[1:] for row in body}  # the losses as the papers name them; a plugin's by its own name
    assert cells["BCE (oracle)"] == [r"90.00 $\pm$ 0.00", "--"]  # an oracle: never bold
    assert cells["AN"] == [r"85.00 $\pm$ 1.00", r"60.00 $\downarrow$"]
    assert cells["ROLE"] == [r"\textbf{87.00 $\pm$ 1.00}", "--"]
    assert cells[r"focal\_50\%\#\&\{x\}"] == ["--", r"\textbf{61.00}"]
    assert all(balanced(cell) and not re.search(r"(?<!\\)[_%#&]", cell) for row in rows for cell in row)
    markdown_header, markdown_rows = parse_markdown(to_markdown(report.build_table(report.collect_runs([runs]))))
    bold_in_markdown = {(row[0], markdown_header[i]) for row in markdown_rows for i, c in enumerate(row) if "**" in c}
    labels = full_labels(top, header)
    bold_in_tex = {(row[0], labels[i]) for row in body for i, cell in enumerate(row) if r"\textbf" in cell}
    assert {(escape(loss), escape(label)) for loss, label in bold_in_markdown} == bold_in_tex
    comments = [line for line in done.stdout.splitlines() if line.startswith("%")]
    assert comments[0].startswith(r"% spml-cache report --format tex: needs \usepackage{booktabs}")
    assert any("fine-tuning ended below its start" in line for line in comments)


def test_tex_from_the_out_suffix_with_the_papers_numbers(runs, tmp_path, monkeypatch, capsys):
    code, err = run_main("report", "--paper", "--out", "table1.tex", cwd=tmp_path, monkeypatch=monkeypatch,
                         capsys=capsys)
    assert code == 0, err
    spec, _, (top, header, *body) = tabular((tmp_path / "table1.tex").read_text())
    assert top == ["", r"\multicolumn{3}{c}{VOC}", r"\multicolumn{1}{c}{my\_set}"]  # the paper's columns in VOC's
    assert header == ["Loss", "linear", "Paper", r"$\Delta$", "fine-tuned"] and len(spec) == 5
    assert {row[0]: row[1:4] for row in body}["AN"] == [r"85.00 $\pm$ 1.00", "84.2", "+0.80"]  # Cole et al., VOC
    code, err = run_main("report", "--out", "table1.txt", cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 1 and "add --format csv|md|json|tex" in err


def test_the_tex_table_groups_each_dataset_s_columns_under_its_name(tmp_path):
    """Terminal and Markdown order columns by stage, then dataset (VOC linear, COCO linear, VOC fine-tuned); the
    paper's table groups them by dataset: VOC's linear and fine-tuned side by side, then COCO's."""
    for dataset, stage, stamp in (("voc", "linear", "20250101-000000"), ("coco", "linear", "20250102-000000"),
                                  ("voc", "finetune", "20250103-000000")):
        make_run(tmp_path / "runs", dataset, stage, {"an": [80.0], "em_apl": [82.0]}, stamp=stamp)
    table = report.build_table(report.collect_runs([tmp_path / "runs"]))
    assert [column.label for column in table.columns] == ["VOC linear", "COCO linear", "VOC fine-tuned"]
    spec, rules, (top, header, *body) = tabular(report.latex.to_latex(table))
    assert top == ["", r"\multicolumn{2}{c}{VOC}", r"\multicolumn{1}{c}{COCO}"]
    assert header == ["Loss", "linear", "fine-tuned", "linear"] and spec == "lrrr"
    assert rules[1] == (r"\cmidrule(lr){2-3} \cmidrule(lr){4-4}", 1)
    assert {row[0]: row[1:] for row in body}["EM+APL"] == [r"\textbf{82.00}"] * 3


def test_escape_leaves_nothing_latex_would_read_as_a_command():
    assert escape(r"a_b & 50% #1 $x$ {y} ~z^ \w <|>") == (
        r"a\_b \& 50\% \#1 \$x\$ \{y\} \textasciitilde{}z\textasciicircum{} \textbackslash{}w"
        r" \textless{}\textbar{}\textgreater{}")


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="pdflatex is not installed on this machine: the"
                    " tabular's structure is checked by the reader above instead")
def test_the_tex_table_compiles(runs, tmp_path):
    done = run_cli("report", "--format", "tex", "--paper", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (tmp_path / "doc.tex").write_text("\\documentclass{article}\n\\usepackage{booktabs}\n\\begin{document}\n"
                                      + done.stdout + "\\end{document}\n")
    compiled = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "doc.tex"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
    assert compiled.returncode == 0, compiled.stdout[-2000:]
    assert (tmp_path / "doc.pdf").exists()
