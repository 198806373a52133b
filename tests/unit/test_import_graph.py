"""The folders of the package depend one way (docs/architecture.md, "Layout and dependencies").

Every module under ``rlhf/`` and ``stages/`` is parsed with ``ast`` — imports inside functions
included, since a lazy import is still a dependency — and mapped to its unit: the folder it lives in
(``rlhf/engine/train.py`` → ``rlhf.engine``), or the module itself for the few entry modules at the
package root (``rlhf/generate.py`` → ``rlhf.generate``); each recipe is its own unit
(``stages.ppo``). The graph of units must have no cycle, and the bottom folders stay at the bottom.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "rlhf"
SCANNED = (PACKAGE, "stages")


def unit_of(module: str) -> str:
    """``rlhf.engine.train`` → ``rlhf.engine``; ``rlhf.generate`` → ``rlhf.generate``."""
    parts = module.split(".")
    return ".".join(parts[:2])


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(path: Path, module: str) -> set[str]:
    """Every module of the package that ``path`` imports, at any depth of the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # relative: resolve against this module's package
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # `from rlhf import config` imports the module rlhf.config
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {m for m in found if m.split(".")[0] in SCANNED}


def folder_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """unit → the units it imports (itself and the bare package left out)."""
    modules = {
        module_name(p, root): p
        for top in SCANNED
        if (root / top).is_dir()
        for p in sorted((root / top).rglob("*.py"))
    }
    graph: dict[str, set[str]] = {unit_of(m): set() for m in modules}
    for module, path in modules.items():
        src = unit_of(module)
        for target in imported_modules(path, module):
            # `from rlhf.ops import attend` names an attribute, not a module: keep the longest
            # prefix that is a module of the package
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            dst = unit_of(target)
            if target not in SCANNED and dst != src:
                graph[src].add(dst)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_find_cycle_sees_a_cycle_and_its_absence():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imports_inside_functions_count(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "x").mkdir(parents=True)
    (pkg / "y").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "x" / "a.py").write_text("def f():\n    from rlhf.y import b\n")
    (pkg / "y" / "b.py").write_text("from .. import x\nimport rlhf.x.a\n")
    graph = folder_graph(tmp_path)
    assert graph["rlhf.x"] == {"rlhf.y"} and graph["rlhf.y"] == {"rlhf.x"}
    assert find_cycle(graph) == ["rlhf.x", "rlhf.y", "rlhf.x"]


def test_package_folders_have_no_import_cycle():
    graph = folder_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "folder import cycle: " + " → ".join(cycle)


def test_bottom_folders_import_nothing_of_the_project_and_nothing_imports_stages():
    graph = folder_graph()
    assert graph["rlhf.algorithms"] == set() and graph["rlhf.ops"] == set()
    # rlhf/__main__.py runs a stage through importlib (by name), the one way in
    assert not [
        u
        for u, deps in graph.items()
        if u.startswith(PACKAGE) and any(d.startswith("stages") for d in deps)
    ]


# Import cycles between the files of one folder known today (issue 52): none may be added, and one
# that is gone must leave this list.
KNOWN_FILE_CYCLES = {
    frozenset({"rlhf.algorithms.estimators", "rlhf.algorithms.ppo"}),
    # (the issue counted four; data.arith, the real model's task, joined them as tool_arith did)
    frozenset(
        {
            "rlhf.data.arith",
            "rlhf.data.formats",
            "rlhf.data.records",
            "rlhf.data.synthetic",
            "rlhf.data.tool_arith",
        }
    ),
    frozenset({"rlhf.models.loading", "rlhf.models.streaming"}),
}


def file_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module → the modules of its own folder it imports (at any depth of the file)."""
    modules = {
        module_name(p, root): p
        for top in SCANNED
        if (root / top).is_dir()
        for p in sorted((root / top).rglob("*.py"))
    }
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for target in imported_modules(path, module):
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != module and unit_of(target) == unit_of(module):
                if not path.name == "__init__.py":
                    # a package's __init__ re-exports its files
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> set[frozenset]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycles_finds_components():
    assert cycles({"a": {"b"}, "b": {"a", "c"}, "c": set()}) == {frozenset({"a", "b"})}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == set()


def test_no_new_import_cycle_between_the_files_of_a_folder():
    found = cycles(file_graph())
    new = [sorted(c) for c in found - KNOWN_FILE_CYCLES]
    gone = [sorted(c) for c in KNOWN_FILE_CYCLES - found]
    assert not new, f"new import cycles between files of one folder: {new}"
    assert not gone, f"these cycles are gone: take them out of KNOWN_FILE_CYCLES: {gone}"
