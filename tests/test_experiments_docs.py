"""docs/experiments.md as written: its demo experiment runs end to end from its Try it lines, goes on after Ctrl-C
with the interrupted run (then the same as its command typed by hand), and a run again trains nothing; every ```toml block of the page is a file whose plan
prints; its table of keys is each stage's keys exactly."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest
from cli_support import REPO, assert_flags_exist, ended, run_cli, start_cli
from docs_support import python_blocks
from run_support import assert_same_run

from spml_cache import runs
from spml_cache.experiments.stages import STAGES

PAGE = (REPO / "docs" / "experiments.md").read_text()


def section(title: str) -> str:
    return PAGE.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def toml_blocks(text: str) -> list[str]:
    return re.findall(r"^```toml\n(.*?)^```$", text, flags=re.S | re.M)


def test_the_demo_runs_as_written_goes_on_after_ctrl_c_and_a_run_again_trains_nothing(tmp_path):
    (demo,) = toml_blocks(section("Try it"))
    (lines,) = re.findall(r"^```\n(.*?)^```$", re.sub(r"^```toml\n.*?^```$", "", section("Try it"), flags=re.S | re.M),
                          flags=re.S | re.M)
    make_data, dry_run, first, again = lines.strip().splitlines()
    (tmp_path / "demo.toml").write_text(demo)
    assert run_cli(*shlex.split(make_data)[1:], cwd=tmp_path).returncode == 0
    state = tmp_path / "runs" / "experiments" / "demo.json"
    # stopped in the fine-tuning: the linear step is done, the fine-tuning's run directory kept
    process = start_cli(*shlex.split(first)[1:], cwd=tmp_path, ready=lambda: state.exists() and len(
        json.loads(state.read_text())["made"]) == 2 and list(tmp_path.glob("runs/voc/finetune-*/config.json")))
    os.killpg(process.pid, signal.SIGINT)
    stderr = ended(process, tmp_path)
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1].endswith("go on with: spml-cache run demo.toml")
    (finetune,) = (tmp_path / "runs" / "voc").glob("finetune-*")
    assert not (finetune / "results.json").exists()

    planned = run_cli(*shlex.split(dry_run)[1:], cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr
    said = planned.stdout.splitlines()
    assert [line.split()[1] for line in said[1:]] == ["extract", "linear", "finetune", "report"]
    assert said[2].split("  # ")[0].endswith("--cache cache/voc-resnet50-32.h5 --lr 0.01 --batch-size 8 --epochs 2"
                                             " --device cpu")
    assert said[3].endswith(f"# step 3: goes on with runs/voc/{finetune.name}")
    assert_flags_exist([line.split("  # ")[0] for line in said[1:]], tmp_path)

    done = run_cli(*shlex.split(first)[1:], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"resuming runs/voc/{finetune.name}" in done.stdout + done.stderr
    assert list((tmp_path / "runs" / "voc").glob("finetune-*")) == [finetune]
    assert runs.load_results(finetune)["losses"]
    # the fine-tuning, stopped and gone on with, is the same as its command typed by hand, bit for bit
    command = run_cli(*shlex.split(dry_run)[1:], cwd=tmp_path).stdout.splitlines()[3].split("  # ")[0]
    by_hand = run_cli(*shlex.split(command)[1:], "--out", "by-hand", cwd=tmp_path)
    assert by_hand.returncode == 0, by_hand.stderr
    (theirs,) = (tmp_path / "by-hand" / "voc").glob("finetune-*")
    assert_same_run(finetune, theirs, cwd=tmp_path)
    done = run_cli(*shlex.split(again)[1:], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert [line.split(": ")[1].split(",")[0] for line in done.stdout.splitlines() if line.startswith("step ")
            and "/4: done" in line] == ["done", "done"]
    assert done.stdout.splitlines()[-1] == ("demo.toml: 4 steps done, 2 of them before; its state:"
                                            " runs/experiments/demo.json")
    (python,) = python_blocks("docs/experiments.md")
    done = subprocess.run([sys.executable, "-c", python], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "4 steps; ran now: [1, 4]"  # extract finds its cache, report reports


@pytest.mark.parametrize("index", range(len(toml_blocks(PAGE))))
def test_each_example_on_the_page_is_a_file_whose_plan_prints(tmp_path, index):
    (tmp_path / "example.toml").write_text(toml_blocks(PAGE)[index])
    done = run_cli("run", "example.toml", "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert_flags_exist([line.split("  # ")[0] for line in done.stdout.splitlines()[1:]], tmp_path)


def test_the_pages_table_of_keys_is_each_stages_keys():
    rows = dict(re.findall(r"^\| `\[([a-z-]+)\]` \| (`.*`) \|$", section("The file"), flags=re.M))
    assert set(rows) == set(STAGES)
    for name, stage in STAGES.items():
        listed = re.findall(r"`([a-z-]+)`", rows[name])
        taken = [option.cli_flag.removeprefix("--") for keyword, option in stage.options().items()
                 if keyword not in stage.reserved]
        assert listed == taken, name
        assert all(stage.key(key) for key in listed)
