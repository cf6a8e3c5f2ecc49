"""The layering rules of ARCHITECTURE.md, checked on the source so that they fail when broken:

- the scheduler and the KV store modules import no torch;
- `import shoal`, `shoal.sampling_params` and `shoal.kv_cache.hashing` load neither torch nor
  transformers (the package is lazy);
- no import cycles between the modules of shoal/, nor between its packages (each
  subpackage, and each top-level module, is one node; every import counts, deferred ones too);
- no function or method in shoal/ over 80 lines, no file over 450.

The import probes run in fresh interpreters (this process has torch loaded already). A
meta-path hook stops the first import of a forbidden package and reports the chain of shoal
modules that led to it, so a probe costs tens of milliseconds even while it fails."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shoal"
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 450

# ---- imports that must stay light ----------------------------------------------------------

# Run in a fresh interpreter: argv[1] the module to import, argv[2:] the forbidden packages.
_PROBE = r'''
import json, sys

target, forbidden = sys.argv[1], set(sys.argv[2:])

class Forbidden(BaseException):  # not an Exception: no `except ImportError` can swallow it
    pass

def _chain(frame):
    """file:line of each shoal frame from the outermost in, then the direct importer."""
    out, first = [], None
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.startswith("<frozen"):
            where = f"{code.co_filename}:{frame.f_lineno}"
            first = first or where
            if (frame.f_globals.get("__name__") or "").split(".")[0] == "shoal":
                out.append(where)
        frame = frame.f_back
    out.reverse()
    if first and first not in out:
        out.append(first)
    return out

def _is_import(frame):  # a real import, not importlib.util.find_spec
    while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
        if frame.f_code.co_name == "_find_and_load":
            return True
        frame = frame.f_back
    return False

class Spy:
    def find_spec(self, name, path=None, target=None):
        if name in forbidden and _is_import(sys._getframe(1)):
            raise Forbidden(name, _chain(sys._getframe(1)))
        return None

sys.meta_path.insert(0, Spy())
try:
    __import__(target)
except Forbidden as e:
    print(json.dumps({"forbidden": e.args[0], "chain": e.args[1]}))
else:
    print(json.dumps({"loaded": sorted(forbidden & set(sys.modules))}))
'''

TORCH_FREE = ["shoal.engine.scheduler", "shoal.kv_offload.store", "shoal.kv_offload.connector",
              # the server's frontend process: it tokenizes, never runs the model
              "shoal.entrypoints.openai.api_server", "shoal.loader.tokenizers"]
LIGHT = ["shoal", "shoal.sampling_params", "shoal.kv_cache.hashing"]


def _probe(module: str, forbidden: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PROBE, module, *forbidden], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"`import {module}` failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_light(module: str, forbidden: list[str]) -> None:
    res = _probe(module, forbidden)
    if "forbidden" in res:
        root = str(ROOT) + "/"
        chain = "\n    -> ".join(c.removeprefix(root) for c in res["chain"])
        pytest.fail(f"`import {module}` imports {res['forbidden']}, first through:\n    {chain}\n  "
                    f"{_static_report(module, forbidden)}")
    assert not res["loaded"], f"`import {module}` loaded {res['loaded']}"


def _static_report(module: str, forbidden: list[str]) -> str:
    """Every module-level import of a forbidden package that `import module` reaches, with
    the shortest shoal import path to it: the list of what to fix, not just the first one.
    What the packages above the module reach (Python runs their __init__ first) is summed up
    in a line each: the probe of that package lists it."""
    graph, external = _scan()
    seen: set[str] = set()
    found = [f"{' -> '.join(path)}  ({_rel(MODULES[reached])}:{external[reached][pkg]} "
             f"imports {pkg})"
             for reached, path in _reachable(graph, [module], seen)
             for pkg in forbidden if pkg in external[reached]]
    lines = ["Its import-time imports of them (ast):", *found] if found else []
    for package in _ancestors(module):
        n = sum(pkg in external[reached] for reached, _ in _reachable(graph, [package], seen)
                for pkg in forbidden)
        if n:
            lines.append(f"and {n} {'more ' if found else ''}through {_rel(MODULES[package])}, "
                         "which Python runs first")
    return "\n    ".join(lines)


def _reachable(graph: dict[str, dict[str, int]], sources: list[str], seen: set[str]):
    """(module, shortest path to it) for each module reached from sources and not in seen."""
    prev: dict[str, str | None] = {s: None for s in sources if s in graph and s not in seen}
    queue = deque(prev)
    seen.update(prev)
    while queue:
        node = queue.popleft()
        path = [node]
        while prev[path[-1]] is not None:
            path.append(prev[path[-1]])
        yield node, path[::-1]
        for child in graph[node]:
            if child not in seen:
                seen.add(child)
                prev[child] = node
                queue.append(child)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_scheduler_and_kv_store_import_no_torch(module: str):
    _check_light(module, ["torch"])


@pytest.mark.parametrize("module", LIGHT)
def test_light_modules_load_neither_torch_nor_transformers(module: str):
    _check_light(module, ["torch", "transformers"])


def test_lazy_package_still_exports_its_names():
    proc = subprocess.run(
        [sys.executable, "-c", "from shoal import LLM, SamplingParams, RequestOutput, "
         "CompletionOutput; print(LLM.__name__, SamplingParams.__name__)"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["LLM", "SamplingParams"]


# ---- the module graph ----------------------------------------------------------------------


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package."""
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()
_TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_time_statements(body: list[ast.stmt]):
    """The statements Python runs when the module is imported: the module body and the
    blocks nested in it (if/try/with/loops, class bodies), but not function bodies nor the
    body of `if TYPE_CHECKING:`."""
    for node in body:
        yield node
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_time_statements(node.orelse)
            continue
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, field, []) or []:
                inner = child.body if isinstance(child, ast.ExceptHandler | ast.match_case) \
                    else [child]
                yield from _import_time_statements(inner)


