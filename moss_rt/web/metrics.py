"""``GET /metrics``: the engine's Prometheus registry plus the service's own gauges."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from moss_rt.web.state import STATE, ServiceState

_EMPTY = CollectorRegistry()


def service_registry(state: ServiceState) -> CollectorRegistry:
    """Gauges read from the service state when scraped (nothing to keep in step)."""
    registry = CollectorRegistry()
    Gauge(
        "moss_rt_heard_audio_bytes", "Streamed PCM held for exact replays and downloads", registry=registry
    ).set_function(lambda: state.heard.nbytes)
    Gauge("moss_rt_takes_stored", "Takes in the app-wide take store", registry=registry).set_function(
        lambda: len(state.takes)
    )
    Gauge("moss_rt_websocket_connections", "Open directing WebSockets", registry=registry).set_function(
        lambda: len(state.connections)
    )
    return registry


async def metrics_handler(request: web.Request) -> web.Response:
    state = request.app[STATE]
    # Engines without metrics (the scripted test engine) add nothing; the service gauges are always there.
    engine_registry = state.engine.info.metrics or _EMPTY
    body = generate_latest(engine_registry) + generate_latest(state.metrics_registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
