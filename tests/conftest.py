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


# --------------------------------------------------------------------------- parallel runs (pytest-xdist)
#
# `make test` runs the suite on one worker process per CPU (`pytest -n auto`, docs/testing.md). Each worker has its
# own temporary directories (tmp_path, tmp_path_factory), servers listen on ports `free_port` reserves, and every
# data dir is the test's own. What is left to arrange is which tests share a worker, and in what order:
# - a module's tests run on one worker, so its module-scoped servers and browsers start once;
# - the tests under tests/cluster/ run on one worker: one local Ray at a time (two would not fit on a small machine);
# - the longest groups start first (the Ray cluster's, the browser modules, then modules with a test marked `slow`),
#   so none is left running alone at the end.
# (xdist's own `--dist loadgroup` would say the same with marks, but it cannot tag items with pytest 9.2, whose
# nodes keep their id elsewhere.)


def _scope_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return "tests/cluster" if path.startswith("tests/cluster/") else path


@pytest.hookimpl(optionalhook=True)  # an xdist hook: without xdist installed, never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    if config.getvalue("dist") not in ("load", "loadscope", "loadfile", "loadgroup"):
        return None  # `--dist each` or `worksteal`, asked for explicitly: xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        """Whole modules (tests/cluster/ as one) to whichever worker is free, in the order the workers collected
        them (below), not reordered by their number of tests."""

        def _split_scope(self, nodeid: str) -> str:
            return _scope_of(nodeid)

    config.option.loadscopereorder = False
    return ByModule(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # not an xdist worker: the usual order
        return

    def rank(item: pytest.Item) -> int:
        if _scope_of(item.nodeid) == "tests/cluster":
            return 0
        if item.get_closest_marker("browser"):
            return 1
        return 2 if item.get_closest_marker("slow") else 3

    # A module starts as early as its longest test asks; every worker collects the same items and sorts them alike
    # (xdist checks that their collections agree).
    module_rank: dict[str, int] = {}
    for item in items:
        scope = _scope_of(item.nodeid)
        module_rank[scope] = min(module_rank.get(scope, 3), rank(item))
    items.sort(key=lambda item: module_rank[_scope_of(item.nodeid)])


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., RunningServer]]:
    """Factory: start a server with a given engine and settings overrides; stopped after the test."""
    threads: list[ServerThread] = []

    def _make(
        engine_factory: Callable[[Settings], Engine], *, send_buffer_bytes: int | None = None, **overrides: object
    ) -> RunningServer:
        settings = Settings(
            host="127.0.0.1",
            port=free_port(),
            data_dir=tmp_path / "data",
            voices_dir=tmp_path / "voices",
        ).replace(**overrides)
        thread = ServerThread(settings, engine_factory(settings), send_buffer_bytes=send_buffer_bytes)
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
