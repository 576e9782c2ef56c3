"""The package's modules form layers: no import circle, not even through an import
inside a function (#10 tidy), and neither do its packages (#21): engine, guard, eval,
rag, pipeline, server... import each other one way only, lazy imports included."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import kvblend

ROOT = Path(kvblend.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Module -> kvblend modules it imports anywhere in its body (package re-exports excluded)."""
    files = {_module_name(f): f for f in ROOT.rglob("*.py")}
    packages = {name for name, f in files.items() if f.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, f in files.items():
        if name in packages:
            continue
        deps: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvblend"):
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("kvblend")}
        graph[name] = {d for d in deps if d in files and d not in packages and d != name}
    return graph


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = _imports()
    assert len(graph) > 30
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"import circle: {exc.args[1]}") from None


def _package(module: str) -> str:
    """``kvblend.engine.engine`` -> ``kvblend.engine``; a top-level module is its own node."""
    return ".".join(module.split(".")[:2])


def test_no_package_imports_one_that_imports_it_back() -> None:
    graph: dict[str, set[str]] = {}
    for module, deps in _imports().items():
        graph.setdefault(_package(module), set()).update(_package(d) for d in deps)
    for package, deps in graph.items():
        deps.discard(package)
    assert {"kvblend.engine", "kvblend.guard", "kvblend.eval", "kvblend.metrics"} <= set(graph)
    assert "kvblend.engine" in graph["kvblend.guard"] and "kvblend.metrics" in graph["kvblend.eval"]  # edges seen
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"package import circle: {exc.args[1]}") from None
