"""The package's modules form layers: no import circle, not even through an import
inside a function (#10 tidy), and neither do its packages (#21): they import each other
one way only, lazy imports included, in the order ``LAYERS`` lists (docs/structure.md
says the same). Only ``kvblend.cluster`` imports ray (the optional ``cluster`` extra)."""

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


# bottom to top: a package imports only those listed before it (errors, metrics and data
# import nothing of kvblend)
LAYERS = ("errors", "metrics", "data", "rope", "models", "generation", "store", "blend", "pipeline", "engine",
          "guard", "rag", "settings", "cliargs", "eval", "server", "cluster", "commands", "demo", "cli", "__main__")


def test_packages_import_in_the_documented_order() -> None:
    rank = {f"kvblend.{name}": i for i, name in enumerate(LAYERS)}
    edges = {(_package(m), _package(d)) for m, deps in _imports().items() for d in deps}
    packages = {p for edge in edges for p in edge}
    assert packages <= set(rank), sorted(packages - set(rank))  # a new package: place it in LAYERS
    upward = sorted(f"{a} -> {b}" for a, b in edges if a != b and rank[b] > rank[a])
    assert not upward, upward


def _imports_ray(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ray":
            return True
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "ray" for a in node.names):
            return True
    return False


def test_only_the_cluster_package_imports_ray() -> None:
    users = {_module_name(f) for f in ROOT.rglob("*.py") if _imports_ray(f)}
    assert users, "kvblend.cluster should import ray"
    assert all(u.startswith("kvblend.cluster") for u in users), sorted(users)


def test_cluster_sits_between_server_and_commands() -> None:
    graph = _imports()
    cluster = {m: d for m, d in graph.items() if m.startswith("kvblend.cluster.")}
    assert any(d.startswith("kvblend.server.") for deps in cluster.values() for d in deps)
    below = ("kvblend.server.", "kvblend.commands.", "kvblend.engine.", "kvblend.store.", "kvblend.rag.")
    for module, deps in graph.items():
        if module.startswith(below):
            assert not any(d.startswith("kvblend.cluster") for d in deps), module
    assert any(d.startswith("kvblend.cluster") for d in graph["kvblend.cli"])
