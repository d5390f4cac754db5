"""One take for one HTTP request: admission and release, shared by ``POST /api/stream`` and ``/v1/audio/speech``.

Both routes admit a take the same way (model, the client's take cap, a one-take
:class:`~moss_rt.web.takes.OneTake` session, the engine queue) and free the same things when the
request ends however it ends (client gone, shutdown, error), so limits, busy answers and clean-up
cannot drift apart between the legacy stream and the OpenAI-compatible one.
"""

from __future__ import annotations

from dataclasses import dataclass

from moss_rt.engine.base import EndReason
from moss_rt.protocol import ErrorCode, ProtocolError, StartTake
from moss_rt.session import TakeRecord
from moss_rt.web.state import ServiceState
from moss_rt.web.takes import OneTake, SendFrame


@dataclass
class HttpTake:
    """An admitted take: the engine is generating it; :meth:`release` must follow."""

    state: ServiceState
    client: str
    one: OneTake

    @property
    def take(self) -> TakeRecord:
        return self.one.take

    async def stream(self, send: SendFrame, *, paced: bool = True) -> None:
        """Send the take's frames (start, audio, end) as the WebSocket channel would. ``paced``: hold the
        client to real time plus ``max_lead_sec``; not for a file sent only once complete (nobody plays it
        meanwhile, and pacing would only delay its first byte)."""
        await self.one.stream(send, max_lead_sec=self.state.settings.max_lead_sec if paced else 0.0)

    def release(self) -> None:
        """Stop the take if it still runs (a client that left must free its engine slot), end its record
        (``cancelled`` when its end never came) and give back the client's take place."""
        self.one.close(EndReason.CANCELLED)
        self.state.http_takes.discard(self.one.handle)
        self.state.client_takes.release(self.client)


async def admit_http_take(state: ServiceState, client: str, start: StartTake, *, t_request: float) -> HttpTake:
    """Admit ``start`` for ``client``; raises ProtocolError (refused) or EngineBusy (at capacity).

    On success the take counts against the client and is ended with reason ``shutdown`` when the
    service stops; on failure nothing is held.
    """
    if state.shutting_down:
        raise ProtocolError(ErrorCode.BUSY, "the service is shutting down")
    OneTake.check(state, start)  # an unknown model is refused before the take counts
    state.client_takes.acquire(client)  # rate_limited (429) past max_takes_per_client
    try:
        one = await OneTake.open(state, start, received_at=t_request, client=client)
    except BaseException:  # a refusal, a 500 or a cancelled request must not keep the client's place
        state.client_takes.release(client)
        raise
    # Shutdown ends this take with reason "shutdown"; the transport still sends its end.
    state.http_takes.add(one.handle)
    if state.shutting_down:
        one.handle.cancel(EndReason.SHUTDOWN)
    return HttpTake(state, client, one)
