"""The dependency directions of DESIGN §4, checked on the source with ``ast`` (issue #13).

Every module of ``src/impasto`` is parsed; its ``import`` and ``from ... import`` statements at
module level and inside functions and classes are collected (relative imports resolved,
statements under ``if TYPE_CHECKING:`` skipped: they never run). A *node* is an impasto
package (``impasto.train``) or top-level module (``impasto.cli``), named by its first component
after ``impasto``; the root ``impasto/__init__.py`` is the node ``impasto``. Imports inside a
node are not edges. Imports through strings (``importlib.import_module``) are not seen.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from itertools import pairwise
from pathlib import Path

import impasto

SRC = Path(impasto.__file__).resolve().parent

# node → the impasto nodes it may import (DESIGN §4: objectives and sampling import torch only;
# sampling's ladders and flow times use objectives' schedules, never the other way round).
PURE_NODES: dict[str, set[str]] = {"objectives": set(), "sampling": {"objectives"}}
# models never imports these (DESIGN §4: model code does not decide sharding or training).
MODELS_FORBIDDEN_NODES = {"train", "data", "checkpoint", "distributed"}
# Known edges that close a cycle between nodes, tracked for removal (issue #13). Each entry is
# (importer, imported); the cycle test ignores these edges, and a test fails once one of them no
# longer exists, so the list only shrinks.
ALLOWED_FOR_NOW: set[tuple[str, str]] = set()  # known back-edges, each with its reason


@dataclass(frozen=True)
class Import:
    """One imported name: ``source`` (a module, dotted) imports ``target`` at ``line``."""

    source: str
    target: str  # a module of the impasto tree, or the dotted path of an outside name
    line: int
    module_level: bool  # executed when ``source`` is imported (not inside a function)

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}"


@cache
def modules() -> dict[str, Path]:
    """Dotted module name → file, for every module of the impasto tree."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def node_of(module: str) -> str:
    """``impasto.train.methods.denoise`` → ``train``; the root package → ``impasto``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _is_type_checking(test: ast.expr) -> bool:
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def _import_statements(
    node: ast.AST, in_function: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """(statement, inside a function) for every import under ``node``, TYPE_CHECKING aside."""
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        children: list[ast.AST] = list(node.orelse)
    else:
        children = list(ast.iter_child_nodes(node))
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, in_function
    nested = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    for child in children:
        yield from _import_statements(child, nested)


def _from_base(statement: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a ``from`` statement of ``module`` names, relative levels resolved."""
    if not statement.level:
        return statement.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    package = package[: len(package) - (statement.level - 1)]
    return ".".join(package + ([statement.module] if statement.module else []))


