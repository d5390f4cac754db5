"""Shared fixtures: a real moss_rt server on 127.0.0.1 in a background thread (tests/helpers.py runs it)."""

from __future__ import annotations

import importlib.util
import io
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from moss_rt.config import Settings
from moss_rt.engine.base import Engine
from tests.helpers import RunningServer, ServerThread, free_port
from tests.postgres import PostgresCluster, why_no_postgres

# A test module that imports an optional dev-only package at the top is left out of collection where that package
# is missing (the bare GPU machine that runs `pytest -m gpu`), instead of one import error interrupting the whole
# run. CI installs requirements-dev.txt, so nothing is left out there.
collect_ignore = [
    path
    for path, package in [
        ("reliability/test_openapi.py", "schemathesis"),
        ("ecosystem", "openai"),
        ("ecosystem", "av"),
        ("test_formats.py", "av"),
    ]
    if importlib.util.find_spec(package) is None
]


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


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    """A PostgreSQL server for the whole run (tests/postgres.py); skips with the reason where none can start."""
    reason = why_no_postgres()
    if reason is not None:
        pytest.skip(reason)
    cluster = PostgresCluster()
    try:
        cluster.init().start()
    except BaseException:
        cluster.remove()
        raise
    yield cluster
    cluster.remove()


@pytest.fixture
def postgres_url(postgres_cluster: PostgresCluster) -> Iterator[str]:
    """The URL of a fresh, empty database on the test server (dropped after the test)."""
    url = postgres_cluster.new_db()
    yield url
    postgres_cluster.drop_db(url)
