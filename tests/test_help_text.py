"""Every command's --help reads as prose at any width: a paragraph of its docstring is wrapped by the terminal's
width alone, never broken where the docstring's source line happened to end (which left short orphans such as
"finite differences in float64," on a line of their own at 80 columns), and each Example line stays a line.

The check, precisely, on `spml-cache COMMAND --help` with COLUMNS=80 from a subprocess: the text between the usage
line and the first box, split into paragraphs at blank lines, (1) has the docstring's words, paragraph by
paragraph, each Example line a paragraph of its own (a line that starts with "Example:" starts one); (2) is filled greedily: within a paragraph, no line could
have taken the first word of the line after it."""

from __future__ import annotations

import inspect

import pytest
from cli_support import run_cli

from spml_cache import cli

WIDTH = 80
TEXT_WIDTH = WIDTH - 2  # rich pads the help text with a space on either side
COMMANDS = {command.name: command.callback for command in cli.app.registered_commands}


def docstring_paragraphs(doc: str) -> list[list[str]]:
    """The words of each paragraph of `doc` as --help should show them: Example lines each a paragraph."""
    paragraphs = []
    for paragraph in inspect.cleandoc(doc).split("\n\n"):
        lines = paragraph.splitlines()
        if lines and all(line.startswith("Example:") for line in lines):
            paragraphs += [line.split() for line in lines]
        else:
            paragraphs.append(paragraph.split())
    return paragraphs


def rendered_paragraphs(stdout: str) -> list[list[str]]:
    """The help text's paragraphs as rendered: lists of lines, between the usage line and the first box."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("Usage:")) + 1
    body = []
    for line in lines[start:]:
        if line.lstrip().startswith("╭"):
            break
        body.append(line.rstrip())
    paragraphs, current = [], []
    for line in body + [""]:
        if current and (not line.strip() or line.strip().startswith("Example:")):  # an example starts its own
            paragraphs.append(current)
            current = []
        if line.strip():
            current.append(line.strip())
    return paragraphs


def first_orphan(paragraphs: list[list[str]]) -> tuple[str, str] | None:
    """The first pair of lines of one paragraph where the first could have taken the next line's first word."""
    for paragraph in paragraphs:
        for line, after in zip(paragraph, paragraph[1:]):
            if len(line) + 1 + len(after.split()[0]) <= TEXT_WIDTH:
                return line, after
    return None


def test_the_check_finds_the_orphans_the_issue_saw():
    # check-loss at 80 columns before the fix: the source's line end kept as a break
    seen = [["Finite values and gradients (random logits and |z| = 30), the gradient against",
             "finite differences in float64,", "K stacked heads equal to K heads alone, a capture-safe step (no"]]
    assert first_orphan(seen) == ("finite differences in float64,", "K stacked heads equal to K heads alone, a"
                                  " capture-safe step (no")
    assert first_orphan([["a b c", "d"]]) == ("a b c", "d") and first_orphan([["x" * 77, "yy"]]) is None


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_wraps_as_prose_at_80_columns(tmp_path, name):
    done = run_cli(name, "--help", cwd=tmp_path, env={"COLUMNS": str(WIDTH)})
    assert done.returncode == 0, done.stderr
    shown = rendered_paragraphs(done.stdout)
    assert [" ".join(p).split() for p in shown] == docstring_paragraphs(COMMANDS[name].__doc__)
    assert first_orphan(shown) is None
    assert all(len(line) <= TEXT_WIDTH for paragraph in shown for line in paragraph)
