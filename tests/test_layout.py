"""The house plan: no import cycle, no stage importing another stage (docs/internals.md, "Layout")."""

import subprocess
import sys

from cli_support import REPO


def test_no_cycle_and_no_stage_imports_another():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "import_graph.py"), "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no cycle, no stage imports another stage" in done.stdout


def test_the_check_sees_a_stage_importing_another(tmp_path, monkeypatch):
    """The checker is not blind: an arrow from linear/ into finetune/ is reported."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import import_graph
    finally:
        sys.path.pop(0)
    arrows = import_graph.module_arrows() | {("spml_cache.linear.run", "spml_cache.finetune.images")}
    assert import_graph.stage_to_stage(arrows) == [("linear/", "finetune/")]
    assert import_graph.cycles({("a", "b"), ("b", "c"), ("c", "a")}) == [["a", "b", "c", "a"]]
