"""The import graph's rules, read with `ast` (nothing is imported): every `import` of every module of
pipeline/ and lockstep_kernels/, at module level and inside functions (a late import is still a
dependency); imports under `if TYPE_CHECKING:` are left out (they never run).

  - no import cycle between modules;
  - lockstep_kernels imports nothing from pipeline (the kernel library does not depend on the app);
  - pipeline.launch is the top floor: only launch/ itself and cli.py import it;
  - pipeline.run is the ground floor: it imports nothing of Lockstep but pipeline.utils.

An import that breaks a rule in code another change is fixing may be listed in KNOWN_EDGES (empty now):
the checks leave it out, and test_known_edges_still_exist says when it is gone, so the entry goes too.
"""

from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("pipeline", "lockstep_kernels")

# (importer, imported) -> why it is still there. Each closes an import cycle (or, the first, makes the
# kernel library import the app); without them the graph has no cycle.
KNOWN_EDGES: dict[tuple[str, str], str] = {}  # none left: every rule holds for the whole tree

LAUNCH_USERS = ("pipeline.launch", "pipeline.cli")  # who may import pipeline.launch
RUN_MAY_IMPORT = ("pipeline.run", "pipeline.utils")  # all pipeline.run may import of Lockstep


def module_files() -> dict[str, tuple[str, bool]]:
    """module name -> (file, is a package's __init__)."""
    out = {}
    for top in PACKAGES:
        for d, _, files in os.walk(os.path.join(REPO, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                    out[name.removesuffix(".__init__")] = (path, name.endswith(".__init__"))
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(node: ast.AST):
    """Every Import / ImportFrom at or under `node` that can run (not under `if TYPE_CHECKING:`)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    elif isinstance(node, ast.If) and _is_type_checking(node):
        for stmt in node.orelse:
            yield from _imports(stmt)
    else:
        for child in ast.iter_child_nodes(node):
            yield from _imports(child)


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {Lockstep module it imports: line of the first such import}. `from a import b` is an
    import of a.b when that is a module, else of a; a name resolves to the nearest module that exists."""
    files = module_files()

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, (path, is_pkg) in files.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        edges: dict[str, int] = {}
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    pkg = mod if is_pkg else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                r = resolve(t)
                if r and r != mod:
                    edges.setdefault(r, node.lineno)
        graph[mod] = edges
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm: the components of more than one module (each is one or more cycles)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def cycle_in(graph: dict[str, dict[str, int]], comp: list[str]) -> str:
    """One cycle through a component, as 'a (line 3) -> b (line 9) -> a'."""
    members, start = set(comp), comp[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to start
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    hops = paths[v] + [start]
                    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(hops, hops[1:])) + f" -> {start}"
                if w in members and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {comp}")


def edges(graph, src_prefix: str, dst_prefix: str) -> list[tuple[str, str, int]]:
    return [(a, b, line) for a, targets in sorted(graph.items()) for b, line in sorted(targets.items())
            if _under(a, src_prefix) and _under(b, dst_prefix)]


def _under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_graph_is_read(graph):
    """A sanity check of the reader: module- and function-level imports, relative ones too."""
    assert "pipeline.run" in graph["pipeline.trainer.loop"]
    assert "pipeline.rollout.engine.server" in graph["pipeline.launch.component"]  # inside main()
    assert "pipeline.run.rundir" in graph["pipeline.run"]


def test_no_import_cycles(graph):
    rest = {a: {b: n for b, n in targets.items() if (a, b) not in KNOWN_EDGES} for a, targets in graph.items()}
    comps = strongly_connected(rest)
    assert not comps, "import cycles:\n" + "\n".join(cycle_in(rest, comp) for comp in comps)


def test_kernels_do_not_import_pipeline(graph):
    bad = [e for e in edges(graph, "lockstep_kernels", "pipeline") if e[:2] not in KNOWN_EDGES]
    assert not bad, "lockstep_kernels imports pipeline:\n" + "\n".join(f"{a} -> {b} (line {n})" for a, b, n in bad)


def test_known_edges_still_exist(graph):
    """An entry of KNOWN_EDGES whose import is gone must go too (the exception would hide a new one)."""
    stale = [f"{a} -> {b}" for a, b in KNOWN_EDGES if b not in graph.get(a, {})]
    assert not stale, "delete these KNOWN_EDGES entries, the imports are gone: " + ", ".join(stale)


def test_launch_is_the_top_floor(graph):
    bad = [(a, b, n) for a, b, n in edges(graph, "pipeline", "pipeline.launch")
           if not any(_under(a, user) for user in LAUNCH_USERS)]
    assert not bad, "imports of pipeline.launch from below it:\n" + "\n".join(f"{a} -> {b} (line {n})" for a, b, n in bad)


def test_run_is_the_ground_floor(graph):
    bad = [(a, b, n) for a, b, n in edges(graph, "pipeline.run", "pipeline")
           if not any(_under(b, ok) for ok in RUN_MAY_IMPORT)]
    bad += edges(graph, "pipeline.run", "lockstep_kernels")
    assert not bad, "pipeline.run imports:\n" + "\n".join(f"{a} -> {b} (line {n})" for a, b, n in bad)
