"""The map of the code, read with ast (nothing is imported):

- Between packages, imports point one way, down the layers
  client -> backend (the facade, serve) -> backend/triton -> backend/engine -> backend/model
  -> backend/parallel (communicators) -> tpllm_kernels. A module may import its own package and
  any package below it, never one above. backend.process_exit is a leaf every backend layer may
  use (it imports nothing of the project).
- Inside a package (backend/<pkg>, tpllm_kernels/, client/), module-to-module imports form a DAG, so every
  dependency inside a package points one way too.

Every import statement counts, wherever it is: module level, inside a function (a "lazy" import
still ties the two modules together) and under `if TYPE_CHECKING:`."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p for p in (ROOT / "backend").iterdir() if (p / "__init__.py").exists())
PACKAGES += [ROOT / "tpllm_kernels", ROOT / "client"]

# top to bottom; a module belongs to the longest of these that prefixes its name
LAYERS = ["client", "backend", "backend.triton", "backend.engine", "backend.model",
          "backend.parallel", "tpllm_kernels"]
NEUTRAL = {"backend.process_exit"}
# (importer, imported) pairs that point up the layers on purpose, each with its reason
UPWARD_ALLOWED = {
    ("backend.parallel.node", "backend.engine.tp.node"):
        "the documented `python -m backend.parallel.node` command; it forwards to the launcher "
        "only when run as a script (under `if __name__ == '__main__':`), never when imported",
}


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
    return project_graph([package_dir], root)


def project_graph(package_dirs: list[Path], root: Path) -> dict[str, set[str]]:
    """Module -> the modules it imports, over every .py file under `package_dirs`."""
    files = sorted(f for d in package_dirs for f in d.rglob("*.py"))
    known = {module_name(f, root) for f in files}
    return {module_name(f, root): imported_modules(f, known, root) for f in files}


def layer_of(module: str) -> int | None:
    """The module's layer (0 = top), None for a neutral module or one outside the layers."""
    if module in NEUTRAL:
        return None
    owners = [i for i, pkg in enumerate(LAYERS) if module == pkg or module.startswith(pkg + ".")]
    return max(owners, key=lambda i: len(LAYERS[i]), default=None)


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every (importer, imported) pair where the imported module sits in a higher layer."""
    found = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            a, b = layer_of(src), layer_of(dst)
            if a is not None and b is not None and b < a:
                found.append((src, dst))
    return found


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


def test_imports_point_down_the_layers():
    graph = project_graph([ROOT / "client", ROOT / "backend", ROOT / "tpllm_kernels"], ROOT)
    assert {layer_of(m) for m in graph} >= set(range(len(LAYERS)))  # every layer is seen
    bad = [e for e in upward_imports(graph) if e not in UPWARD_ALLOWED]
    assert not bad, "imports up the layers (" + " -> ".join(LAYERS) + "):\n" + "\n".join(
        f"  {a} imports {b}" for a, b in bad)
    for neutral in NEUTRAL:
        assert not graph[neutral], f"{neutral} is a leaf: it imports {graph[neutral]}"


def test_the_allowed_upward_imports_run_only_as_a_script():
    """An allowed upward import sits under `if __name__ == "__main__":`, so importing its module
    does not pull in the layer above."""
    for src, dst in UPWARD_ALLOWED:
        path = ROOT / Path(*src.split(".")).with_suffix(".py")
        tree = ast.parse(path.read_text())
        top_level = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
        top_level |= {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        assert dst not in top_level
        mains = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        assert any(isinstance(n, ast.ImportFrom) and n.module == dst
                   for m in mains for n in ast.walk(m)), (src, dst)
        assert project_graph([path.parent], ROOT)[src] == set()  # nothing of its own package


def test_the_checker_sees_an_import_up_the_layers(tmp_path):
    """The layer check itself: a function-level import of the engine from the model is found,
    an import down the layers is not."""
    for pkg in ("backend", "backend/engine", "backend/model"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "backend/engine/e.py").write_text("from backend.model.m import x\n")
    (tmp_path / "backend/model/m.py").write_text("def f():\n    from backend.engine import e\n")
    graph = project_graph([tmp_path / "backend"], tmp_path)
    assert upward_imports(graph) == [("backend.model.m", "backend.engine.e")]
