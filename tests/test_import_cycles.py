"""No import cycles in moss_rt, and every module imports.

The graph is read from the source (tests/import_graph.py says what counts as an import: lazy function-level
imports do, ``if TYPE_CHECKING:`` ones do not), so a cycle fails here whichever module a process happens to import
first, and a lazy import added to hide one fails too.
"""

from __future__ import annotations

import importlib
import textwrap
from pathlib import Path

import pytest

import moss_rt
from tests.import_graph import cycles, describe, import_graph, package_modules

PACKAGE = Path(moss_rt.__file__).parent
# Third-party packages a module may need that the runtime requirements do not bring (extras, GPU builds).
OPTIONAL = {"ray", "psycopg", "psycopg_pool", "triton"}


def test_moss_rt_has_no_import_cycle() -> None:
    graph = import_graph(PACKAGE)
    assert len(graph) > 100  # the whole package was read
    found = cycles(graph)
    assert not found, "\n\n".join(describe(graph, c) for c in found)


def test_every_module_imports() -> None:
    failures = []
    for name in sorted(package_modules(PACKAGE)):
        if name == "moss_rt.__main__":
            continue  # runs the CLI
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] not in OPTIONAL:
                failures.append(f"{name}: {exc!r}")
        except Exception as exc:
            failures.append(f"{name}: {exc!r}")
    assert not failures, "\n".join(failures)


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


@pytest.mark.parametrize(
    "files",
    [
        # at module level
        {"a.py": "from pkg import b\n", "b.py": "import pkg.a\n"},
        # hidden in a function: still a cycle
        {"a.py": "from pkg.b import f\n", "b.py": "def f():\n    from pkg.a import g\n    return g\n"},
        # relative, through a sub-package's __init__ that re-exports
        {"sub/__init__.py": "from .c import C\n", "sub/c.py": "from .. import a\nC = 1\n", "a.py": "import pkg.sub.d\n",
         "sub/d.py": ""},
        # a lazy name table (PEP 562)
        {"a.py": "import importlib\nHOMES = {'B': 'pkg.b'}\ndef __getattr__(n):\n"
                 "    return importlib.import_module(HOMES[n])\n", "b.py": "from pkg.a import x\n"},
    ],
    ids=["module-level", "lazy", "package-init", "import-module-table"],
)
def test_the_checker_finds_cycles(tmp_path: Path, files: dict[str, str]) -> None:
    graph = import_graph(_package(tmp_path, files))
    assert cycles(graph), graph


def test_the_checker_ignores_what_never_runs_or_is_already_running(tmp_path: Path) -> None:
    files = {
        # type-only imports both ways
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
        "b.py": "from pkg.a import x\n",
        # a sub-package's init re-exporting its module, which imports a sibling: its own package is no edge
        "sub/__init__.py": "from pkg.sub.c import C\n",
        "sub/c.py": "from pkg.sub.d import D\n",
        "sub/d.py": "D = 1\n",
    }
    graph = import_graph(_package(tmp_path, files))
    assert cycles(graph) == [], graph
    assert graph["pkg.sub.c"] == {"pkg.sub.d"}
