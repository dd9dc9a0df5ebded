"""scripts/frozen_table.sh: the commands it runs for each backbone and feature kind (DRY_RUN), every flag of them
in the CLI, and a real run on a tiny dataset down to the loss x backbone table and its figure."""

import os
import subprocess
import sys
from pathlib import Path

from cli_support import REPO, assert_flags_exist
from extract_support import write_numbered_csv_dataset

SCRIPT = Path(__file__).parents[1] / "scripts" / "frozen_table.sh"


def script(*args: str, cwd=None, **env: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("SPML_")}
    done = subprocess.run(["bash", str(SCRIPT), *args], env={**environment, **env}, capture_output=True, text=True,
                          timeout=600, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return done


def dry_run(*args: str, **env: str) -> list[str]:
    return [line.removeprefix("+ ") for line in script(*args, DRY_RUN="1", **env).stdout.splitlines()]


def test_each_backbone_and_kind_is_extracted_then_probed_then_pivoted():
    lines = dry_run("coco", BACKBONES="vit_b_16 clip:ViT-B-16/openai", WDS="0,1e-4", SEEDS="3")
    expected = []
    for backbone, slug in (("vit_b_16", "vit_b_16"), ("clip:ViT-B-16/openai", "clip_ViT_B_16_openai")):
        for kind, suffix in (("pooled", ""), ("last4", "_last4")):
            cache = f"cache/coco-{slug}{suffix}.h5"
            expected += [f"spml-cache extract coco --backbone {backbone} --features {kind} --out {cache}",
                         f"spml-cache linear --cache {cache} --loss all --seeds 3 --wd 0,1e-4 --out runs"]
    expected += ["spml-cache report runs/coco --pivot backbone",
                 "spml-cache report runs/coco --pivot backbone --format md --out frozen-coco.md --plots figures"]
    assert lines == expected
    default = dry_run("voc")
    assert len([line for line in default if " extract " in line]) == 5 * 2  # five backbones, pooled and last4
    assert not any("--wd" in line for line in default)  # the papers' grid unless asked


def test_every_flag_the_script_uses_is_in_the_cli(tmp_path):
    assert_flags_exist(dry_run("voc", WDS="0,1e-4"), tmp_path)


def test_a_real_run_ends_in_the_pivot_table_and_its_figure(tmp_path):
    data = write_numbered_csv_dataset(tmp_path / "data", 14, first_test=10, classes=("cat", "potted_plant"))
    done = script("csv", cwd=tmp_path, BACKBONES="resnet18", LOSSES="an,role", SPML_DATA=str(data),
                  SPML=f"{sys.executable} -m spml_cache", PYTHONPATH=str(REPO), SPML_OFFLINE="1", COLUMNS="300",
                  EXTRACT_ARGS="--weights none --resolution 32 --device cpu --workers 0",
                  LINEAR_ARGS="--epochs 1 --lr 1e-2 --batch-size 4 --device cpu", WDS="0,1e-3")
    assert sorted(p.name for p in (tmp_path / "cache").glob("*.h5")) == ["csv-resnet18.h5", "csv-resnet18_last4.h5"]
    table = (tmp_path / "frozen-csv.md").read_text().splitlines()
    assert table[0].split("|")[1:-1] == [" loss ", " resnet18 ", " resnet18+last4 "]
    assert {row.split("|")[1].strip() for row in table[2:4]} == {"AN", "ROLE"}  # as the papers name them
    # the weight decays swept, said once per column; a cell names its selected one where it is not 0
    assert "weight decay selected per loss from 0, 0.001 (--wd); a cell names it where it is not 0" in "\n".join(table)
    assert all(cell.strip() and "wd=0)" not in cell for row in table[2:4] for cell in row.split("|")[2:4])
    assert (tmp_path / "figures" / "csv-loss_by_backbone.png").read_bytes()[:4] == b"\x89PNG"
    assert "resnet18+last4" in done.stdout
