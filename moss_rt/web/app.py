"""The application factory: routes, shared state and lifecycle (engine start/stop, shutdown)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import WSCloseCode, web

from moss_rt.config import Settings
from moss_rt.engine.base import Engine
from moss_rt.session import TakeStore
from moss_rt.voices import VoiceStore
from moss_rt.web.http_api import routes
from moss_rt.web.metrics import metrics_handler
from moss_rt.web.state import STATE, ServiceState
from moss_rt.web.ws import websocket_handler

log = logging.getLogger(__name__)


def create_app(settings: Settings, engine: Engine) -> web.Application:
    """Build the service around an engine (the app starts and stops it)."""
    app = web.Application(client_max_size=settings.limits.max_upload_bytes + 1024)
    voices = VoiceStore(settings.voices_store_dir, settings.voices_dir, settings.limits)
    app[STATE] = ServiceState(settings=settings, engine=engine, voices=voices, takes=TakeStore())
    app.add_routes(routes)
    app.router.add_get("/api/ws", websocket_handler)
    app.router.add_get("/metrics", metrics_handler)
    if settings.static_dir.is_dir():
        app.router.add_static("/static/", settings.static_dir, show_index=False)
    app.cleanup_ctx.append(_engine_lifecycle)
    app.on_shutdown.append(_close_websockets)
    return app


async def _engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    await state.voices.load()
    # Loading real weights takes a while; serve /healthz meanwhile and flip /readyz when done.
    loader = asyncio.create_task(state.engine.start(), name="engine-start")
    loader.add_done_callback(_log_engine_start)
    yield
    state.shutting_down = True
    if not loader.done():
        loader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await loader
    await state.engine.close()


def _log_engine_start(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    if task.exception() is not None:
        log.error("engine failed to start", exc_info=task.exception())


async def _close_websockets(app: web.Application) -> None:
    state = app[STATE]
    state.shutting_down = True
    for ws in list(state.websockets):
        with contextlib.suppress(Exception):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")
