"""The docs run: every Python block of README.md and docs/*.md is executed as written, so that no documented call
can drift from the code (issue 53). The convention, which docs/python-api.md ("The examples' data") states for
readers:

- a fenced block whose info string is `python` is run; a page's blocks run in order, in one namespace, in a fresh
  copy of one shared folder (the current directory), as a notebook runs its cells;
- that folder is made once by the docs' one `python preamble` block (docs/python-api.md: a tiny generated VOC
  dataset and its cache), run in an empty folder before any page;
- `python gpu`: needs a CUDA GPU, skipped without one; `python network`: needs the network, always skipped (the
  tests never download: SPML_OFFLINE is set, so a block that would download fails instead of fetching);
- `python file=NAME.py`: the file NAME.py of that folder (written there, not run; the folder is on sys.path, so a
  later block may name `NAME:callable`).

Blocks of other languages (shell commands, TOML, a signature listing as `text`) are not run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from docs_support import REPO, SKIPPED, Block, fenced_blocks

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def run_blocks(blocks: list[Block], folder: Path, monkeypatch) -> dict:
    """Each block in `folder`, in order, in one namespace (a `file=` block written there); returns the namespace.
    A block that raises fails with its page and line in the traceback (each is compiled under that name)."""
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("SPML_OFFLINE", "1")
    for name in ("SPML_CACHE", "SPML_DATA"):
        monkeypatch.delenv(name, raising=False)
    namespace: dict = {"__name__": "__main__"}
    for block in blocks:
        if block.file is not None:
            (folder / block.file).write_text(block.code, encoding="utf-8")
        else:
            exec(compile(block.code, block.where, "exec"), namespace)  # noqa: S102 (the docs' own code)
    return namespace


# A page whose Python follows its own shell steps (files they make, runs they leave) is run by its page's test, in
# the folder those steps made, rather than here in the preamble's.
RUN_BY_THE_PAGES_TEST = {
    REPO / "docs" / "experiments.md": "tests/test_experiments_docs.py runs its block as written after the page's"
                                      " commands have made demo-data, demo.toml and its runs",
}
BLOCKS = [block for page in PAGES for block in fenced_blocks(page)]
PREAMBLES = [block for block in BLOCKS if "preamble" in block.words]
RUN = {page: [block for block in BLOCKS if block.page == page and "preamble" not in block.words and not block.skip]
       for page in PAGES}


@pytest.fixture(scope="module")
def docs_folder(tmp_path_factory) -> Path:
    """The folder every page starts from: the preamble run in an empty one."""
    folder = tmp_path_factory.mktemp("docs") / "start"
    folder.mkdir()
    with pytest.MonkeyPatch.context() as monkeypatch:
        run_blocks(PREAMBLES, folder, monkeypatch)
    return folder


def test_the_docs_have_one_preamble_and_python_blocks_to_run():
    assert [block.page for block in PREAMBLES] == [REPO / "docs" / "python-api.md"]
    assert sum(len(blocks) for blocks in RUN.values()) >= 10


@pytest.mark.parametrize("page", [page for page, blocks in RUN.items() if blocks],
                         ids=lambda page: str(page.relative_to(REPO)))
def test_the_pages_python_blocks_run_as_written(page, docs_folder, tmp_path, monkeypatch, one_thread):
    if page in RUN_BY_THE_PAGES_TEST:
        pytest.skip(RUN_BY_THE_PAGES_TEST[page])
    folder = tmp_path / "folder"
    shutil.copytree(docs_folder, folder)
    run_blocks(RUN[page], folder, monkeypatch)


@pytest.mark.parametrize("block", [block for block in BLOCKS if block.skip], ids=lambda block: block.where)
def test_a_block_marked_for_a_gpu_or_the_network_is_skipped_with_the_reason(block):
    pytest.skip(f"{block.where}: {block.skip}")


def test_the_runner_finds_runs_skips_and_writes_what_the_convention_says(tmp_path, monkeypatch):
    """Not blind: each kind of block found as the docstring says, a file block importable by a later one, and a
    block that raises names its page and line."""
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "text", "```python", "x = 1", "```", "```sh", "echo no", "```", "- a list item:", "",
        "  ```python", "  y = x + 1", "  ```", "```python gpu", "import torch; torch.zeros(1, device='cuda')", "```",
        "```python network", "raise SystemExit('downloaded')", "```", "```python file=helper.py",
        "def twice(v):", "    return 2 * v", "```", "```python", "from helper import twice", "z = twice(y)", "```",
        "```text", "signature(a, b) -> c", "```", "```python", "raise ValueError('the docs drifted')", "```"]) + "\n")
    blocks = fenced_blocks(page)
    assert [(block.line, block.words, block.file) for block in blocks] == [
        (2, (), None), (10, (), None), (13, ("gpu",), None), (16, ("network",), None), (19, ("file=helper.py",),
                                                                                     "helper.py"),
        (23, (), None), (30, (), None)]
    assert blocks[1].code == "y = x + 1\n"  # dedented as far as its fence
    assert blocks[3].skip == SKIPPED["network"] and (blocks[2].skip is None) == torch.cuda.is_available()
    runnable = [block for block in blocks if not block.skip]
    namespace = run_blocks(runnable[:-1], tmp_path, monkeypatch)
    assert namespace["z"] == 4 and (tmp_path / "helper.py").is_file()
    with pytest.raises(ValueError, match="the docs drifted") as raised:
        run_blocks(runnable[-1:], tmp_path, monkeypatch)
    assert raised.traceback[-1].path == "page.md:30" or str(raised.traceback[-1].path).endswith("page.md:30")
