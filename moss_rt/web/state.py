"""Typed application state shared by the routes."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from moss_rt.config import Settings
from moss_rt.engine.base import Engine
from moss_rt.session import TakeStore
from moss_rt.voices import VoiceStore


@dataclass
class ServiceState:
    settings: Settings
    engine: Engine
    voices: VoiceStore
    takes: TakeStore
    websockets: set[web.WebSocketResponse] = field(default_factory=set)
    shutting_down: bool = False


STATE: web.AppKey[ServiceState] = web.AppKey("moss_rt_state", ServiceState)
