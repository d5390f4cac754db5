"""Fixtures for the real engine on the tiny model (CPU, fp32) through a real server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from moss_rt.config import Settings
from moss_rt.engine.moss import MossEngine
from tests.helpers import RunningServer

T = TypeVar("T")


def moss(settings: Settings) -> MossEngine:
    return MossEngine(settings)


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data dir for the session, so the tiny checkpoints are written once."""
    return tmp_path_factory.mktemp("engine-data")


@pytest.fixture
def moss_server(make_server: Callable[..., RunningServer], tiny_data_dir: Path) -> Callable[..., RunningServer]:
    """Factory: a real server on the tiny model; keyword overrides go to Settings."""

    def _make(**overrides: Any) -> RunningServer:
        base: dict[str, Any] = {
            "engine": "moss",
            "model": "tiny",
            "codec": "tiny",
            "device": "cpu",
            "data_dir": tiny_data_dir,
            "max_slots": 8,
            "max_queue": 8,
            "max_seq_len": 1024,
            "max_lead_sec": 0.0,
        }
        base.update(overrides)
        return make_server(moss, **base)

    return _make

