"""The house plan: no import cycle, no stage importing another stage (docs/internals.md, "Layout")."""

import subprocess
import sys

from cli_support import REPO


def test_no_cycle_and_no_stage_imports_another():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "import_graph.py"), "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no cycle, no stage imports another stage, the core imports no stage, the root holds only" in done.stdout


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


def _import_graph():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import import_graph
    finally:
        sys.path.pop(0)
    return import_graph


def test_the_check_sees_the_core_importing_a_stage_and_a_stray_root_module(tmp_path, monkeypatch):
    import_graph = _import_graph()
    arrows = {("spml_cache.runs.handover", "spml_cache.linear.run"), ("spml_cache.cli", "spml_cache.linear")}
    assert import_graph.core_to_stage(arrows) == [("runs/", "linear/")]  # cli/ stands above the stages
    package = tmp_path / "spml_cache"
    (package / "runs").mkdir(parents=True)
    for name in ("__init__.py", "protocol.py", "labels.py", "helpers.py", "runs/__init__.py"):
        (package / name).write_text("")
    monkeypatch.setattr(import_graph, "PACKAGE", package)
    assert import_graph.stray_root_modules() == ["helpers.py"]


def test_a_cycle_through_an_annotation_only_import_is_a_cycle(tmp_path, monkeypatch):
    import_graph = _import_graph()
    package = tmp_path / "spml_cache"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from spml_cache import b\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from spml_cache import a\n")
    monkeypatch.setattr(import_graph, "PACKAGE", package)
    assert import_graph.cycles(import_graph.module_arrows()) == []  # drawn arrows leave annotations out
    assert import_graph.cycles(import_graph.module_arrows(annotations=True)) == [
        ["spml_cache.a", "spml_cache.b", "spml_cache.a"]]
    assert any(line.startswith("cycle:") for line in import_graph.problems())
