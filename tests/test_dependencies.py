"""The runtime dependencies (pyproject.toml) are what the package imports: none missing, none unused.

Read from the source, like tests/import_graph.py: every import of a third-party module anywhere in moss_rt
(function-level ones included). Optional extras (Ray for --cluster, Triton on CUDA) are imported only where used.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import moss_rt

ROOT = Path(moss_rt.__file__).parent
# Imported only in optional paths, installed with an extra or with the GPU build, not by default.
OPTIONAL = {"ray", "triton", "psycopg", "psycopg_pool"}


def imported_top_level_modules() -> set[str]:
    found: set[str] = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names and name != "moss_rt"}


def declared() -> set[str]:
    pyproject = tomllib.loads((ROOT.parent / "pyproject.toml").read_text(encoding="utf-8"))
    return {re.split(r"[<>=!~\[; ]", dep)[0].lower().replace("_", "-") for dep in pyproject["project"]["dependencies"]}


def test_runtime_dependencies_are_what_the_package_imports() -> None:
    distributions = importlib.metadata.packages_distributions()
    needed = set()
    for module in imported_top_level_modules() - OPTIONAL:
        assert module in distributions, f"moss_rt imports {module!r}, which no installed distribution provides"
        needed.update(d.lower().replace("_", "-") for d in distributions[module])
    assert needed - declared() == set(), "imported by moss_rt but not declared in pyproject.toml"
    assert declared() - needed == set(), "declared in pyproject.toml but imported nowhere in moss_rt"
