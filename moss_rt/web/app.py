"""The application factory: routes, shared state and lifecycle (engine start/stop, shutdown)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator

from aiohttp import WSCloseCode, web

from moss_rt.align.select import AlignerChoiceError, build_aligner
from moss_rt.align.service import AlignerUnavailable, AlignService
from moss_rt.config import Settings
from moss_rt.engine.base import EndReason, Engine
from moss_rt.engine.memory_plan import DEFAULT_CPU_SEQ_LEN
from moss_rt.heard_audio import HeardAudio
from moss_rt.session import RecentTakes
from moss_rt.session_store import SessionStore, StoreBudget, check_store_setting, open_session_store
from moss_rt.voices import VoiceStore
from moss_rt.web.access_log import RedactingAccessLogger
from moss_rt.web.cross_site import cross_site_middleware
from moss_rt.web.guards import ArchiveSlots, ClientConnections, ClientRequestRate, ClientTakes
from moss_rt.web.http_api import routes
from moss_rt.web.metrics import metrics_handler, service_registry
from moss_rt.web.openai_api import OPENAI_ALIASES, openai_aliases, openai_errors_middleware
from moss_rt.web.openai_api import routes as openai_routes
from moss_rt.web.owners import OwnerCookies
from moss_rt.web.proxies import forwarded_for_middleware, parse_networks
from moss_rt.web.renders import SharedRenders
from moss_rt.web.scripts_api import routes as script_routes
from moss_rt.web.security import (
    auth_middleware,
    client_connections_middleware,
    cors_middleware,
    json_errors_middleware,
    request_rate_middleware,
)
from moss_rt.web.session_upkeep import session_retention, session_upkeep
from moss_rt.web.sessions_api import routes as session_routes
from moss_rt.web.state import STATE, ServiceState
from moss_rt.web.static_files import add_static_routes
from moss_rt.web.voices_api import routes as voice_routes
from moss_rt.web.words_api import routes as words_routes
from moss_rt.web.ws import websocket_handler

log = logging.getLogger(__name__)


def create_app(settings: Settings, engine: Engine, *, exit_on_engine_failure: bool = False) -> web.Application:
    """Build the service around an engine (the app starts and stops it).

    ``exit_on_engine_failure``: if the engine fails to load or warm up, stop the server (SIGTERM to
    this process, which ``web.run_app`` turns into a graceful exit) instead of serving, never ready.
    """
    # Outermost first: CORS answers preflights (which carry no credentials) before auth runs;
    # every error below it, aiohttp's own included, becomes a JSON body.
    app = web.Application(
        client_max_size=settings.limits.max_upload_bytes + 1024,
        # Idle keep-alive connections are closed after this (aiohttp's default is an hour).
        # The access log shortens session and take ids and blanks tokens (moss_rt/web/access_log.py).
        handler_args={"keepalive_timeout": settings.http_keepalive_sec, "access_log_class": RedactingAccessLogger},
        # forwarded_for first: everything after it (auth logs, per-client limits) sees the client.
        # The request rate is checked before auth, so unauthenticated floods are limited too.
        middlewares=[
            forwarded_for_middleware,
            cors_middleware,
            openai_errors_middleware,  # /v1/ only: OpenAI's error shape around every error below
            json_errors_middleware,
            cross_site_middleware,
            client_connections_middleware,
            request_rate_middleware,
            auth_middleware,
        ],
    )
    voices = VoiceStore(settings.voices_store_dir, settings.voices_dir, settings.limits)
    if settings.sessions:
        check_store_setting(settings.session_store)  # a bad URL or a missing driver stops the start here
    app[STATE] = ServiceState(
        settings=settings,
        engine=engine,
        voices=voices,
        takes=RecentTakes(),
        sessions=None,  # opened when the application starts (_sessions_lifecycle)
        owner_cookies=None,
        archive_slots=ArchiveSlots(settings.max_concurrent_archives),
        export_slots=ArchiveSlots(4 * settings.max_concurrent_archives),
        heard=HeardAudio(settings.heard_audio_mb * 1024 * 1024),
        renders=SharedRenders(settings.render_buffer_mb * 1024 * 1024),
        client_takes=ClientTakes(settings.max_takes_per_client),
        request_rate=ClientRequestRate(settings.http_requests_per_sec, settings.http_request_burst),
        client_connections=ClientConnections(settings.max_connections_per_client),
        trusted_proxies=parse_networks(settings.trusted_proxies),
        exit_on_engine_failure=exit_on_engine_failure,
    )
    app[STATE].aligner = _aligner_service(settings)
    app[STATE].metrics_registry = service_registry(app[STATE])
    app.add_routes(routes)
    app.add_routes(voice_routes)
    app.add_routes(openai_routes)
    app[OPENAI_ALIASES] = openai_aliases(settings)  # a malformed alias setting fails here, at start
    app.add_routes(session_routes)
    app.add_routes(words_routes)
    app.add_routes(script_routes)
    app.router.add_get("/api/ws", websocket_handler)
    app.router.add_get("/metrics", metrics_handler)
    if settings.static_dir.is_dir():
        add_static_routes(app, settings.static_dir)
    app.cleanup_ctx.append(_sessions_lifecycle)  # first in, last out: everything below may use the store
    app.cleanup_ctx.append(_engine_lifecycle)
    app.cleanup_ctx.append(_aligner_lifecycle)
    app.cleanup_ctx.append(session_retention)
    app.cleanup_ctx.append(session_upkeep)
    # After the engine's: its clean-up runs first, so renders stop while the engine still runs.
    app.cleanup_ctx.append(_scripts_lifecycle)
    app.on_shutdown.append(_close_websockets)
    app.on_shutdown.append(_end_script_streams)
    return app


def _aligner_service(settings: Settings) -> AlignService | None:
    """The word aligner ``--aligner`` names (docs/words.md), not loaded yet (its first worker loads it)."""
    try:
        aligner = build_aligner(
            settings.aligner, device=settings.device, workers=settings.aligner_workers,
            graph_memory_bytes=settings.aligner_graph_mb * 2**20,
        )  # fmt: skip
    except AlignerChoiceError as exc:
        raise SystemExit(str(exc)) from None
    if aligner is None:
        log.info("word timing is off (--aligner %s)", settings.aligner)
        return None
    return AlignService(aligner, max_pending=settings.aligner_queue, window_sec=settings.aligner_window_sec)


async def _aligner_lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Start the aligner's workers (the first loads it, off the loop); a named aligner that cannot load fails
    the start like the model does (``/readyz``); ``auto`` then only leaves words to estimates."""
    state = app[STATE]
    service = state.aligner
    if service is None:
        yield
        return
    service.start()

    async def watch() -> None:
        try:
            await service.wait_loaded()
            log.info("word aligner %s ready", service.name)
        except AlignerUnavailable as exc:
            if state.settings.aligner == "auto":
                log.error("word aligner %s failed to load (%s): word times are estimated", service.name, exc)
                return
            state.engine_failure = f"aligner {service.name}: {exc}"
            log.error("the word aligner failed to start: %s", state.engine_failure)
            if state.exit_on_engine_failure and not state.shutting_down:
                signal.raise_signal(signal.SIGTERM)

    watcher = asyncio.create_task(watch(), name="aligner-start")
    yield
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    for task in list(state.words_inflight.values()):
        task.cancel()
    service.close()
