"""A take running on a replica, seen from the front end: the same TakeHandle the web layer gets
from a local engine.

Events arrive through a Ray streaming generator. If the replica dies (its process is killed, its
node is lost, or the router's poll finds a new incarnation in its place), the take ends with a
``TakeFinished`` whose ``error_code`` is ``replica_lost`` instead of hanging: the generator raises an
actor error, or the replica's ``lost`` event fires first, whichever comes sooner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from moss_rt.engine.base import AudioChunk, EndReason, TakeEvent, TakeFinished
from moss_rt.protocol import ErrorCode

log = logging.getLogger(__name__)


class RemoteTake:
    """TakeHandle over a replica's ``run_take`` stream (after its ``Admitted`` item was read)."""

    def __init__(
        self,
        *,
        take_id: str,
        replica: str,
        actor: Any,
        stream: Any,
        lost: asyncio.Event,
        start_frame: int,
        rebuilt: bool,
        on_lost: Callable[[], None],
        on_item: Callable[[int], None] | None = None,
    ) -> None:
        self.take_id = take_id
        self.replica = replica
        self.rebuilt = rebuilt
        self._actor = actor
        self._stream = stream
        self._lost = lost
        self._n_frames = start_frame
        self._on_lost = on_lost
        self._on_item = on_item  # told how many audio chunks each stream item carried (relay metrics)
        self._finished = False
        self._t0 = time.monotonic()

    def cancel(self, reason: EndReason = EndReason.CANCELLED) -> None:
        if not self._finished:
            # Fire and forget: the replica ends the take at its next step and the end comes back
            # through the stream like any other event.
            with contextlib.suppress(Exception):
                self._actor.cancel_take.remote(self.take_id, reason.value)

    def __aiter__(self) -> AsyncIterator[TakeEvent]:
        return self._events()

    async def _next(self) -> tuple[TakeEvent, ...]:
        """The next stream item: a tuple of events (``EngineReplica.run_take``)."""
        ref = await self._stream.__anext__()
        items: tuple[TakeEvent, ...] = await ref
        return items

    async def _events(self) -> AsyncIterator[TakeEvent]:
        from ray.exceptions import RayActorError, RayTaskError

        # The replica's loss interrupts the read in progress (one waiter for the take's whole life, not one
        # per item: every item is a hop of a relayed stream, and this runs for each).
        reading: asyncio.Future[tuple[TakeEvent, ...]] | None = None
        lost_wait = asyncio.ensure_future(self._lost.wait())
        lost_wait.add_done_callback(lambda _: reading.cancel() if reading is not None else None)
        try:
            while True:
                if lost_wait.done():
                    yield self._lost_end("stopped answering")
                    return
                reading = asyncio.ensure_future(self._next())
                try:
                    items = await reading
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if lost_wait.done() and (task is None or not task.cancelling()):
                        yield self._lost_end("stopped answering")
                        return
                    raise
                except StopAsyncIteration:
                    yield self._lost_end("ended the stream early")
                    return
                except RayActorError:
                    yield self._lost_end("died")
                    return
                except RayTaskError as exc:
                    log.error("take %s failed on replica %s: %s", self.take_id, self.replica, exc)
                    self._finished = True
                    yield TakeFinished(EndReason.ERROR, self._n_frames, self._elapsed_ms(), error="generation failed")
                    return
                finally:
                    reading = None
                if self._on_item is not None:
                    self._on_item(sum(1 for e in items if isinstance(e, AudioChunk)))
                for event in items:
                    if isinstance(event, AudioChunk):
                        self._n_frames = event.first_frame + event.n_frames
                    if isinstance(event, TakeFinished):
                        self._finished = True
                    yield event
                    if self._finished:
                        return
        finally:
            lost_wait.cancel()
            if reading is not None:
                reading.cancel()
            if not self._finished:
                # Abandoned by the consumer (client gone, task cancelled): stop the take there too.
                self.cancel(EndReason.CANCELLED)
                with contextlib.suppress(Exception):
                    import ray

                    ray.cancel(self._stream)

    def _lost_end(self, how: str) -> TakeFinished:
        self._finished = True
        self._on_lost()
        log.warning("take %s: replica %s %s", self.take_id, self.replica, how)
        return TakeFinished(
            EndReason.ERROR,
            self._n_frames,
            self._elapsed_ms(),
            error=f"the engine replica running this take was lost ({self.replica} {how}); start it again",
            error_code=ErrorCode.REPLICA_LOST.value,
        )

    def _elapsed_ms(self) -> float:
        return (time.monotonic() - self._t0) * 1000.0
