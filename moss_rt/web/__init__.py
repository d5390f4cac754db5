"""The aiohttp service: legacy HTTP API, WebSocket directing channel, static studio UI."""

from moss_rt.web.app import create_app

__all__ = ["create_app"]
