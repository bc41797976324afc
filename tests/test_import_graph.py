"""No import circles between the project's own modules (issue 41).

The graph is drawn from the source with `ast`, not by importing anything. Every `import` and
`from ... import` counts, at module level and inside functions alike: moving an import into a
function hides a circle from the interpreter but leaves the two modules depending on each other.
Only `if TYPE_CHECKING:` blocks are left out, since nothing in them runs.

How an import becomes edges, for a module M importing `a.b.c`:
- M depends on `a.b.c`, and on each of its packages (`a`, `a.b`) that is not also a package of M,
  because importing `a.b.c` runs `a/__init__.py` and `a/b/__init__.py` first. M's own packages
  are left out: they have begun importing before M runs, so an edge to them says nothing (a
  package `__init__` that re-exports its submodules is not a circle).
- `from a.b import c` depends on `a.b.c` when `c` is a submodule, else on `a.b` alone.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Circles known and not yet broken, each with the reason it is still here. Keyed by the
# circle's modules, so any NEW circle (or a known one that grows) still fails the test.
ALLOWED_CIRCLES: dict[frozenset[str], str] = {}


@dataclass(frozen=True, slots=True)
class Edge:
    """`source` imports `target` at `path:line`."""

    source: str
    target: str
    path: str
    line: int


def first_party_packages() -> list[str]:
    """The top-level packages pyproject.toml ships (its `packages.find.include` patterns; read
    with a pattern, since tomllib is not in Python 3.10, which the project supports)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[tool.setuptools.packages.find]", 1)[1]
    found = re.search(r"^include\s*=\s*\[([^\]]*)\]", section, re.MULTILINE)
    assert found, "pyproject.toml: no include = [...] under [tool.setuptools.packages.find]"
    include = re.findall(r'"([^"]+)"', found.group(1))
    names = sorted({pattern.rstrip("*").rstrip(".") for pattern in include})
    return [name for name in names if (ROOT / name / "__init__.py").is_file()]


def module_files(packages: list[str]) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file under the given packages."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, functions included, `if TYPE_CHECKING:` bodies not."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                if isinstance(stmt, ast.Import | ast.ImportFrom):
                    yield stmt
                else:
                    yield from _import_nodes(stmt)
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        else:
            yield from _import_nodes(child)


def _packages_of(module: str, is_package: bool) -> set[str]:
    """The packages whose `__init__` has begun importing before `module` runs (itself included)."""
    parts = module.split(".")
    own = {".".join(parts[:i]) for i in range(1, len(parts))}
    if is_package:
        own.add(module)
    return own


def _with_parents(target: str) -> list[str]:
    parts = target.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement loads (submodule candidates included)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    return [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]


def import_edges() -> list[Edge]:
    """Every first-party import edge of the first-party packages (see the module docstring)."""
    modules = module_files(first_party_packages())
    edges: list[Edge] = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        own = _packages_of(module, is_package)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _import_nodes(tree):
            targets: set[str] = set()
            for name in _imported_names(node, module, is_package):
                targets.update(t for t in _with_parents(name) if t in modules)
            for target in sorted(targets - own - {module}):
                edges.append(Edge(module, target, str(path.relative_to(ROOT)), node.lineno))
    return edges


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph is deep enough to trouble recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def one_cycle(component: list[str], edges: list[Edge]) -> list[Edge]:
    """A shortest cycle through the component's first member, as the edges that make it."""
    members = set(component)
    out: dict[str, list[Edge]] = {}
    for edge in edges:
        if edge.source in members and edge.target in members:
            out.setdefault(edge.source, []).append(edge)
    start = component[0]
    came_by: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for edge in out.get(node, []):
                if edge.target == start:
                    path = [edge]
                    while path[0].source != start:
                        path.insert(0, came_by[path[0].source])
                    return path
                if edge.target not in came_by:
                    came_by[edge.target] = edge
                    following.append(edge.target)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {component}")


def describe(component: list[str], edges: list[Edge]) -> str:
    lines = [f"circle of {len(component)} modules: {', '.join(component)}", "  for example:"]
    for edge in one_cycle(component, edges):
        lines.append(f"    {edge.source} -> {edge.target}  ({edge.path}:{edge.line})")
    return "\n".join(lines)


def test_the_graph_sees_the_import_forms() -> None:
    edges = import_edges()
    pairs = {(edge.source, edge.target) for edge in edges}
    modules = module_files(first_party_packages())
    assert {"engine", "analysis", "workloads", "reports", "profiling", "conf"} <= set(modules)
    # A plain module-level `from x import y`.
    assert ("engine.frontend.llm", "engine.config") in pairs
    # An import inside a function counts (workloads/compare_cli.py's `_compare_runs`).
    assert ("workloads.compare_cli", "workloads.compare_runs") in pairs
    # Importing `engine.distributed.netif` from outside the package runs its `__init__` too.
    assert ("engine.kv_transfer.mooncake_transfer", "engine.distributed") in pairs
    assert ("engine.kv_transfer.mooncake_transfer", "engine.distributed.netif") in pairs
    # An `if TYPE_CHECKING:` import does not count (engine/kv_transfer/factory.py's EngineConfig).
    assert ("engine.kv_transfer.factory", "engine.config") not in pairs
    assert not any(edge.source == edge.target for edge in edges)
    # A package's own `__init__` is never an edge of its submodules.
    assert not any(edge.source.startswith(edge.target + ".") for edge in edges)


def test_strongly_connected_finds_a_planted_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    components = sorted(strongly_connected(graph))
    assert components == [["a", "b", "c"], ["d"]]


def test_no_import_circles() -> None:
    edges = import_edges()
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    circles = [c for c in strongly_connected(graph) if len(c) > 1]
    new = [c for c in circles if frozenset(c) not in ALLOWED_CIRCLES]
    stale = [sorted(k) for k in ALLOWED_CIRCLES if list(sorted(k)) not in circles]
    report = "\n".join(describe(c, edges) for c in new)
    assert not new, f"{len(new)} import circle(s):\n{report}"
    assert not stale, f"allow-listed circles that no longer exist (remove them): {stale}"


def test_reports_read_run_folders_and_analysis_sits_below_both() -> None:
    """`reports` reads run folders only, so it never imports `workloads` (which runs experiments;
    `workloads` may import `reports`); what both read, `analysis`, imports neither (issue 56)."""
    forbidden = {"reports": {"workloads"}, "analysis": {"workloads", "reports"}}
    bad = [edge for edge in import_edges()
           if edge.target.split(".")[0] in forbidden.get(edge.source.split(".")[0], set())]  # fmt: skip
    assert not bad, "\n".join(f"{e.source} -> {e.target}  ({e.path}:{e.line})" for e in bad)
