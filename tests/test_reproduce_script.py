"""scripts/reproduce_table1.sh: the commands it would run (DRY_RUN), and every flag they use exists in the CLI."""

import os
import re
import subprocess
from pathlib import Path

from cli_support import assert_flags_exist

SCRIPT = Path(__file__).parents[1] / "scripts" / "reproduce_table1.sh"


def dry_run(*datasets: str, **env: str) -> list[str]:
    environment = {**os.environ, "DRY_RUN": "1", **env}
    done = subprocess.run(["bash", str(SCRIPT), *datasets], env=environment, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return [line.removeprefix("+ ") for line in done.stdout.splitlines()]


def test_every_stage_of_one_dataset_in_order():
    lines = dry_run("nus", FINETUNE_LOSSES="an_ls role", SEEDS="2")
    assert lines == [
        "spml-cache extract nus --skip-missing",
        "spml-cache linear --dataset nus --loss all --seeds 2",
        "spml-cache finetune --init best --dataset nus --loss an_ls --seeds 2 --skip-missing",
        "spml-cache finetune --init best --dataset nus --loss role --seeds 2 --skip-missing",
        "spml-cache report --paper",
        "spml-cache report --paper --format md --out table1.md --plots figures",
    ]


def test_stages_and_datasets_can_be_chosen():
    lines = dry_run(STAGES="linear")
    assert lines == [f"spml-cache linear --dataset {name} --loss all --seeds 3" for name in ("voc", "coco", "nus", "cub")]
    assert dry_run("voc", STAGES="extract", WEIGHTS="w.pth") == ["spml-cache extract voc --weights w.pth"]


def test_every_flag_the_script_uses_is_in_the_cli(tmp_path):
    assert_flags_exist(dry_run("voc", "nus", WEIGHTS="w.pth"), tmp_path)