def session_store(settings: Settings) -> SessionStore:
    """The directing sessions of the data dir, with the caps and budgets of ``settings``."""
    limits = settings.limits
    mb = 1024 * 1024
    budget = StoreBudget(
        max_sessions=limits.max_sessions,
        max_sessions_per_client=limits.max_sessions_per_client,
        max_bytes=settings.session_storage_mb * mb,
        max_bytes_per_client=settings.session_storage_per_client_mb * mb,
        # The longest take there can be: its new frames (max_new_tokens) plus a retake's kept frames, all
        # within one take's cache (max_seq_len; the memory plan's 5120 when not set).
        max_take_frames=max(limits.max_new_tokens, settings.max_seq_len or DEFAULT_CPU_SEQ_LEN),
    )
    return open_session_store(
        settings.session_store,
        settings.session_files_dir,
        max_session_takes=limits.max_session_takes,
        limits=limits,
        budget=budget,
    )


async def _sessions_lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Open the session store (its database, migrations, the orphan sweep: blocking work, on a worker thread)
    and the owner cookies' secret; close them last. A store that cannot be opened stops the start."""
    state = app[STATE]
    settings = state.settings
    if not settings.sessions:
        yield
        return
    store = await asyncio.to_thread(session_store, settings)
    try:
        state.owner_cookies = await asyncio.to_thread(OwnerCookies.for_store, store, settings.data_dir)
    except BaseException:
        await asyncio.to_thread(store.close)
        raise
    state.sessions = store
    try:
        yield
    finally:
        # Takes cut off by clients that left are being stored: let them finish (bounded), then close the store.
        keeps = {task for tasks in state.closing_keeps.values() for task in tasks}
        if keeps:
            _, late = await asyncio.wait(keeps, timeout=settings.shutdown_grace_sec)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=1.0)
        await asyncio.to_thread(store.close)


