"""No import circles inside a package: within backend/<pkg> (and tpllm_kernels/), module-to-module
imports must form a DAG, so every dependency inside a package points one way. Every import
statement counts, wherever it is: module level, inside a function (a "lazy" import still ties
the two modules together) and under `if TYPE_CHECKING:`. Read with ast: nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p for p in (ROOT / "backend").iterdir() if (p / "__init__.py").exists())
PACKAGES.append(ROOT / "tpllm_kernels")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, known: set[str], root: Path) -> set[str]:
    """The modules of `known` that the file at `path` imports, by any import statement in it.
    `from pkg import name` counts as pkg.name when that is a module, else as pkg itself."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . / .. import
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    return {m for m in found if m in known and m != name}


def import_graph(package_dir: Path, root: Path = ROOT) -> dict[str, set[str]]:
    files = sorted(package_dir.rglob("*.py"))
    known = {module_name(f, root) for f in files}
    return {module_name(f, root): imported_modules(f, known, root) for f in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path [a, b, ..., a], or None when the graph is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.mark.parametrize("package_dir", PACKAGES, ids=lambda p: p.name)
def test_no_import_cycles_inside_package(package_dir):
    graph = import_graph(package_dir)
    assert len(graph) > 1
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_checker_sees_function_level_and_type_checking_imports(tmp_path):
    """The checker itself: a circle closed only by a function-level import, or only under
    TYPE_CHECKING, is found (this is what the two circles it was written for looked like)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from .d import D\n")
    (pkg / "d.py").write_text("from pkg.c import x\n")
    graph = import_graph(pkg, tmp_path)
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.c"] == {"pkg.d"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    assert find_cycle({k: v for k, v in graph.items() if k not in ("pkg.a", "pkg.b")}) == \
        ["pkg.c", "pkg.d", "pkg.c"]
