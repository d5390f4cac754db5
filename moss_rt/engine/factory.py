"""The single-process engine that settings name: the real MOSS engine or the scripted test engine.

Each is imported only when chosen: the scripted engine needs no torch. A cluster of replicas is chosen one layer
up (:func:`moss_rt.serving.build_engine`); each replica builds its own engine here.
"""

from __future__ import annotations

from moss_rt.config import Settings
from moss_rt.engine.base import Engine

ENGINES = ("moss", "scripted")


class UnknownEngine(ValueError):
    """``settings.engine`` names no engine."""


def build_local_engine(settings: Settings) -> Engine:
    """The engine ``settings.engine`` names, in this process (not started: ``async with`` it)."""
    if settings.engine == "scripted":
        from moss_rt.engine.scripted import ScriptedEngine

        return ScriptedEngine(
            frame_ms=settings.frame_ms,
            max_slots=settings.max_slots,
            max_queue=settings.max_queue,
            max_lead_sec=settings.max_lead_sec,
        )
    if settings.engine == "moss":
        from moss_rt.engine.moss import MossEngine

        return MossEngine(settings)
    raise UnknownEngine(f"unknown engine {settings.engine!r} ({' or '.join(ENGINES)})")
