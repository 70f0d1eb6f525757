"""The package's import graph has no cycle, and the engine takes settings as arguments.

Read from the source with ``ast`` (imports inside functions count too: a cycle hidden in a
function body is still two modules that cannot be understood apart).
"""

from __future__ import annotations

import ast
from pathlib import Path

import specbatch

ROOT = Path(specbatch.__file__).parent


def import_graph() -> dict[str, set[str]]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if ".migrations." not in name + ".":
            mods[name] = path
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    if sub in mods:
                        graph[name].add(sub)
                    elif node.module in mods:
                        graph[name].add(node.module)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in mods}
    for name in graph:     # a package's __init__ importing its own modules is not a cycle
        graph[name] = {m for m in graph[name] if not (m.startswith(name + ".") and name != "specbatch")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_the_package() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_engine_imports_no_db_celery_click_or_settings() -> None:
    """Settings are passed in (cache_dir, device, ...): the engine reads no SPECBATCH_* itself."""
    graph = import_graph()
    engine = [m for m in graph if m.startswith("specbatch.engine")]
    bad = {m: sorted(d for d in graph[m] if d.startswith(("specbatch.db", "specbatch.worker", "specbatch.cli",
                                                            "specbatch.jobs", "specbatch.api", "specbatch.config")))
           for m in engine}
    assert {m: d for m, d in bad.items() if d} == {}
