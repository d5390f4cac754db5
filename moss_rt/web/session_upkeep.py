"""Keeping stored sessions in order: background work the application owns, on worker threads.

- Retention: a session nobody used (no take kept, no note, no resume) for ``session_retention_days`` is deleted,
  records then files. The sweep runs once at start (sessions may have expired while the service was down) and
  then every 1/24 of the retention (at least every second, at most every hour).
- Upkeep: the front end's heartbeat in the store every ``front_ends.HEARTBEAT_SEC`` (so that the front ends
  sharing it know it is alive and leave the files it writes alone), and a sweep of orphan files every
  :data:`ORPHAN_SWEEP_SEC` (what a crashed front end left behind, once old enough).

Both are cancelled and awaited when the application stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from aiohttp import web

from moss_rt.session_store import SessionStore
from moss_rt.storage.front_ends import HEARTBEAT_SEC
from moss_rt.web.state import STATE

log = logging.getLogger(__name__)

ORPHAN_SWEEP_SEC = 3600.0


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


async def _upkeep_forever(store: SessionStore) -> None:
    last_sweep = time.monotonic()
    while True:
        await asyncio.sleep(HEARTBEAT_SEC)
        try:
            await asyncio.to_thread(store.heartbeat)
            if time.monotonic() - last_sweep >= ORPHAN_SWEEP_SEC:
                last_sweep = time.monotonic()
                removed = await asyncio.to_thread(store.sweep_orphans)
                if removed:
                    log.info("session store: %d orphan file(s) or folder(s) removed", removed)
        except Exception:  # the database away for a while: tried again at the next interval
            log.exception("session store upkeep failed")


async def session_upkeep(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: the store's heartbeat and orphan sweep run while the application does."""
    state = app[STATE]
    if state.sessions is None:
        yield
        return
    task = asyncio.create_task(_upkeep_forever(state.sessions), name="session-upkeep")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
