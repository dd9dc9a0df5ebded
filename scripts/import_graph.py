"""The package's house plan, drawn from its imports: which room (a stage folder, or a module of the shared core)
imports which, with `ast` (nothing is imported or run).

    python scripts/import_graph.py            # the arrows between rooms, as docs/internals.md lists them
    python scripts/import_graph.py --modules  # the arrows between modules
    python scripts/import_graph.py --check    # exit 1 on an import cycle or a stage importing another stage

Stages are the folders `extract/`, `linear/`, `finetune/`, `report/`; `demo/`, `experiments/` and `cli/` stand above
them and may call every stage's door; everything else is the core, which imports no stage. Imports under
`if TYPE_CHECKING:` are annotations: not drawn as arrows, but counted when looking for cycles (a cycle through an
annotation is a cycle as soon as someone needs the name at run time). The package root holds only the modules of
ROOT_MODULES (docs/internals.md, "Layout"): everything else lives in a room of its own.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "spml_cache"
STAGES = ("extract", "linear", "finetune", "report")
ABOVE = ("demo", "experiments", "cli", "__main__")
ROOT_MODULES = ("__init__", "__main__", "protocol", "metrics", "selection", "labels", "images")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.Module, annotations: bool = False):
    """Import nodes that run at import or call time (and, with `annotations`, those under `if TYPE_CHECKING:`)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            stack.extend(node.body + node.orelse if annotations else node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))


def module_arrows(annotations: bool = False) -> set[tuple[str, str]]:
    """(importer, imported) between the package's modules (with `annotations`, annotation-only imports too)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    arrows = set()
    for name, path in modules.items():
        for node in _runtime_imports(ast.parse(path.read_text(encoding="utf-8")), annotations):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                # `from spml_cache.x import y` imports the module spml_cache.x.y when there is one, else spml_cache.x
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            arrows |= {(name, target) for target in targets if target in modules and target != name}
    return arrows


def room(module: str) -> str:
    """The room of a module: its stage folder (or demo/), else the core module or folder it is."""
    parts = module.split(".")
    if len(parts) == 1:
        return "spml_cache"
    return parts[1] + ("/" if len(parts) > 2 or (PACKAGE / parts[1]).is_dir() else ".py")


def room_arrows(arrows: set[tuple[str, str]]) -> set[tuple[str, str]]:
    return {(room(a), room(b)) for a, b in arrows if room(a) != room(b) and room(b) != "spml_cache"}


def cycles(arrows: set[tuple[str, str]]) -> list[list[str]]:
    """Every elementary cycle found by a depth-first search (enough to say whether there is one)."""
    graph: dict[str, list[str]] = {}
    for a, b in arrows:
        graph.setdefault(a, []).append(b)
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, [])):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def stage_to_stage(arrows: set[tuple[str, str]]) -> list[tuple[str, str]]:
    def stage(r: str) -> str | None:
        name = r.rstrip("/").removesuffix(".py")
        return name if name in STAGES else None

    return sorted((a, b) for a, b in room_arrows(arrows) if stage(a) and stage(b) and stage(a) != stage(b))


def core_to_stage(arrows: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """Arrows from a core room (neither a stage nor above them) into a stage."""
    def name(r: str) -> str:
        return r.rstrip("/").removesuffix(".py")

    return sorted((a, b) for a, b in room_arrows(arrows)
                  if name(b) in STAGES and name(a) not in STAGES + ABOVE)


def stray_root_modules() -> list[str]:
    """Modules at the package root that the layout does not name there."""
    return sorted(path.name for path in PACKAGE.glob("*.py") if path.stem not in ROOT_MODULES)


def problems() -> list[str]:
    """Everything `--check` refuses, one line each."""
    found = [f"cycle: {' -> '.join(c)}" for c in cycles(module_arrows(annotations=True))]
    found += [f"stage imports stage: {a} -> {b}" for a, b in stage_to_stage(module_arrows())]
    found += [f"core imports a stage: {a} -> {b}" for a, b in core_to_stage(module_arrows())]
    found += [f"not a root module (put it in a room): spml_cache/{name}" for name in stray_root_modules()]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", action="store_true", help="arrows between modules instead of rooms")
    parser.add_argument("--check", action="store_true", help="fail on a cycle or a stage-to-stage import")
    args = parser.parse_args()
    arrows = module_arrows()
    if args.check:
        found = problems()
        print("\n".join(found) or f"{len(arrows)} module imports: no cycle, no stage imports another stage, the"
                                   " core imports no stage, the root holds only its named modules")
        return 1 if found else 0
    shown = sorted(arrows) if args.modules else sorted(room_arrows(arrows))
    for importer in dict.fromkeys(a for a, _ in shown):
        print(f"{importer} -> {', '.join(b for a, b in shown if a == importer)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
