"""One render of a take's codes shared by everyone who asks for it while it runs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class SharedRenders:
    """At most one render of a take's codes at a time; concurrent callers share its result.

    The caller that starts a render performs it; the others wait on its future. If that caller
    is cancelled (its client left), a waiter takes over. Nothing is kept after the render is
    handed out, so memory is bounded by the renders in progress (the engine's job queue bounds
    those: past it, ``EngineBusy``).
    """

    def __init__(self) -> None:
        self._pending: dict[str, asyncio.Future[bytes]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    async def get(self, key: str, render: Callable[[], Awaitable[bytes]]) -> bytes:
        while (pending := self._pending.get(key)) is not None:
            try:
                return await asyncio.shield(pending)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if pending.cancelled() and not (task is not None and task.cancelling()):
                    continue  # the renderer's client left; render it here instead
                raise
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        # Waiters read a failure; without one it must still count as retrieved (no log noise).
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._pending[key] = future
        try:
            pcm = await render()
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            self._pending.pop(key, None)
        future.set_result(pcm)
        return pcm
