"""The start's critical path (issue 24, "process": interpreter start to the engine loading): ``serve`` starts the
engine loading before it imports and builds the web app, and the command line's own module pulls in neither torch nor
the web app (``--help`` and the scripted engine never need them)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from moss_rt.config import Settings
from moss_rt.engine.moss import MossEngine
from moss_rt.engine.startup import warm_cuda
from tests.engine.harness import drive, engine_settings, loaded_engine, spec

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


def _meeting(monkeypatch: pytest.MonkeyPatch, *, codec_fails: bool = False) -> dict[str, str]:
    """The model's weights read and the codec's load, each made to wait until the other has begun: they meet only
    if they run at once (one after the other, the first waits out its timeout and the start fails)."""
    import moss_rt.codec as codec_package
    from moss_rt.model.loader import OpenedModel

    began = {"weights": threading.Event(), "codec": threading.Event()}
    threads: dict[str, str] = {}
    real_read, real_codec = OpenedModel.read_weights, codec_package.load_codec

    def read_weights(self: OpenedModel) -> Any:
        threads["weights"] = threading.current_thread().name
        began["weights"].set()
        if not began["codec"].wait(20.0):
            raise AssertionError("the weights were read before the codec began to load")
        return real_read(self)

    def load_codec(*args: Any, **kwargs: Any) -> Any:
        threads["codec"] = threading.current_thread().name
        began["codec"].set()
        if not began["weights"].wait(20.0):
            raise AssertionError("the codec loaded before the weights began to be read")
        if codec_fails:
            raise RuntimeError("codec checkpoint on fire")
        return real_codec(*args, **kwargs)

    monkeypatch.setattr(OpenedModel, "read_weights", read_weights)
    monkeypatch.setattr(codec_package, "load_codec", load_codec)
    return threads


def test_the_weights_are_read_while_the_codec_loads(tiny_data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24's second start: the model's weights are read on a thread of their own beside the codec's load (one
    after the other they took 1.7 s of an H200's 10.8 s), and the engine then takes lines as before."""
    threads = _meeting(monkeypatch)
    with loaded_engine(engine_settings(tiny_data_dir, overlap=False)) as engine:
        assert threads["weights"].startswith("moss-rt-weights") and threads["codec"] == threading.current_thread().name
        phases = list(engine.startup.phases)
        assert phases.index("codec loaded") < phases.index("model weights read") < phases.index("memory plan")
        driven = drive(engine, [spec("a", 1, 6, 3)])
        assert len(driven.channels["a"].codes) == 6
    assert not [t for t in threading.enumerate() if t.name.startswith("moss-rt-weights")]


def test_a_codec_that_fails_to_load_leaves_no_weights_read_behind(
    tiny_data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _meeting(monkeypatch, codec_fails=True)
    engine = MossEngine(engine_settings(tiny_data_dir, overlap=False))
    try:
        with pytest.raises(RuntimeError, match="on fire"):
            engine._load()
        assert not [t for t in threading.enumerate() if t.name.startswith("moss-rt-weights")]
    finally:
        engine._shutdown()
        engine._release_device_memory()
