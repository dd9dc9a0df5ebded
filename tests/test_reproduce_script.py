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


ROOT = Path(__file__).parents[1]


def inits_the_protocol_names() -> dict[str, str]:
    """docs/protocol.md's "numbers to reproduce": a fine-tuned "+LinearInit" row starts from the best linear head,
    every other fine-tuned row (the papers that train end to end from ImageNet) from a fresh head."""
    section = (ROOT / "docs" / "protocol.md").read_text().split("## The numbers to reproduce", 1)[1]
    table = section.split("\n\n")[2]
    inits = {}
    for row in table.splitlines():
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        if len(cells) > 1 and cells[1] == "fine-tuned":
            loss = re.search(r"`(\w+)`", cells[0]).group(1)
            inits[loss] = "best" if "+LinearInit" in cells[0] else "imagenet"
    return inits


def finetune_inits(lines: list[str]) -> dict[str, str]:
    """{loss: init} of the `finetune` commands among `lines`; a comment `the same with --loss a, b` repeats the
    command above it for those losses."""
    inits, last = {}, None
    for line in lines:
        if re.match(r"(spml-cache|\S+ -m spml_cache) finetune ", line):
            last = re.search(r"--init (\w+)", line).group(1)
            inits[re.search(r"--loss (\w+)", line).group(1)] = last
        elif "the same with --loss" in line:
            for loss in re.split(r",\s*", line.split("--loss", 1)[1].split(" for ")[0].strip()):
                inits[loss] = last
    return inits


def test_the_protocol_has_both_kinds_of_fine_tuned_rows():
    inits = inits_the_protocol_names()
    assert inits["role"] == "best" and inits["em"] == "imagenet" and len(inits) == 7


def test_the_script_starts_each_fine_tuned_loss_as_the_protocol_says():
    assert finetune_inits(dry_run("voc", STAGES="finetune")) == inits_the_protocol_names()


def test_the_readme_recipe_starts_each_fine_tuned_loss_as_the_protocol_says():
    recipe = (ROOT / "README.md").read_text().split("## Reproducing the papers", 1)[1].split("```")[1]
    assert finetune_inits(recipe.splitlines()) == inits_the_protocol_names()
