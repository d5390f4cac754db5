"""Keeping stored sessions within their retention: a background sweep the application owns.

A session nobody used (no take kept, no note, no resume) for ``session_retention_days`` is deleted, records then
files. The sweep runs once at start (sessions may have expired while the service was down) and then every
1/24 of the retention (at least every second, at most every hour), on a worker thread; it is cancelled and
awaited when the application stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from aiohttp import web

from moss_rt.session_store import SessionStore
from moss_rt.web.state import STATE

log = logging.getLogger(__name__)


def sweep_interval(retention_sec: float) -> float:
    return min(3600.0, max(1.0, retention_sec / 24))


async def sweep_expired(store: SessionStore, retention_sec: float) -> int:
    """Delete every session unused for ``retention_sec``; how many went."""
    cutoff = time.time() - retention_sec
    removed = 0
    while True:
        batch = await asyncio.to_thread(store.expire, cutoff)
        removed += batch
        if batch == 0:
            break
    if removed:
        log.info("retention: deleted %d session(s) unused for %.1f days", removed, retention_sec / 86400)
    return removed


async def _sweep_forever(store: SessionStore, retention_sec: float) -> None:
    while True:
        try:
            await sweep_expired(store, retention_sec)
        except Exception:  # a failed sweep is retried at the next interval, never the end of the task
            log.exception("retention sweep failed")
        await asyncio.sleep(sweep_interval(retention_sec))


async def session_retention(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: the retention sweep runs while the application does."""
    state = app[STATE]
    days = state.settings.session_retention_days
    if state.sessions is None or days <= 0:
        yield
        return
    task = asyncio.create_task(_sweep_forever(state.sessions, days * 86400.0), name="session-retention")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
