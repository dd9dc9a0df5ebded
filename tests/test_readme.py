"""What the README promises a new user before they run anything: install (GPU or CPU, each line with its measured
size), the demo, then the pipeline, the test line last; timings that quote docs/benchmarks.md with the date each was
measured, and the test suite's time."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
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


def section(title: str) -> str:
    """The README's `## title` section, up to the next `## `."""
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def code_blocks(text: str) -> list[str]:
    return [block.strip() for block in re.findall(r"```\w*\n(.*?)```", re.sub(r"\n +", "\n", text), flags=re.S)]


TEST_LINE = 'python -m pip install -e ".[dev]" && python -m pytest'
VENV = ["python3 -m venv .venv", ". .venv/bin/activate"]  # a machine's line starts so, and ends with the demo


def test_a_newcomer_meets_install_then_the_demo_then_the_pipeline_and_the_tests_last():
    titles = re.findall(r"^## (.+)$", README, flags=re.M)
    assert titles[:3] == ["Install", "Try it: the demo", "The pipeline"]
    assert titles[-1] == "Development"
    # the test line, verbatim, beside the install lines and in Development, and what .ci/run runs, as a line of it
    assert [b for b in code_blocks(README) if "pytest" in b] == [TEST_LINE, TEST_LINE]
    assert TEST_LINE in code_blocks(section("Install")) and TEST_LINE in code_blocks(section("Development"))
    assert TEST_LINE in (REPO / ".ci" / "run").read_text().splitlines()
    assert code_blocks(section("Try it: the demo"))[0] == "spml-cache demo"


def test_the_install_asks_gpu_or_cpu_before_one_line_per_machine_to_the_demo_each_with_its_size():
    install = section("Install")
    assert install.index("GPU or CPU?") < install.index("```")
    gpu, cpu, tests = code_blocks(install)
    assert tests == TEST_LINE
    for line in (gpu, cpu):  # one line to copy: a new venv, the install, the demo
        steps = line.split(" && ")
        assert "\n" not in line and steps[:2] == VENV and steps[-1] == "spml-cache demo", line
    assert gpu.split(" && ")[2:-1] == ["python -m pip install -e ."]
    # torch and torchvision from PyTorch's CPU wheel index first, then the project's own install, which keeps them
    torch_step, project_step = cpu.split(" && ")[2:-1]
    words = shlex.split(torch_step)
    assert words[:4] == ["python", "-m", "pip", "install"] and {"torch", "torchvision"} <= set(words[4:8])
    assert words[words.index("--index-url") + 1] == CPU_INDEX
    assert project_step == "python -m pip install -e ."
    assert "/.venv/" in (REPO / ".gitignore").read_text().splitlines()  # made in the clone, never committed
    # each line followed by its venv's size, a figure docs/benchmarks.md's install section gives too
    after_gpu = install.split(gpu, 1)[1].split(cpu, 1)[0]
    after_cpu = install.split(cpu, 1)[1].split(tests, 1)[0]
    measured = BENCHMARKS.split("## Install size", 1)[1].split("\n## ", 1)[0]
    for text in (after_gpu, after_cpu):
        size = re.search(r"(\d+(?:\.\d)?) GB", text).group(1)
        assert f"{size} GB" in measured, size
    assert "not measured" in measured.lower() and "Not measured by the project" in after_cpu


def test_no_table_cell_is_a_paragraph():
    cells = [cell.strip() for line in README.splitlines() if line.startswith("|") for cell in line.split(" | ")]
    assert max(len(cell) for cell in cells) <= 200


def test_the_cpu_wheels_satisfy_the_projects_torch_requirements():
    # the CPU route installs torch and torchvision by name: pyproject must not pin a CUDA build (+cuXXX) or a
    # package only the CUDA index has
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    torch_requirements = [r for r in project["dependencies"] if re.match(r"torch(vision)?\b", r)]
    assert {re.match(r"[a-z]+", r).group(0) for r in torch_requirements} == {"torch", "torchvision"}
    assert not any("+cu" in r or "nvidia" in r for r in project["dependencies"])


def test_the_suite_says_its_pass_count_as_the_readme_and_the_quiet_form_run_it(tmp_path):
    # under the project's own pytest settings (pyproject.toml's addopts), as `python -m pytest` and `pytest -q` run
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    for quiet in ([], ["-q"]):
        done = subprocess.run([sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir",
                               str(tmp_path), "-p", "no:cacheprovider", "-n", "0", *quiet, str(tmp_path / "test_one.py")],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert re.match(r"=* ?1 passed in ", done.stdout.strip().splitlines()[-1]), (quiet, done.stdout)