async def _scripts_lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Script renders (moss_rt/scripts): their tables beside the sessions; unfinished ones resume once the engine
    is ready; every render stops (its state kept) before the engine does."""
    state = app[STATE]
    if state.sessions is None:
        yield
        return
    from moss_rt.scripts.service import ScriptService
    from moss_rt.scripts.store import ScriptStore

    store = await asyncio.to_thread(ScriptStore, state.sessions.db)
    state.scripts = ScriptService(state, state.sessions, store)
    state.scripts.start()
    try:
        yield
    finally:
        await state.scripts.close()
        await asyncio.to_thread(store.close)


async def _end_script_streams(app: web.Application) -> None:
    scripts = app[STATE].scripts
    if scripts is not None:
        scripts.end_streams()


async def _engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    await state.voices.load()
    # Loading real weights takes a while; serve /healthz meanwhile and flip /readyz when done.
    # The engine is an async context manager; its enter (load, warm up) runs in the background.
    loader = asyncio.create_task(_enter(state.engine), name="engine-start")
    loader.add_done_callback(lambda task: _engine_started(state, task))
    yield
    state.shutting_down = True
    if not loader.done():
        loader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await loader
    await state.renders.close()
    await state.engine.__aexit__(None, None, None)


async def _enter(engine: Engine) -> None:
    await engine.__aenter__()


def _engine_started(state: ServiceState, task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is None:
        return
    state.engine_failure = f"{type(exc).__name__}: {exc}"
    log.error("engine failed to start: %s", state.engine_failure)  # the engine logged the traceback
    if state.exit_on_engine_failure and not state.shutting_down:
        # No unready zombie: stop serving (run_app's SIGTERM handler exits gracefully); the command
        # line then exits non-zero with the reason.
        signal.raise_signal(signal.SIGTERM)


async def _close_websockets(app: web.Application) -> None:
    """Graceful shutdown (SIGTERM/SIGINT via aiohttp, or runner cleanup).

    aiohttp has already stopped listening. Here: refuse new work (readyz answers 503), end every
    running take with reason ``shutdown`` so both transports send its end frame, close sockets
    with 1001. HTTP stream handlers then finish on their own; aiohttp waits for them for
    ``shutdown_timeout`` (= shutdown_grace_sec) before cancelling what is left.
    """
    state = app[STATE]
    state.shutting_down = True
    grace = state.settings.shutdown_grace_sec
    for handle in list(state.http_takes):
        handle.cancel(EndReason.SHUTDOWN)
    connections = list(state.connections)
    if connections:
        log.info("shutdown: ending takes on %d connection(s)", len(connections))
        # Bounded: each connection waits at most ``grace`` for its end frame, all in parallel.
        await asyncio.gather(*(c.shutdown(grace) for c in connections), return_exceptions=True)
    for ws in list(state.websockets):
        with contextlib.suppress(Exception):
            await asyncio.wait_for(ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown"), 1.0)
