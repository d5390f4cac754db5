"""The start's critical path (issue 24, "process": interpreter start to the engine loading): ``serve`` starts the
engine loading before it imports and builds the web app, and the command line's own module pulls in neither torch nor
the web app (``--help`` and the scripted engine never need them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from moss_rt.config import Settings
from moss_rt.engine.startup import warm_cuda

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "triton", "transformers", "aiohttp", "moss_rt.web.app", "moss_rt.engine.moss")

# In a fresh interpreter: serve with an engine that records what was imported when it was asked to begin loading.
SERVE_ORDER = """
import sys
import moss_rt.cli as cli
heavy = {heavy!r}
print("after import:", sorted(m for m in heavy if m in sys.modules))

class Engine:
    def begin_loading(self):
        print("at begin_loading:", sorted(m for m in heavy if m in sys.modules))
        raise SystemExit(0)

cli.build_engine = lambda settings: Engine()
cli.main(["serve", "--data-dir", {data!r}], prog="moss_rt")
"""


def test_serve_begins_loading_the_engine_before_importing_the_web_app(tmp_path: Path) -> None:
    code = SERVE_ORDER.format(heavy=HEAVY, data=str(tmp_path / "data"))
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "after import: []" in result.stdout, result.stdout
    assert "at begin_loading: []" in result.stdout, result.stdout  # the app is built while the engine loads


def test_no_cuda_context_is_warmed_for_a_cpu_engine() -> None:
    assert warm_cuda(Settings(device="cpu")) is None
