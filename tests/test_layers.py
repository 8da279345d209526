"""The package's import graph, read from the source with ``ast``: no import cycle among kvemu's
modules, and the layering docs/extending.md's "Where things are" describes (the engine below replay, replay below the
report, the sweep and the CLI; only ``kvemu/backends.py`` imports the compiled module).

An edge is any ``import`` of a kvemu module: at module level (run when the module is imported) or
inside a function (run when it is called). Both count for the layering and for cycles: only
module-level ones can make a cycle fail at import time, but an import inside a function is an
arrow all the same, and a cycle it closes is a circle of the design. Importing ``kvemu.a.b`` also
imports the package ``kvemu.a`` first, so that is an edge too (unless ``kvemu.a`` contains the
importing module: a package is always imported before its modules).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvemu

PACKAGE_DIR = Path(kvemu.__file__).resolve().parent
COMPILED = "kvemu._kvemu_c"


def _module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


MODULES = _module_names()
KNOWN = set(MODULES) | {COMPILED}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    """The absolute module name a ``from ... import`` names, before its imported names."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not _is_package(importer):
        base.pop()
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(importer: str, node) -> list[str]:
    """The kvemu modules one import statement imports."""
    if isinstance(node, ast.Import):
        named = [a.name for a in node.names]
    else:
        base = _resolve(importer, node)
        # ``from pkg import sub`` imports the module pkg.sub; ``from mod import name`` imports mod
        named = [f"{base}.{a.name}" if f"{base}.{a.name}" in KNOWN else base for a in node.names]
    out = []
    for name in named:
        if not (name == "kvemu" or name.startswith("kvemu.")):
            continue
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in KNOWN and prefix != importer and not importer.startswith(prefix + "."):
                out.append(prefix)
    return out


def _is_type_checking(test) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str) -> list[tuple[str, bool, int]]:
    """(imported module, at module level, line) for every import in module ``name``."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    found = []

    def walk(node, module_level: bool):
        for child in ast.iter_child_nodes(node):
            level = module_level
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                level = False
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                # not run at import; walk the body as function-level, the else branch as it is
                for n in child.body:
                    walk_one(n, False)
                for n in child.orelse:
                    walk_one(n, module_level)
                continue
            walk_one(child, level)

    def walk_one(node, module_level: bool):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.extend((t, module_level, node.lineno) for t in _targets(name, node))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            module_level = False
        walk(node, module_level)

    walk(tree, True)
    return found


EDGES = {name: _imports(name) for name in MODULES}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_graph_reads_known_edges():
    """The graph holds what the source plainly says (guards the resolver itself)."""
    assert ("kvemu.errors", True) in {(t, lvl) for t, lvl, _ in EDGES["kvemu.schema"]}
    assert ("kvemu.output", False) in {(t, lvl) for t, lvl, _ in EDGES["kvemu.interrupt"]}
    assert any(t == COMPILED for t, _, _ in EDGES["kvemu.backends"])
    assert any(t == "kvemu.replay" for t, _, _ in EDGES["kvemu.cli"])
    # a module of a package imports the package's siblings, not the package itself
    assert "kvemu.replay" not in {t for t, _, _ in EDGES["kvemu.replay.run"]}
    assert len(MODULES) > 40


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycle_at_module_level():
    graph = {name: {t for t, level, _ in edges if level and t in MODULES} for name, edges in EDGES.items()}
    cycle = _cycle(graph)
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_counting_imports_inside_functions():
    """No circle at all: an import inside a function (for start-up time or an optional
    dependency) does not hide an arrow running back up."""
    graph = {name: {t for t, _, _ in edges if t in MODULES} for name, edges in EDGES.items()}
    cycle = _cycle(graph)
    where = [f"{a}:{min(line for t, _, line in EDGES[a] if t == b)} imports {b}"
             for a, b in zip(cycle, cycle[1:])] if cycle else []
    assert cycle is None, "import cycle: " + " -> ".join(cycle) + "\n" + "\n".join(where)


def test_cycle_check_sees_imports_inside_functions():
    """The graph holds a function-level import as an edge (what the test above relies on)."""
    assert ("kvemu.cli", False) in {(t, lvl) for t, lvl, _ in EDGES["kvemu.__main__"]}


def test_integrity_sits_below_schema():
    """The trace format (schema) uses the checksums (integrity), never the other way round, not even
    from inside a function: the two once imported each other."""
    assert not [line for t, _, line in EDGES["kvemu.integrity"] if t == "kvemu.schema"]
    assert "kvemu.integrity" in {t for t, _, _ in EDGES["kvemu.schema"]}


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


#: (importing package, packages it must not import), docs/extending.md's "Where things are": the engine model records
#: traces and knows nothing of replay or what reads results; replay knows nothing of its readers.
LAYERS = [
    ("kvemu.engine", ("kvemu.replay", "kvemu.report", "kvemu.analysis", "kvemu.cli", "kvemu.sweep", "kvemu.demo")),
    ("kvemu.replay", ("kvemu.report", "kvemu.cli", "kvemu.sweep", "kvemu.demo")),
]


@pytest.mark.parametrize("lower, above", LAYERS, ids=[low for low, _ in LAYERS])
def test_lower_layers_import_nothing_above(lower, above):
    bad = [f"{name}:{line} imports {t}" for name, edges in EDGES.items() if _in(name, lower)
           for t, _, line in edges if any(_in(t, a) for a in above)]
    assert not bad, "\n".join(bad)


def test_only_cli_imports_cli():
    # kvemu.__main__ is the entry point: it installs the signal handlers, then hands over to the CLI
    bad = [f"{name}:{line}" for name, edges in EDGES.items() if name not in ("kvemu.cli", "kvemu.__main__")
           for t, _, line in edges if t == "kvemu.cli"]
    assert not bad, "kvemu.cli imported by " + ", ".join(bad)


def test_only_backends_imports_the_compiled_module():
    bad = [f"{name}:{line}" for name, edges in EDGES.items() if name != "kvemu.backends"
           for t, _, line in edges if t == COMPILED]
    assert not bad, f"{COMPILED} imported by " + ", ".join(bad)
