"""One take for one HTTP request: admission and release, shared by ``POST /api/stream`` and ``/v1/audio/speech``.

Both routes admit a take the same way (model, the client's take cap, the engine queue) and free the
same things when the request ends however it ends (client gone, shutdown, error), so limits, busy
answers and clean-up cannot drift apart between the legacy stream and the OpenAI-compatible one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from moss_rt.engine.base import EndReason, TakeHandle
from moss_rt.protocol import ErrorCode, ProtocolError, StartTake
from moss_rt.session import DirectingSession, TakeRecord
from moss_rt.web.state import ServiceState
from moss_rt.web.takes import SendFrame, build_spec, resolve_model, stream_take


@dataclass
class HttpTake:
    """An admitted take: the engine is generating it; :meth:`release` must follow."""

    state: ServiceState
    client: str
    model: str
    take: TakeRecord
    session: DirectingSession
    handle: TakeHandle
    t_request: float = field(default_factory=time.monotonic)

    async def stream(self, send: SendFrame):  # type: ignore[no-untyped-def]
        """Forward the take's frames (start, PCM, end) to ``send``; returns the TakeFinished event."""
        return await stream_take(
            self.state, self.handle, self.take, self.session, send, t_request=self.t_request, model=self.model
        )

    def release(self) -> None:
        """Stop the take if it still runs (a client that left must free its engine slot) and give
        back the client's take place."""
        self.handle.cancel(EndReason.CANCELLED)
        self.state.http_takes.discard(self.handle)
        self.state.client_takes.release(self.client)


async def admit_http_take(state: ServiceState, client: str, start: StartTake, *, t_request: float) -> HttpTake:
    """Admit ``start`` for ``client``; raises ProtocolError (refused) or EngineBusy (at capacity).

    On success the take counts against the client and is ended with reason ``shutdown`` when the
    service stops; on failure nothing is held.
    """
    if state.shutting_down:
        raise ProtocolError(ErrorCode.BUSY, "the service is shutting down")
    model = resolve_model(state, start.model)
    state.client_takes.acquire(client)  # rate_limited (429) past max_takes_per_client
    try:
        session = DirectingSession(state.takes, max_takes=1)
        plan = session.plan_start(start)
        spec = await build_spec(state, plan.take)
        handle = await state.engine.submit(spec)
    except BaseException:  # a refusal, a 500 or a cancelled request must not keep the client's place
        state.client_takes.release(client)
        raise
    # Shutdown ends this take with reason "shutdown"; the transport still sends its end.
    state.http_takes.add(handle)
    if state.shutting_down:
        handle.cancel(EndReason.SHUTDOWN)
    return HttpTake(state, client, model, plan.take, session, handle, t_request)
