"""Renders of takes' codes for downloads: one per take, shared by its readers, within a byte budget."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from moss_rt.engine.base import EngineBusy

# The share of the budget one client may reserve with renders it started: a client reading many long takes
# (slowly, or never) waits for its own renders to end instead of taking every other client's room.
CLIENT_SHARE = 0.5


@dataclass
class _Render:
    task: asyncio.Task[bytes]
    n_bytes: int
    client: str | None
    readers: int = field(default=0)


class SharedRenders:
    """A take's rendered PCM, held while someone reads it; at most ``max_bytes`` held in all.

    Every download of a take whose streamed audio is gone needs its codes rendered again. Done
    per client, N slow readers of a long take would hold N copies; here they share one render
    (started by the first, awaited by the rest) that is dropped, or cancelled if unfinished, when
    its last reader leaves. A render that would take the total past ``max_bytes`` is refused with
    ``EngineBusy`` (HTTP 503 ``busy``), so what downloads hold stays bounded whoever asks. The renders one
    client started may reserve at most ``CLIENT_SHARE`` of the budget (joining another's render is free), so
    no client can spend all of it and turn everyone else's downloads away.
    """

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max(0, max_bytes)
        self._client_max = int(self._max_bytes * CLIENT_SHARE)
        self._renders: dict[str, _Render] = {}
        self._bytes = 0
        self._by_client: dict[str, int] = {}

    @property
    def nbytes(self) -> int:
        """Bytes reserved by the renders in progress or being read."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._renders)

    def client_bytes(self, client: str) -> int:
        """Bytes reserved by the renders ``client`` started."""
        return self._by_client.get(client, 0)

    @asynccontextmanager
    async def hold(
        self, key: str, n_bytes: int, render: Callable[[], Awaitable[bytes]], *, client: str | None = None
    ) -> AsyncIterator[bytes]:
        """The render of ``key`` (``n_bytes`` long, as known from its frame count) while inside; a new render is
        charged to ``client`` (None: to nobody but the total)."""
        entry = self._renders.get(key)
        if entry is None:
            if self._bytes + n_bytes > self._max_bytes:
                raise EngineBusy(retry_after_sec=1.0)
            if client is not None and self._by_client.get(client, 0) + n_bytes > self._client_max:
                raise EngineBusy(retry_after_sec=1.0)

            async def _render() -> bytes:
                return await render()

            task = asyncio.create_task(_render(), name=f"render-{key}")
            entry = self._renders[key] = _Render(task, n_bytes, client)
            self._bytes += n_bytes
            if client is not None:
                self._by_client[client] = self._by_client.get(client, 0) + n_bytes
        entry.readers += 1
        try:
            yield await asyncio.shield(entry.task)
        finally:
            entry.readers -= 1
            if entry.readers == 0:
                self._renders.pop(key, None)
                self._bytes -= entry.n_bytes
                if entry.client is not None:
                    left = self._by_client.get(entry.client, 0) - entry.n_bytes
                    if left > 0:
                        self._by_client[entry.client] = left
                    else:
                        self._by_client.pop(entry.client, None)
                if not entry.task.done():
                    entry.task.cancel()  # nobody is left to read it
                elif not entry.task.cancelled():
                    entry.task.exception()  # retrieved: a failure was already raised to its readers

    async def close(self) -> None:
        """Cancel renders still running (the service is stopping)."""
        tasks = [r.task for r in self._renders.values() if not r.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
