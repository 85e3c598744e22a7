"""The package's modules import one another without a circle: each module's imports,
those inside functions included, are read with ``ast`` (nothing is imported) and the
graph they make must be acyclic."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "lonnymq"
SOURCE = Path(__file__).resolve().parents[2] / "src" / PACKAGE


def _module_names() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted(SOURCE.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(SOURCE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module ``from … import`` reads from, a relative one resolved against ``module``."""
    if not node.level:
        return node.module or ""
    # A relative import starts from the package that holds the module (a package: itself).
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, node.module] if node.module else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at any depth of its body)."""
    modules = _module_names()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _base(node, module, is_package)
                # ``from p import x`` imports the module p.x when there is one, else p's name x.
                for alias in node.names:
                    name = f"{base}.{alias.name}"
                    targets.add(name if name in modules else base)
        graph[module] = {name for name in targets if name in modules and name != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as the modules along it (the first repeated at the end), or
    ``None`` when there is none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        if (cycle := visit(start)) is not None:
            return cycle
    return None


def test_the_graph_sees_every_kind_of_import() -> None:
    """Module-level and function-level, absolute and relative imports all count."""
    graph = import_graph()
    assert "lonnymq.queue" in graph["lonnymq.cli"]  # from .queue import Queue
    assert "lonnymq.bench" in graph["lonnymq.cli"]  # inside a function
    assert "lonnymq._core" in graph["lonnymq.spark"]  # from .. import _core


def test_find_cycle_names_the_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_itself_in_a_circle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)
