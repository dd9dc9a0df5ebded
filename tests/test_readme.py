"""What the README promises a new user before they run anything: timings that quote docs/benchmarks.md with the
date each was measured, the test suite's time, and the CPU-only install as one command beside the install line."""

from __future__ import annotations

import re
import shlex
import tomllib

from cli_support import REPO

README = (REPO / "README.md").read_text()
BENCHMARKS = (REPO / "docs" / "benchmarks.md").read_text()
DATE = r"\d{4}-\d{2}-\d{2}"
# a measured time or rate as the README writes it: 4.6 s, 3 min 44 s, 4.7 min, 1.0 images/s (not "10 minutes")
FIGURE = r"(?<![\w.,])(\d+(?:\.\d+)?(?: min \d+ s| min| s| (?:training )?images/s))(?![\w/])"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def readme_figures() -> list[tuple[str, str | None]]:
    """Each figure in the README with the first date after it on its line (None: no date there)."""
    found = []
    for line in README.splitlines():
        for match in re.finditer(FIGURE, line):
            date = re.search(DATE, line[match.end():])
            found.append((match.group(1), date.group(0) if date else None))
    return found


def dated_in_benchmarks(figure: str, date: str) -> bool:
    """Whether docs/benchmarks.md gives `figure` (its number; a table's unit is in its header) in a section whose
    last date before it is `date`."""
    number = figure if " min " in figure else figure.split()[0]
    for match in re.finditer(rf"(?<![\d.]){re.escape(number)}(?!\.?\d)", BENCHMARKS):
        section = re.split(r"\n#+ ", BENCHMARKS[:match.start()])[-1]
        dates = re.findall(DATE, section)
        if dates and dates[-1] == date:
            return True
    return False


def test_readme_timings_quote_docs_benchmarks_with_their_date():
    figures = readme_figures()
    assert len(figures) >= 8  # the quick start, the tests and the table of steps
    assert [figure for figure, date in figures if date is None] == []
    assert [(figure, date) for figure, date in figures if not dated_in_benchmarks(figure, date)] == []


def test_readme_gives_the_test_suite_time():
    (line,) = [line for line in README.splitlines() if line.startswith("Install and run the tests")]
    assert re.search(FIGURE, line) and re.search(DATE, line)


def test_the_check_catches_a_stale_or_undated_figure():
    # restated: the figures the issue found stale would not pass
    assert not dated_in_benchmarks("7.1 min", "2026-11-25")  # session 2's, 2026-11-21
    assert not dated_in_benchmarks("46 s", "2026-11-23")  # not the measured 46.4 s
    assert dated_in_benchmarks("46.4 s", "2026-11-23") and dated_in_benchmarks("3 min 44 s", "2026-11-25")


def test_cpu_only_install_is_one_command_beside_the_install_line():
    blocks = re.findall(r"```\n(.*?)```", README, flags=re.S)
    install = 'python -m pip install -e ".[dev]"'
    quick = next(i for i, block in enumerate(blocks) if block.strip() == f"{install} && spml-cache demo")
    cpu = [block.strip() for block in blocks if CPU_INDEX in block]
    assert len(cpu) == 1 and "\n" not in cpu[0]  # one line to copy
    words = shlex.split(cpu[0])
    # torch and torchvision from PyTorch's CPU wheel index first, then the project's own install, which keeps them
    assert words[:4] == ["python", "-m", "pip", "install"] and {"torch", "torchvision"} <= set(words[4:8])
    assert words[words.index("--index-url") + 1] == CPU_INDEX
    assert cpu[0].endswith(f"&& {install} && spml-cache demo")
    assert blocks.index(next(b for b in blocks if CPU_INDEX in b)) == quick + 1  # beside the install line
    # the size it saves is said plainly next to it
    between = README[README.index(blocks[quick]) + len(blocks[quick]):README.index(cpu[0])]
    assert re.search(r"\d+(\.\d+)? GB", between) and "CUDA" in between


def test_the_cpu_wheels_satisfy_the_projects_torch_requirements():
    # the CPU route installs torch and torchvision by name: pyproject must not pin a CUDA build (+cuXXX) or a
    # package only the CUDA index has
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    torch_requirements = [r for r in project["dependencies"] if re.match(r"torch(vision)?\b", r)]
    assert {re.match(r"[a-z]+", r).group(0) for r in torch_requirements} == {"torch", "torchvision"}
    assert not any("+cu" in r or "nvidia" in r for r in project["dependencies"])
