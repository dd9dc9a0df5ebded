"""scripts/gpu_checks.sh, which runs on a lent GPU machine where nothing can be fixed on the spot: its COCO parts
together train every loss, each once (but those that read a
text side, which its ResNet-50 COCO cache lacks)."""

import re
from pathlib import Path

from spml_cache import losses

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_checks.sh"


def test_the_coco_parts_train_every_loss_once():
    groups = re.findall(r"^COCO_\d=(\S+)$", SCRIPT.read_text(), flags=re.MULTILINE)
    named = [name for group in groups for name in group.split("+")]
    assert len(groups) == 3 and sorted(named) == sorted(losses.names(similarity=False))
