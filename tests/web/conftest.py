from __future__ import annotations

from collections.abc import Callable

import pytest

from moss_rt.config import Settings
from moss_rt.engine.scripted import ScriptedEngine
from tests.helpers import RunningServer

FRAME_MS = 10.0


def scripted(settings: Settings) -> ScriptedEngine:
    return ScriptedEngine(
        frame_ms=settings.frame_ms,
        max_slots=settings.max_slots,
        max_queue=settings.max_queue,
        max_lead_sec=settings.max_lead_sec,
    )


@pytest.fixture
def server(make_server: Callable[..., RunningServer]) -> RunningServer:
    """A real server on the scripted engine at 10 ms per frame (8x faster than real time)."""
    return make_server(scripted, engine="scripted", frame_ms=FRAME_MS, max_lead_sec=0.0)