def collect_imports(source: str, module: str, is_package: bool = False) -> tuple[Import, ...]:
    """Every import statement of ``source`` (the text of ``module``), one entry per name."""
    found = []
    for statement, in_function in _import_statements(ast.parse(source)):
        if isinstance(statement, ast.Import):
            targets = [alias.name for alias in statement.names]
        else:
            base = _from_base(statement, module, is_package)
            targets = []
            for alias in statement.names:
                name = f"{base}.{alias.name}"
                # ``from impasto import train`` names a module; ``from impasto.x import f`` not.
                inside = base.split(".")[0] == "impasto"
                targets.append(base if inside and name not in modules() else name)
        found += [Import(module, t, statement.lineno, not in_function) for t in targets]
    return tuple(dict.fromkeys(found))  # one entry for `from m import a, b`


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    """The imports of a module of the impasto tree."""
    path = modules()[module]
    return collect_imports(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")


def all_imports() -> list[Import]:
    return [item for module in modules() for item in imports_of(module)]


def impasto_edges() -> dict[tuple[str, str], list[Import]]:
    """(importer node, imported node) → the imports that make the edge."""
    edges: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for item in all_imports():
        if item.target.split(".")[0] != "impasto":
            continue
        edge = (node_of(item.source), node_of(item.target))
        if edge[0] != edge[1]:
            edges[edge].append(item)
    return edges


def _evidence(items: list[Import]) -> str:
    return "\n".join(f"    {item}" for item in items)


def _cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """One cycle [a, b, ..., a] through each strongly connected component of more than one node."""
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target in edges:
        graph[source].add(target)

    def reach(start: str) -> set[str]:
        seen, stack = set(), [start]
        while stack:
            for nxt in graph[stack.pop()] - seen:
                seen.add(nxt)
                stack.append(nxt)
        return seen

    reachable = {node: reach(node) for node in list(graph)}
    cycles, covered = [], set()
    for node in sorted(reachable):
        if node in covered or node not in reachable[node]:
            continue
        component = {n for n in reachable[node] if node in reachable.get(n, set())}
        covered |= component
        cycles.append(_path(graph, node, node, component))
    return cycles


def _path(graph: dict[str, set[str]], start: str, goal: str, within: set[str]) -> list[str]:
    """A shortest path start → … → goal (breadth first), inside ``within``."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & within):
                if nxt == goal:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), goal]
                if nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no path {start} → {goal}")


def _module_level_closure(start: str) -> dict[str, list[Import]]:
    """Every impasto module importing ``start`` executes → the chain of imports that gets there.

    Importing ``a.b.c`` runs ``a/__init__``, ``a/b/__init__`` and ``a/b/c``.
    """
    parts = start.split(".")
    stack = [".".join(parts[:depth]) for depth in range(1, len(parts) + 1)]
    chains: dict[str, list[Import]] = {module: [] for module in stack}
    while stack:
        module = stack.pop()
        for item in imports_of(module):
            if not item.module_level or item.target.split(".")[0] != "impasto":
                continue
            parts = item.target.split(".")
            for depth in range(1, len(parts) + 1):
                executed = ".".join(parts[:depth])
                if executed in modules() and executed not in chains:
                    chains[executed] = [*chains[module], item]
                    stack.append(executed)
    return chains


# --- the collector itself ----------------------------------------------------------------------


def test_the_collector_resolves_relative_function_level_and_type_checking_imports():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import flow\n"
        "from ..objectives import schedules, shift_for_size\n"
        "if TYPE_CHECKING:\n"
        "    from impasto.train import trainer\n"
        "else:\n"
        "    import impasto.data\n"
        "def f():\n"
        "    from torch import distributed\n"
        "class C:\n"
        "    import json\n"
    )
    found = collect_imports(source, "impasto.sampling.example")
    assert [(i.target, i.line, i.module_level) for i in found] == [
        ("typing.TYPE_CHECKING", 1, True),
        ("impasto.sampling.flow", 2, True),
        ("impasto.objectives.schedules", 3, True),
        ("impasto.objectives", 3, True),  # a function, not a module
        ("impasto.data", 7, True),
        ("torch.distributed", 9, False),
        ("json", 11, True),  # a class body runs on import
    ]
    # In a package's __init__, "." is the package itself.
    in_init = collect_imports("from .flow import x\nfrom .. import api", "impasto.sampling", True)
    assert [i.target for i in in_init] == ["impasto.sampling.flow", "impasto.api"]
    assert node_of("impasto.train.methods.denoise") == "train"
    assert node_of("impasto") == "impasto"
    # The real tree: generate's module-level imports reach objectives and torch.
    closure = _module_level_closure("impasto.sampling.generate")
    assert {"impasto", "impasto.sampling", "impasto.objectives.flow"} <= set(closure)
    assert any(i.target == "torch" for i in imports_of("impasto.sampling.generate"))


def test_cycles_reports_one_cycle_per_strongly_connected_component():
    edges = {("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e"), ("e", "d"), ("f", "a")}
    assert _cycles(edges) == [["a", "b", "c", "a"], ["d", "e", "d"]]
    assert _cycles({("a", "b"), ("b", "c")}) == []


# --- DESIGN §4 ---------------------------------------------------------------------------------


def test_objectives_and_sampling_import_no_other_impasto_package():
    bad = [
        item
        for (source, target), items in impasto_edges().items()
        if source in PURE_NODES and target not in PURE_NODES[source]
        for item in items
    ]
    assert not bad, "objectives/sampling import torch (and objectives) only:\n" + _evidence(bad)


def test_config_imports_no_other_impasto_package():
    bad = [
        item
        for (source, _), items in impasto_edges().items()
        if source == "config"
        for item in items
    ]
    assert not bad, "config imports no other impasto package (issue 13 item 9):\n" + _evidence(bad)


def test_models_import_no_training_code_nor_torch_distributed():
    bad = [
        item
        for item in all_imports()
        if node_of(item.source) == "models"
        and (
            item.target == "torch.distributed"
            or item.target.startswith("torch.distributed.")
            or (
                item.target.startswith("impasto.")
                and node_of(item.target) in MODELS_FORBIDDEN_NODES
            )
        )
    ]
    forbidden = ", ".join(sorted(MODELS_FORBIDDEN_NODES))
    assert not bad, f"models may not import torch.distributed, {forbidden}:\n" + _evidence(bad)


def test_no_import_cycle_between_impasto_packages():
    edges = impasto_edges()
    cycles = _cycles(set(edges) - ALLOWED_FOR_NOW)
    lines = []
    for cycle in cycles:
        lines.append(" → ".join(cycle))
        for source, target in pairwise(cycle):
            lines.append(f"  {source} → {target}:\n" + _evidence(edges[(source, target)]))
    assert not cycles, "import cycles between impasto packages:\n" + "\n".join(lines)


def test_allowed_cycle_edges_still_exist():
    stale = ALLOWED_FOR_NOW - set(impasto_edges())
    assert not stale, f"these edges are gone: remove them from ALLOWED_FOR_NOW: {sorted(stale)}"


def test_cli_imports_no_torch_at_module_level():
    bad = []
    for module, chain in _module_level_closure("impasto.cli").items():
        for item in imports_of(module):
            if item.module_level and item.target.split(".")[0] == "torch":
                bad.append(" ← ".join(str(step) for step in [item, *reversed(chain)]))
    assert not bad, "importing impasto.cli imports torch:\n" + "\n".join(bad)
