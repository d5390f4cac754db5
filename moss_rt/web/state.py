"""Typed application state shared by the routes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from moss_rt.align.base import WordTime
from moss_rt.align.service import AlignService
from moss_rt.config import Settings
from moss_rt.engine.base import Engine
from moss_rt.heard_audio import HeardAudio
from moss_rt.session import RecentTakes
from moss_rt.session_store import SessionStore
from moss_rt.voices import VoiceStore
from moss_rt.web.guards import ArchiveSlots, ClientConnections, ClientRequestRate, ClientTakes
from moss_rt.web.renders import SharedRenders

if TYPE_CHECKING:
    from ipaddress import IPv4Network, IPv6Network

    from moss_rt.scripts.service import ScriptService
    from moss_rt.web.owners import OwnerCookies


@dataclass
class ServiceState:
    settings: Settings
    engine: Engine
    voices: VoiceStore
    takes: RecentTakes
    heard: HeardAudio = field(default_factory=lambda: HeardAudio(0))  # the PCM takes streamed
    renders: SharedRenders = field(default_factory=lambda: SharedRenders(0))  # renders of codes in progress (downloads)
    sessions: SessionStore | None = None  # directing sessions on disk (data dir); None: not kept
    owner_cookies: OwnerCookies | None = None  # signs the owner cookies of keyless servers (moss_rt/web/owners.py)
    archive_slots: ArchiveSlots = field(default_factory=lambda: ArchiveSlots(2))  # session imports at once
    # Session exports at once: packed at the pace their reader reads, so a slow reader must not hold an import's
    # slot; they have their own, more of them (one per client all the same).
    export_slots: ArchiveSlots = field(default_factory=lambda: ArchiveSlots(8))
    # Splices and comps being assembled at once (each reads and joins up to a long take's audio on a worker thread).
    edit_slots: ArchiveSlots = field(
        default_factory=lambda: ArchiveSlots(4, doing="builds a splice or comp", work="splices or comps")
    )
    scripts: ScriptService | None = None  # script renders (their state beside the sessions); None: no sessions
    websockets: set[web.WebSocketResponse] = field(default_factory=set)
    shutting_down: bool = False
    # Reliability bookkeeping (issue 7): open directing connections (ws.Connection objects, kept
    # untyped to avoid an import cycle), running HTTP stream takes, takes per client address.
    connections: set[Any] = field(default_factory=set)
    http_takes: set[Any] = field(default_factory=set)
    client_takes: ClientTakes = field(default_factory=lambda: ClientTakes(0))
    request_rate: ClientRequestRate = field(default_factory=lambda: ClientRequestRate(0.0, 1))
    client_connections: ClientConnections = field(default_factory=lambda: ClientConnections(0))
    # Reverse proxies whose X-Forwarded-For is believed (parsed from settings.trusted_proxies).
    trusted_proxies: tuple[IPv4Network | IPv6Network, ...] = ()
    ws_slots: int = 0  # WebSocket connections admitted (reserved before the upgrade completes)
    # Closing connections still storing the takes their client's leaving cut off, by stored session id: a
    # resume of the session waits for them (a reload finds the take it interrupted); shutdown too.
    closing_keeps: dict[str, set[asyncio.Task[None]]] = field(default_factory=dict)
    metrics_registry: CollectorRegistry = field(default_factory=CollectorRegistry)  # the service's gauges
    # Set when the engine failed to load or warm up ("Type: message"); /readyz reports it. With
    # exit_on_engine_failure (the command line) the process then stops and exits non-zero.
    engine_failure: str | None = None
    exit_on_engine_failure: bool = False
    # Word timing (moss_rt.align): the aligner's service (None: --aligner none), and the takes being aligned on
    # demand (downloads, seek by word), one task per take however many ask.
    aligner: AlignService | None = None
    words_inflight: dict[str, asyncio.Task[list[WordTime]]] = field(default_factory=dict)


STATE: web.AppKey[ServiceState] = web.AppKey("moss_rt_state", ServiceState)
