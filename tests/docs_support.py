"""The Python code blocks of a documentation page, as the page shows them, with what their info strings say
(tests/test_docs_run.py runs them all; its docstring states the convention)."""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(\s*)```(\S*)[ \t]*(.*)$")
SKIPPED = {"gpu": "needs a CUDA GPU", "network": "needs the network (the tests never download)"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the opening fence's
    words: tuple[str, ...]  # the info string's words after `python`
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page.name}:{self.line}"

    @property
    def file(self) -> str | None:
        """The file this block is (`file=NAME.py`), or None: a block to run."""
        return next((word.removeprefix("file=") for word in self.words if word.startswith("file=")), None)

    @property
    def skip(self) -> str | None:
        """Why it is not run here, or None."""
        if "gpu" in self.words and torch.cuda.is_available():
            return None
        return next((SKIPPED[word] for word in self.words if word in SKIPPED), None)


def fenced_blocks(page: Path) -> list[Block]:
    """Every fenced block of `page` whose language is `python`, its body dedented as far as its fence is (a block
    inside a list item)."""
    blocks, opened = [], None
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        fence = FENCE.match(line)
        if opened is None:
            if fence is not None:
                opened = (number, fence.group(2), tuple(fence.group(3).split()), [])
        elif fence is not None and not fence.group(2) and not fence.group(3):
            start, language, words, body = opened
            if language == "python":
                blocks.append(Block(page, start, words, textwrap.dedent("\n".join(body)) + "\n"))
            opened = None
        else:
            opened[3].append(line)
    return blocks


def python_blocks(page: str) -> list[str]:
    """The code of each plain ```python block of docs/`page` (or of the README: `page` relative to the repository),
    in order: a block run as written, no file or preamble."""
    return [block.code for block in fenced_blocks(REPO / page) if not block.words]
