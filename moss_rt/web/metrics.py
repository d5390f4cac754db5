"""``GET /metrics``: the engine's Prometheus registry in the text exposition format."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from moss_rt.web.state import STATE

_EMPTY = CollectorRegistry()


async def metrics_handler(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    # Engines without metrics (the scripted test engine) answer an empty, still valid exposition.
    registry = getattr(engine, "metrics_registry", None) or _EMPTY
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
