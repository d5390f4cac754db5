"""Shared fixtures: a real moss_rt server on 127.0.0.1 in a background thread."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from aiohttp import web

from moss_rt.config import Settings
from moss_rt.engine.base import Engine
from moss_rt.web import create_app
from moss_rt.web.state import STATE, ServiceState

# A test module that imports an optional dev-only package at the top is left out of collection where that package
# is missing (the bare GPU machine that runs `pytest -m gpu`), instead of one import error interrupting the whole
# run. CI installs requirements-dev.txt, so nothing is left out there.
collect_ignore = [
    path
    for path, package in [("reliability/test_openapi.py", "schemathesis")]
    if importlib.util.find_spec(package) is None
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunningServer:
    url: str
    ws_url: str
    state: ServiceState
    loop: asyncio.AbstractEventLoop

    @property
    def engine(self) -> Engine:
        return self.state.engine


class ServerThread:
    """Runs create_app(settings, engine) on its own loop and thread, like a deployed service."""

    def __init__(self, settings: Settings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.server: RunningServer | None = None

    def start(self, ready_timeout: float = 60.0) -> RunningServer:
        self._thread.start()
        app = create_app(self.settings, self.engine)

        async def _start() -> None:
            self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=2.0)
            await self._runner.setup()
            await web.TCPSite(self._runner, self.settings.host, self.settings.port).start()
            for _ in range(int(ready_timeout * 20)):
                if app[STATE].engine.info.ready:
                    return
                await asyncio.sleep(0.05)
            raise RuntimeError("engine never became ready")

        asyncio.run_coroutine_threadsafe(_start(), self.loop).result(ready_timeout + 5)
        base = f"http://{self.settings.host}:{self.settings.port}"
        self.server = RunningServer(base, base.replace("http", "ws") + "/api/ws", app[STATE], self.loop)
        return self.server

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., RunningServer]]:
    """Factory: start a server with a given engine and settings overrides; stopped after the test."""
    threads: list[ServerThread] = []

    def _make(engine_factory: Callable[[Settings], Engine], **overrides: object) -> RunningServer:
        settings = Settings(
            host="127.0.0.1",
            port=free_port(),
            data_dir=tmp_path / "data",
            voices_dir=tmp_path / "voices",
        ).replace(**overrides)
        thread = ServerThread(settings, engine_factory(settings))
        threads.append(thread)
        return thread.start()

    yield _make
    for thread in reversed(threads):
        thread.stop()


def sine_wav(seconds: float = 1.5, sr: int = 24000, channels: int = 1, fmt: str = "WAV") -> bytes:
    t = np.arange(int(seconds * sr)) / sr
    tone = 0.3 * np.sin(2 * np.pi * 220 * t).astype(np.float32)
    data = np.stack([tone] * channels, axis=1) if channels > 1 else tone
    buf = io.BytesIO()
    sf.write(buf, data, sr, format=fmt)
    return buf.getvalue()
