"""No import cycle among runner's modules, function-local imports included (docs/design.md, package map); and none
through imports under ``if TYPE_CHECKING:`` either: they never run, but a type one module needs from another above it
says the two are one idea split in two, or that the type belongs lower down.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, modules: set[str], type_only: bool) -> set[str]:
    """The runner modules ``tree`` imports at run time, and with ``type_only`` those it imports for types too
    (``from pkg import mod`` counts as ``pkg.mod``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not type_only and isinstance(child, ast.If) and getattr(child.test, "id", "") == "TYPE_CHECKING":
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("runner"):
                for alias in child.names:
                    full = f"{child.module}.{alias.name}"
                    found.add(full if full in modules else child.module)
            elif isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names if alias.name.startswith("runner"))
            visit(child)

    visit(tree)
    return found & modules


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in (ROOT / "runner").rglob("*.py")}
    modules = set(files)
    graph = {
        name: _imports(ast.parse(path.read_text(encoding="utf-8")), modules, type_only) for name, path in files.items()
    }
    return {name: targets - {name} for name, targets in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def strong(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                strong(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            strong(node)
    return found


def test_runner_has_no_import_cycle():
    found = cycles(import_graph())
    assert found == [], "import cycles (move the shared code down, into the module both import):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_runner_has_no_import_cycle_through_type_only_imports():
    found = cycles(import_graph(type_only=True))
    assert found == [], "cycles through type-only imports (move the type down, or join the two):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_a_type_only_import_counts_only_when_asked():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from runner.b import T\nimport runner.c\n"
    modules = {"runner.b", "runner.c"}
    assert _imports(ast.parse(source), modules, type_only=False) == {"runner.c"}
    assert _imports(ast.parse(source), modules, type_only=True) == {"runner.b", "runner.c"}


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
