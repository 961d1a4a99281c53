"""The import graph of lenskit/ and lenses/, read from the source with `ast`: no module imports another that (through
any chain) imports it back, and lenskit imports its own modules inside functions only where that keeps start-up fast
or an optional dependency optional (at most FUNCTION_LEVEL_LIMIT of them). An import under `if TYPE_CHECKING:` is an
annotation, not a runtime edge, and is not counted."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FUNCTION_LEVEL_LIMIT = 15

# Circles allowed for now, each named so that nothing else can hide behind it: none (issue 35 broke them all).
KNOWN_CYCLES: dict = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(module: str, node: ast.Import | ast.ImportFrom, is_package: bool, modules: set[str]) -> list[str]:
    """The package modules `node` imports: `from a import b` is module a.b where that is a module, else a."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    out = []
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append(name)
    return out


def graph(packages: tuple[str, ...] = ("lenskit", "lenses")) -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """Runtime import edges between the packages' modules, and every import of a lenskit module inside a function
    (file, line, module imported)."""
    files = {module_name(p): p for package in packages for p in (ROOT / package).rglob("*.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    local = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        annotations_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                            for stmt in node.body for n in ast.walk(stmt)}
        in_function = {id(n) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(node)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in annotations_only:
                continue
            for target in imported(module, node, path.name == "__init__.py", set(files)):
                edges[module].add(target)
                if id(node) in in_function and target.startswith("lenskit") and module.startswith("lenskit"):
                    local.append((str(path.relative_to(ROOT)), node.lineno, target))
    return edges, local


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(set(edges) | {t for ts in edges.values() for t in ts}):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.fixture(scope="module")
def import_graph():
    return graph()


def test_the_graph_reader_sees_cycles_and_skips_annotations():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lenskit.model import X\n")
    guarded = [n for n in ast.walk(tree) if isinstance(n, ast.If)][0]
    assert "TYPE_CHECKING" in ast.unparse(guarded.test)
    edges, _ = graph()
    assert "lenskit.model" in edges["lenskit"] and "lenskit.io.loading" in edges["lenskit.model"]  # edges are read
    assert "lenskit.model" not in edges["lenskit.generation"]  # its `HookedTransformer` is an annotation only


def test_no_import_cycles(import_graph):
    edges, _ = import_graph
    left = [c for c in cycles(edges) if not any(all(known(m) for m in c) for known in KNOWN_CYCLES.values())]
    assert not left, "import circles (break them by moving the shared piece down, or passing it in): " + "; ".join(
        " <-> ".join(c) for c in left)


def test_lenskit_never_imports_lenses(import_graph):
    edges, _ = import_graph
    wrong = sorted((m, t) for m, ts in edges.items() if m.startswith("lenskit") for t in ts if t.startswith("lenses"))
    assert not wrong, wrong


def test_few_imports_inside_functions(import_graph):
    _, local = import_graph
    assert len(local) <= FUNCTION_LEVEL_LIMIT, "\n".join(f"{f}:{line} -> {t}" for f, line, t in local)
