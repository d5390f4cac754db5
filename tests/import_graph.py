"""The import graph of a package, read from its source (no module is run), and its cycles.

What counts as "A imports B" (an edge A → B):

- every ``import`` statement in A naming a module of the package, wherever it stands: at module level, inside a
  function or method (a lazy import is still an import: one that exists only to hide a cycle is a cycle), inside
  ``try``/``except``;
- ``from P import name`` is an edge to ``P.name`` when that is a module of the package, else to ``P``; relative
  imports are resolved;
- importing ``P.Q.R`` runs the ``__init__`` of ``P`` and ``P.Q`` first, so it is an edge to those packages too,
  except to A's own enclosing packages (Python has begun importing them before A runs);
- a string naming a module of the package, in a module that calls ``importlib.import_module`` (a PEP 562 lazy
  name table such as ``moss_rt.model.__init__``): an edge to that module.

Not counted: imports under ``if TYPE_CHECKING:`` (never executed; they exist for type checkers, which handle
cycles) and imports of modules outside the package.

A cycle is a strongly connected component of more than one module (a module importing itself is no edge).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModuleFile:
    name: str  # dotted
    path: Path
    is_package: bool


def package_modules(package_dir: Path) -> dict[str, ModuleFile]:
    """Every module of the package at ``package_dir`` (its folder name is the package name), by dotted name."""
    root = package_dir.parent
    modules: dict[str, ModuleFile] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if any(not p.isidentifier() for p in parts):
            continue  # not importable (a folder such as static/ or a script with a dash)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules[".".join(parts)] = ModuleFile(".".join(parts), path, is_package)
    return modules


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks (not their ``else``)."""
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        test = node.test
        name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
        if name == "TYPE_CHECKING":
            for stmt in node.body:
                hidden.update(id(n) for n in ast.walk(stmt))
    return hidden


def _resolve(module: ModuleFile, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([name] if name else [])])


def imported_names(module: ModuleFile, known: dict[str, ModuleFile]) -> set[str]:
    """The modules of the package that ``module`` imports explicitly (see the module docstring)."""
    tree = ast.parse(module.path.read_text(encoding="utf-8"), filename=str(module.path))
    hidden = _type_checking_only(tree)
    found: set[str] = set()
    uses_import_module = False
    strings: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node.level, node.module)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
        elif (isinstance(node, ast.Attribute) and node.attr == "import_module") or (
            isinstance(node, ast.Name) and node.id == "import_module"
        ):
            uses_import_module = True
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.add(node.value)
    if uses_import_module:
        found.update(s for s in strings if s in known)
    return {name for name in found if name in known}


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module → the modules of the package importing it runs (explicit imports and their packages' inits)."""
    known = package_modules(package_dir)
    graph: dict[str, set[str]] = {}
    for name, module in known.items():
        parts = name.split(".")
        own = {".".join(parts[:i]) for i in range(1, len(parts))}  # enclosing packages, already being imported
        edges: set[str] = set()
        for target in imported_names(module, known):
            t = target.split(".")
            for i in range(1, len(t) + 1):
                prefix = ".".join(t[:i])
                if prefix in known and (prefix == target or prefix not in own):
                    edges.add(prefix)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def describe(graph: dict[str, set[str]], component: list[str]) -> str:
    """One cycle, as the edges between its modules."""
    members = set(component)
    edges = [f"  {a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return "import cycle among " + ", ".join(component) + ":\n" + "\n".join(edges)