def _resolve_from(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")
    drop = node.level - 1 + (0 if is_package else 1)
    base = base[: len(base) - drop]
    return ".".join(base + ([node.module] if node.module else []))


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules of shoal whose code runs because of this import statement.

    `import a.b.c` and `from a.b.c import x` run a.b.c and the __init__ of each package above
    it. `from a.b import c` runs a.b.c when c is a submodule, and needs a.b's __init__ to
    have finished when c is a name it defines (a re-export). The importer's own packages are
    left out unless named: Python initialises them before the importer, so a submodule
    reaching its package implicitly, or taking a sibling submodule from it (`from . import
    sibling`), is no cycle; taking a re-exported name from it is an edge like any other."""
    own = set(_ancestors(module))
    if isinstance(node, ast.Import):
        named = [alias.name for alias in node.names]
    else:
        base = _resolve_from(module, node)
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
        reads_init = len(subs) < len(node.names)
        named = subs + ([base] if reads_init or base not in own else [])
        own.add(base)  # running base's __init__ because of a submodule: as for ancestors
    out = []
    for target in named:
        for name in [*_ancestors(target), target]:
            if name in MODULES and name != module and (name == target or name not in own):
                out.append(name)
    return out


def _statements(tree: ast.Module, deferred: bool):
    if deferred:  # every import, run at import time or not (as a type checker sees them)
        return (node for stmt in tree.body for node in ast.walk(stmt))
    return _import_time_statements(tree.body)


@functools.cache
def _scan(deferred: bool = False) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """The import-time imports of each module (all of them with deferred=True, those inside
    functions and under TYPE_CHECKING too): {shoal module: line} (the import graph) and
    {top-level outside package: line}, each at the line of its first import."""
    graph: dict[str, dict[str, int]] = {}
    external: dict[str, dict[str, int]] = {}
    for module, tree in _TREES.items():
        edges, outside = graph.setdefault(module, {}), external.setdefault(module, {})
        for node in _statements(tree, deferred):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _imported(module, node):
                    edges.setdefault(target, node.lineno)
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [] if node.level else [node.module or ""])
                for name in names:
                    if name.split(".")[0] != "shoal":
                        outside.setdefault(name.split(".")[0], node.lineno)
    return graph, external


def _import_graph(deferred: bool = False) -> dict[str, dict[str, int]]:
    """module -> {imported module: line of its first import}."""
    return _scan(deferred)[0]


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))
    return components


def _shortest_cycle(graph: dict[str, dict[str, int]], comp: list[str]) -> list[str]:
    """One shortest cycle through the first module of a component (BFS inside it)."""
    start, members = comp[0], set(comp)
    prev: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in graph[node]:
            if child not in members:
                continue
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if child not in prev:
                prev[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start}")


def _describe_cycle(graph: dict[str, dict[str, int]], comp: list[str]) -> str:
    cycle = _shortest_cycle(graph, comp)
    steps = [f"{_rel(MODULES[a])}:{graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:])]
    head = " <-> ".join(comp) if len(comp) <= 6 else f"{len(comp)} modules: {', '.join(comp)}"
    return f"{head}\n      " + "\n      ".join(steps)


@pytest.mark.parametrize("deferred", [False, True], ids=["import-time", "every-import"])
def test_no_import_cycles(deferred):
    """Cycles among import-time imports break imports; cycles through imports inside functions
    or under TYPE_CHECKING do not, but still tangle two modules that each need the other."""
    graph = _import_graph(deferred)
    cycles = _strongly_connected(graph)
    if cycles:
        pytest.fail(
            f"{len(cycles)} import cycle(s) between modules of shoal/ (deferred imports "
            f"counted: {deferred}; break each by moving the shared piece into a lower module):"
            "\n  - "
            + "\n  - ".join(_describe_cycle(graph, c) for c in cycles))


def _package_of(module: str) -> str | None:
    """shoal.engine.core -> shoal.engine; a top-level module is its own node; the package's
    own __init__ (the lazy facade: LLM, SamplingParams) is above everything and left out."""
    parts = module.split(".")
    return None if len(parts) == 1 else ".".join(parts[:2])


def _package_graph() -> dict[str, dict[str, tuple[str, int]]]:
    """package -> {imported package: (first importing module, line)}, every import counted."""
    graph: dict[str, dict[str, tuple[str, int]]] = {}
    for module, edges in _import_graph(deferred=True).items():
        src = _package_of(module)
        if src is None:
            continue
        out = graph.setdefault(src, {})
        for target, line in edges.items():
            dst = _package_of(target)
            if dst is not None and dst != src:
                out.setdefault(dst, (module, line))
    return graph


def test_no_cycles_between_packages():
    """A package imports only packages below it: a cycle between two packages means each
    needs the other, which is where a shared piece belongs one level lower."""
    graph = _package_graph()
    plain = {src: {dst: line for dst, (_, line) in out.items()} for src, out in graph.items()}
    cycles = _strongly_connected(plain)
    if cycles:
        lines = []
        for comp in cycles:
            cycle = _shortest_cycle(plain, comp)
            lines.append(" -> ".join(cycle) + "\n      " + "\n      ".join(
                f"{_rel(MODULES[graph[a][b][0]])}:{graph[a][b][1]} imports {b}"
                for a, b in zip(cycle, cycle[1:])))
        pytest.fail(f"{len(cycles)} cycle(s) between packages of shoal/:\n  - "
                    + "\n  - ".join(lines))


def test_import_graph_sees_the_imports():
    """The graph itself: a guard against a parser change that would find no edges at all."""
    graph = _import_graph()
    assert "shoal.core.request" in graph["shoal.engine.scheduler"]
    assert sum(len(e) for e in graph.values()) > len(graph)


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"e": 5}}
    assert _strongly_connected(graph) == [["a", "b", "c"]]
    assert _shortest_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


_FAKE_TREE = {"p": "p/__init__.py", "p.a": "p/a.py", "p.b": "p/b.py",
              "q": "q/__init__.py", "q.m": "q/m.py"}


@pytest.mark.parametrize("module,statement,edges", [
    ("p.a", "from .b import X", ["p.b"]),
    ("p.a", "from . import b", ["p.b"]),
    ("p.a", "import p.b", ["p.b"]),
    ("p.a", "from p import Reexported", ["p"]),  # p's __init__ must have finished
    ("p", "from . import a", ["p.a"]),
    ("p", "from p.a import X", ["p.a"]),
    ("p.a", "from q.m import X", ["q", "q.m"]),  # q's __init__ runs first
    ("p.a", "from q import m, Reexported", ["q.m", "q"]),
    ("p.a", "import torch.nn", []),
])
def test_import_resolution(monkeypatch, module: str, statement: str, edges: list[str]):
    monkeypatch.setattr(sys.modules[__name__], "MODULES",
                        {name: Path(path) for name, path in _FAKE_TREE.items()})
    assert _imported(module, ast.parse(statement).body[0]) == edges


# ---- function length -----------------------------------------------------------------------


@dataclass
class _Function:
    path: Path
    line: int
    name: str
    lines: int


def _functions(path: Path, tree: ast.Module) -> list[_Function]:
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                found.append(_Function(path, child.lineno, name,
                                       child.end_lineno - child.lineno + 1))
                visit(child, f"{name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def test_no_function_over_80_lines():
    long = [f for m, tree in _TREES.items() for f in _functions(MODULES[m], tree)
            if f.lines > MAX_FUNCTION_LINES]
    if long:
        pytest.fail(
            f"{len(long)} function(s) in shoal/ over {MAX_FUNCTION_LINES} lines (docstring "
            "included); split each into named steps:\n  "
            + "\n  ".join(f"{_rel(f.path)}:{f.line} {f.name} ({f.lines} lines)" for f in long))


def test_no_file_over_450_lines():
    """A file past this has grown a second idea: split it where the ideas part."""
    lines = {_rel(path): len(path.read_text().splitlines()) for path in MODULES.values()}
    long = sorted((n, name) for name, n in lines.items() if n > MAX_FILE_LINES)
    if long:
        pytest.fail(f"{len(long)} file(s) in shoal/ over {MAX_FILE_LINES} lines:\n  "
                    + "\n  ".join(f"{name} ({n} lines)" for n, name in long))
