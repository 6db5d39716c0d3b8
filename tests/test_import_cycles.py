"""kvflow's modules import each other without a circle: the package's layers stay a stack.

The graph is read from the source with ast, not by importing: an edge M -> T for every import of a
kvflow module T anywhere in M, at module level or inside a function (a lazy import back into a
module is still a circle, only a hidden one), but not under `if TYPE_CHECKING:` (never executed).
`from kvflow.x import name` is an import of kvflow.x.name when that is a module, else of kvflow.x;
a package stands for its __init__.py. Imports by string (importlib.import_module) are not seen.

Parent packages: importing kvflow.a.b executes kvflow/a/__init__.py first, so it also counts as an
import of kvflow.a -- except for the packages that contain M itself. Those are already executing
when M runs (Python starts the parents before the child), so an implicit edge back to them closes
no circle; counting them would make every package whose __init__ imports its own submodules, and
the lazy top-level __getattr__ of kvflow/__init__.py, look like circles. An explicit import of
such a package (`from kvflow.core import Scheduler` inside kvflow/core/) does count.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "kvflow"

def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package at root (a package is its
    __init__.py)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name,) + path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, module: str, is_package: bool, modules) -> set[str]:
    """The modules of `modules` that tree's import statements name, skipping `if TYPE_CHECKING:`
    bodies."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:          # relative: from the package, one level up per extra dot
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1] + ([base] if base else [])
                base = ".".join(parts)
            for a in node.names:
                name = base if a.name == "*" or f"{base}.{a.name}" not in modules \
                    else f"{base}.{a.name}"
                if name in modules:
                    found.add(name)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (see the module docstring for the rules)."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = _imports(tree, module, path.name == "__init__.py", modules)
        own = set(_parents(module))
        implicit = {p for t in targets for p in _parents(t) if p in modules and p not in own}
        graph[module] = (targets | implicit) - {module}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """Per strongly connected group of modules (Tarjan): one circle in it, as a path that ends
    where it starts, and the whole group."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted((_circle_in(graph, set(g)), g) for g in groups)


def _circle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest circle from the group's first module back to it, inside the group."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return path[::-1] + [start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle in {group}")


def test_no_module_imports_itself_back_through_others():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(
        " -> ".join(circle) + (f"\n  (one of the circles among {', '.join(group)})"
                               if len(group) + 1 > len(circle) else "")
        for circle, group in cycles)


def test_the_scan_counts_lazy_imports_and_parents_but_not_type_checking(tmp_path):
    """The rules above, on a made-up package (so that the real test cannot pass vacuously)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.a import A\n",
        "a.py": "A = 1\ndef f():\n    from pkg.sub import b\n",     # lazy: counts
        "sub/__init__.py": "from . import b\n",                       # own parent: no circle
        "sub/b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.c\n"
                     "else:\n    from .. import d\nfrom pkg.sub import helper\n"),
        "sub/helper.py": "",
        "c.py": "import pkg.sub.b\n",
        "d.py": "from pkg.a import A\n",
        "sub/e.py": "from pkg.sub import NAME\n",   # an explicit import of its own parent counts
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.b"}          # b's parent package runs first
    assert graph["pkg.sub"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.d", "pkg.sub.helper"}   # not pkg.c; pkg.sub is its own
    assert graph["pkg.c"] == {"pkg.sub", "pkg.sub.b"}
    assert graph["pkg.sub.e"] == {"pkg.sub"}
    assert find_cycles(graph) == [(["pkg.a", "pkg.sub.b", "pkg.d", "pkg.a"],
                                   ["pkg.a", "pkg.d", "pkg.sub", "pkg.sub.b"])]
