"""The import graph of ``src/ragserve``: each package imports only the packages below it, and
no modules import each other in a circle, function-level (lazy) imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
# Lower imports nothing above it; packages on one level do not import each other.
LEVELS = {
    "paths": 0,
    "graph": 1,
    "workflows": 2,
    "generation": 3,
    "retrieval": 3,
    "scheduler": 4,
    "runtime": 5,
    "server": 6,
    "cli": 7,
    "__main__": 8,
}


def _modules(src: Path) -> dict[str, Path]:
    out = {}
    for path in sorted((src / "ragserve").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ragserve modules ``name`` imports anywhere in its body."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _graph(src: Path = SRC) -> dict[str, set[str]]:
    modules = _modules(src)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _package(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_packages_import_only_downward(src: Path = SRC) -> None:
    wrong = []
    for module, targets in _graph(src).items():
        own = _package(module)
        for target in targets:
            other = _package(target)
            if other == own:
                continue
            if not other or own not in LEVELS or LEVELS[other] >= LEVELS[own]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "upward or sideways imports:\n" + "\n".join(sorted(wrong))


def test_no_module_imports_itself_through_others(src: Path = SRC) -> None:
    graph = _graph(src)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path) -> None:
    pkg = tmp_path / "ragserve"
    for rel, text in {
        "__init__.py": "",
        "graph/__init__.py": "",
        "graph/b.py": "def f():\n    from ragserve.graph import c\n",
        "graph/c.py": "from .b import f\n",
        "generation/__init__.py": "import ragserve.runtime\n",
        "runtime/__init__.py": "",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    graph = _graph(tmp_path)
    assert graph["ragserve.graph.c"] == {"ragserve.graph.b"}
    assert graph["ragserve.graph.b"] == {"ragserve.graph", "ragserve.graph.c"}
    with pytest.raises(AssertionError, match="ragserve.graph.b"):
        test_no_module_imports_itself_through_others(tmp_path)
    with pytest.raises(AssertionError, match="ragserve.generation -> ragserve.runtime"):
        test_packages_import_only_downward(tmp_path)
