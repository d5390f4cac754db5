"""The WebSocket directing channel ``/api/ws``.

Per connection there are two kinds of task: the reader (this handler's own coroutine), which
handles every control message as it arrives, and at most one take task that streams audio.
Control never waits behind audio: cancel and seek act on the take task from the reader.

Guards (docs/limits.md): the upgrade is refused with a JSON 403/503 when the Origin is foreign,
the server is shutting down or ``max_connections`` sockets are open; control messages pass a
per-connection token bucket; takes count against the client's address; a send blocked for
``send_stall_timeout_sec`` (the client stopped reading) drops the connection and frees its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import numpy as np
from aiohttp import WSCloseCode, WSMsgType, web

from moss_rt.engine.base import EndReason, EngineBusy, TakeHandle
from moss_rt.protocol import (
    Cancel,
    ClientMessage,
    ErrorCode,
    ErrorMessage,
    Ping,
    ProtocolError,
    Resume,
    Seek,
    ServerMessage,
    SessionResumed,
    StartTake,
    decode_client_binary,
    decode_client_text,
    encode_json_frame,
    hello,
    pong,
)
from moss_rt.session import DirectingSession, SeekPlan, TakeRecord
from moss_rt.session_store import StoredTake
from moss_rt.web.errors import busy_response, error_response
from moss_rt.web.guards import TokenBucket
from moss_rt.web.security import forbidden_origin, websocket_origin_allowed
from moss_rt.web.state import STATE, ServiceState
from moss_rt.web.takes import (
    build_spec,
    bytes_per_frame,
    replay_end,
    replay_take,
    resolve_model,
    stream_take,
    take_audio,
)

log = logging.getLogger(__name__)

# How long barge-in waits for the replaced take to send its end (it stops within one frame).
REPLACE_TIMEOUT_SEC = 5.0
# A close handshake with a client that does not read cannot complete; give it this long, then abort.
CLOSE_TIMEOUT_SEC = 1.0
# Close codes (docs/limits.md).
CLOSE_IDLE = WSCloseCode.OK  # reason "idle timeout"
CLOSE_POLICY = WSCloseCode.POLICY_VIOLATION  # fatal protocol error, flooding, stalled reader
CLOSE_SHUTDOWN = WSCloseCode.GOING_AWAY


def flood_limit(burst: int) -> int:
    """Messages refused in a row (while rate limited) before the socket is closed as a flood."""
    return max(100, 5 * burst)


class Connection:
    def __init__(self, state: ServiceState, ws: web.WebSocketResponse, request: web.Request) -> None:
        self.state = state
        self.ws = ws
        self.client = request.remote or "unknown"
        self._transport = request.transport
        limits = state.settings.limits
        self.session = DirectingSession(state.takes, max_takes=limits.max_takes_kept)
        self._bucket = TokenBucket(limits.ws_messages_per_sec, limits.ws_message_burst)
        self._refused_in_row = 0
        self._send_lock = asyncio.Lock()
        self._take_task: asyncio.Task[None] | None = None
        self._handle: TakeHandle | None = None
        self._replay_stop: EndReason | None = None  # why a running replay was stopped
        self._replaying = False  # the take task is a replay (no engine handle)
        self._stop_requested: EndReason | None = None  # a stop that came before the engine handle
        self._retiring: set[asyncio.Task[None]] = set()  # replaced take tasks still finishing
        self._replay_take: TakeRecord | None = None
        self._replay_started = False
        self._dead = False  # set once the client is known gone or dropped: no more sends
        self.session_id: str | None = None  # the stored directing session this connection is bound to (resume)
        self._shutting_down = False

    # -- sending ------------------------------------------------------------------------

    async def send_frame(self, frame: bytes) -> None:
        """Send one frame; a client that leaves it unread for the stall timeout is dropped.

        aiohttp's writer waits for the socket to drain once 256 KiB are buffered, so an awaited
        send is what bounds the buffer; the timeout is what frees the take of a dead reader.
        """
        async with self._send_lock:
            if self._dead or self.ws.closed:
                raise ConnectionResetError("the connection is closed")
            try:
                await asyncio.wait_for(self.ws.send_bytes(frame), self.state.settings.send_stall_timeout_sec)
            except TimeoutError:
                log.warning(
                    "client %s stopped reading for %.1f s; dropping it",
                    self.client,
                    self.state.settings.send_stall_timeout_sec,
                )
                # No close frame: the socket buffer it would go through is the one that is full.
                self._abort()
                raise ConnectionResetError("client stopped reading") from None

    async def send_message(self, message: ServerMessage) -> None:
        await self.send_frame(encode_json_frame(message.to_dict()))

    async def send_error(self, err: ProtocolError, take: str | None = None) -> None:
        await self.send_message(ErrorMessage.of(err, take=take))

    def _abort(self) -> None:
        """Give up on the client now: free its take and drop the TCP connection.

        Unsent bytes would keep the socket (and its buffers) alive for as long as the peer keeps
        its window shut; abort discards them. The reader then sees EOF and the handler ends.
        """
        self._dead = True
        if self._handle is not None:
            self._handle.cancel(EndReason.CANCELLED)
        if self._transport is not None:
            self._transport.abort()

    # -- lifecycle ----------------------------------------------------------------------

    async def run(self) -> None:
        info = self.state.engine.info
        await self.send_message(
            hello(
                models=list(info.models),
                default_model=info.default_model,
                demo=info.demo,
                limits=self.state.settings.limits,
                engine=info.name,
                sampling=True,
                sessions=self.state.sessions is not None,
            )
        )
        idle = self.state.settings.ws_idle_timeout_sec
        try:
            while not self.ws.closed:
                try:
                    msg = await self.ws.receive(timeout=idle if idle > 0 else None)
                except TimeoutError:
                    if self._take_running():
                        continue  # a listener that only listens is not idle
                    log.info("closing idle websocket of %s after %.0f s", self.client, idle)
                    await self._close(CLOSE_IDLE, b"idle timeout")
                    break
                if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    await self._on_message(msg.data, text=msg.type == WSMsgType.TEXT)
                elif msg.type == WSMsgType.ERROR:
                    log.info("websocket error from %s: %s", self.client, self.ws.exception())
                    break
                elif msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                    break
        finally:
            self._dead = self._dead or self.ws.closed
            await self._stop_take(EndReason.CANCELLED, wait=False)
            self.session.close()

    def _take_running(self) -> bool:
        return self._take_task is not None and not self._take_task.done()

    async def _close(self, code: int, message: bytes) -> None:
        """Close with ``code``; a peer that does not complete the handshake in time is aborted."""
        try:
            await asyncio.wait_for(self.ws.close(code=code, message=message), CLOSE_TIMEOUT_SEC)
            return
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                self._abort()
                raise
        except Exception:
            log.debug("close handshake with %s failed", self.client, exc_info=True)
        self._abort()

    async def _on_message(self, data: str | bytes, *, text: bool) -> None:
        limits = self.state.settings.limits
        if not self._bucket.take():
            await self._refuse_rate()
            return
        self._refused_in_row = 0
        try:
            msg: ClientMessage
            if text:
                assert isinstance(data, str)
                msg = decode_client_text(data, limits)
            else:
                assert isinstance(data, bytes)
                msg = decode_client_binary(data, limits)
            await self._dispatch(msg)
        except ProtocolError as err:
            await self.send_error(err)
            if err.fatal:
                await self._close(CLOSE_POLICY, err.message.encode()[:120])

    async def _refuse_rate(self) -> None:
        """Drop a message over the rate; say so once per run of refusals; close a flood."""
        limits = self.state.settings.limits
        self._refused_in_row += 1
        if self._refused_in_row == 1:
            await self.send_error(
                ProtocolError(
                    ErrorCode.RATE_LIMITED,
                    f"more than {limits.ws_messages_per_sec:g} messages/s (burst {limits.ws_message_burst}); "
                    f"messages are dropped for {self._bucket.retry_after_sec:.2f} s",
                )
            )
        elif self._refused_in_row > flood_limit(limits.ws_message_burst):
            log.warning("closing flooding websocket of %s", self.client)
            await self._safe(
                self.send_error(ProtocolError(ErrorCode.RATE_LIMITED, "message flood; closing", fatal=True))
            )
            await self._close(CLOSE_POLICY, b"rate limit exceeded")

    async def _dispatch(self, msg: ClientMessage) -> None:
        if isinstance(msg, Ping):
            await self.send_message(pong(t=msg.t, server_t=time.time()))
        elif isinstance(msg, Cancel):
            running = self.session.running
            if running is not None and (msg.take is None or msg.take in (running.take_id, running.label)):
                await self._stop_take(EndReason.CANCELLED, wait=False)
            elif running is None and self._replaying and self._take_running():
                await self._stop_take(EndReason.CANCELLED, wait=False)  # a replay
        elif isinstance(msg, StartTake):
            await self._start(msg)
        elif isinstance(msg, Seek):
            await self._seek(msg)
        elif isinstance(msg, Resume):
            await self._resume(msg)

    # -- stored sessions ------------------------------------------------------------------

    async def _resume(self, msg: Resume) -> None:
        """Bind to a stored session (a new one without an id) and answer its takes (docs/protocol.md)."""
        store = self.state.sessions
        if store is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, "this service keeps no sessions", field="session")
        if self.session_id is not None and msg.session != self.session_id:
            raise ProtocolError(ErrorCode.INVALID_FIELD, "this connection is bound to another session", field="session")
        resumed = msg.session is not None
        session_id = msg.session if resumed else await asyncio.to_thread(store.create)
        assert session_id is not None
        stored = await asyncio.to_thread(store.takes, session_id)  # not_found for an unknown id
        for record in stored:
            if record.take_id in {t.take_id for t in self.session.takes}:
                continue
            try:
                codes = await asyncio.to_thread(store.codes, session_id, record.take_id)
                request = StartTake.parse(record.request, self.state.settings.limits)
            except (OSError, ValueError, ProtocolError) as exc:  # damaged, or limits tightened since
                log.warning("session %s: take %s cannot be resumed: %s", session_id, record.take_id, exc)
                continue
            take = TakeRecord(
                record.take_id, request, record.seed, parent=record.parent, branch_frame=record.branch_frame,
                reason=record.reason, stats=dict(record.stats),
            )  # fmt: skip
            take.append(0, codes)
            self.session.adopt(take)
        self.session_id = session_id
        self.session.keep_until_deleted(store.max_takes)
        await self.send_message(
            SessionResumed(
                session=session_id, resumed=resumed, max_takes=store.max_takes, takes=[t.public() for t in stored]
            )
        )

    async def _check_session_room(self) -> None:
        if self.session_id is not None and self.state.sessions is not None:
            await asyncio.to_thread(self.state.sessions.check_room, self.session_id)

    async def _keep(self, take: TakeRecord) -> None:
        """Store an ended take in the bound session: its record, codes and the audio as it was streamed."""
        store, session_id = self.state.sessions, self.session_id
        if store is None or session_id is None or take.n_frames == 0:
            return
        record = StoredTake(
            take_id=take.take_id, request=take.request.to_dict(), seed=take.seed, n_frames=take.n_frames,
            channels=take.request.channels, parent=take.parent, branch_frame=take.branch_frame, reason=take.reason,
            stats={k: v for k, v in take.stats.items() if isinstance(v, int | float)},
        )  # fmt: skip
        try:
            pcm = await take_audio(self.state, take)
            assert len(pcm) == take.n_frames * bytes_per_frame(take)
            await asyncio.to_thread(store.put_take, session_id, record, take.codes, pcm)
        except ProtocolError as err:  # the session is full, or was deleted meanwhile
            await self._safe(self.send_error(err, take=take.take_id))
        except Exception:
            log.exception("could not keep take %s in session %s", take.take_id, session_id)
            await self._safe(
                self.send_error(ProtocolError(ErrorCode.INTERNAL, "the take could not be stored"), take=take.take_id)
            )

    # -- takes --------------------------------------------------------------------------

    async def _stop_take(self, reason: EndReason, *, wait: bool) -> None:
        """Ask the running take (or replay) to end; with ``wait`` return once its end frame was sent."""
        task, handle = self._take_task, self._handle
        if handle is not None:
            handle.cancel(reason)
        if task is None or task.done():
            return
        if handle is None and self._replaying:
            # A replay has no engine handle: stop the task itself; it answers with an end frame
            # carrying ``reason``. One cancelled before its first step (the reader can handle the
            # next message before the new task ever ran) cannot answer, so the end is sent here.
            self._replay_stop = reason
            task.cancel()
            if not self._replay_started and self._replay_take is not None:
                await self._safe(self.send_message(replay_end(self._replay_take, reason)))
        elif handle is None:
            # A take still being admitted (voice encoding, engine queue): it applies this as soon
            # as it has its handle, so the client still gets the take's end with this reason.
            self._stop_requested = self._stop_requested or reason
        if wait:
            # asyncio.wait, unlike awaiting the task, never re-raises the task's own cancellation
            # into this (reader) task.
            done, _ = await asyncio.wait({task}, timeout=REPLACE_TIMEOUT_SEC)
            if not done:
                # Still being admitted (a slow engine): cancelling it now could lose its end frame
                # or strand an engine slot, so it finishes in the background (it applies the stop
                # as soon as it holds its handle); the connection still owns it.
                log.warning("%s did not stop within %.0f s; it ends in the background", task.get_name(),
                            REPLACE_TIMEOUT_SEC)
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)
        elif (self.ws.closed or self._dead) and (handle is not None or self._replaying):
            # Nobody to stream to. A take still being admitted is left to finish admission: it
            # cancels its own handle then, whereas cancelling it mid-submit could leave the
            # engine generating for no one.
            task.cancel()

    def _refuse_if_shutting_down(self) -> None:
        if self.state.shutting_down:
            raise ProtocolError(ErrorCode.BUSY, "the service is shutting down; reconnect shortly")

    async def _start(self, request: StartTake) -> None:
        self._refuse_if_shutting_down()
        await self._check_session_room()
        await self._stop_take(EndReason.REPLACED, wait=True)
        model = resolve_model(self.state, request.model)
        plan = self.session.plan_start(request)
        self._launch(plan.take, model, prefix=None, t_request=time.monotonic())

    async def _seek(self, msg: Seek) -> None:
        self._refuse_if_shutting_down()
        if msg.mode == "retake":
            await self._check_session_room()
        t_request = time.monotonic()
        plan: SeekPlan = self.session.plan_seek(msg)
        await self._stop_take(EndReason.REPLACED, wait=True)
        model = resolve_model(self.state, plan.take.request.model)
        await self.send_message(plan.ack())
        if plan.mode == "replay":
            self._handle = None
            self._replay_stop = None
            self._stop_requested = None
            self._replaying = True
            self._replay_take = plan.source
            self._replay_started = False
            self._take_task = asyncio.create_task(
                self._replay(plan.source, plan.frame, model), name=f"replay-{plan.source.take_id}"
            )
        else:
            self._launch(plan.take, model, prefix=plan.prefix_codes, t_request=t_request)

    def _launch(self, take: TakeRecord, model: str, *, prefix: np.ndarray | None, t_request: float) -> None:
        self._handle = None
        self._replay_stop = None
        self._stop_requested = None
        self._replaying = False
        self._take_task = asyncio.create_task(
            self._run_take(take, model, prefix, t_request), name=f"take-{take.take_id}"
        )

    async def _run_take(
        self, take: TakeRecord, model: str, prefix: np.ndarray | None, t_request: float
    ) -> None:
        handle: TakeHandle | None = None
        holding = False
        try:
            # Counted per client address across all its sockets and HTTP streams.
            self.state.client_takes.acquire(self.client)
            holding = True
            spec = await build_spec(self.state, take, prefix_codes=prefix)
            handle = await self.state.engine.submit(spec)
            self._handle = handle
            # Stops that arrived while we were being admitted apply now (the first one wins).
            if self._stop_requested is not None:
                handle.cancel(self._stop_requested)
            if self.session.running is not take:
                handle.cancel(EndReason.CANCELLED)
            if self._shutting_down:
                handle.cancel(EndReason.SHUTDOWN)
            if self._dead:
                handle.cancel(EndReason.CANCELLED)
            await stream_take(
                self.state, handle, take, self.session, self.send_frame, t_request=t_request, model=model,
                keep=self._keep,
            )  # fmt: skip
        except ProtocolError as err:
            self.session.record_end(take, EndReason.ERROR.value, {})
            await self._safe(self.send_error(err, take=take.take_id))
        except EngineBusy as busy:
            self.session.record_end(take, EndReason.ERROR.value, {})
            await self._safe(self.send_error(busy_error(busy), take=take.take_id))
        except ConnectionResetError:
            log.debug("client %s left during take %s", self.client, take.take_id)  # nobody to tell
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("take %s failed", take.take_id)
            self.session.record_end(take, EndReason.ERROR.value, {})
            await self._safe(self.send_error(ProtocolError(ErrorCode.INTERNAL, "generation failed"), take=take.take_id))
        finally:
            if handle is not None:
                handle.cancel(EndReason.CANCELLED)
            if self._handle is handle:
                self._handle = None
            if holding:
                self.state.client_takes.release(self.client)

    async def _replay(self, take: TakeRecord, frame: int, model: str) -> None:
        self._replay_started = True
        try:
            # A replay streams (and renders) like a take, so it counts toward the client's take cap.
            with self.state.client_takes.hold(self.client):
                await replay_take(self.state, take, frame, self.send_frame, model=model)
        except ProtocolError as err:
            await self._safe(self.send_error(err, take=take.take_id))
        except EngineBusy as busy:
            await self._safe(self.send_error(busy_error(busy), take=take.take_id))
        except ConnectionResetError:
            pass
        except asyncio.CancelledError:
            reason = self._replay_stop
            if reason is not None and not self._dead and not self.ws.closed:
                # Stopped on purpose (cancel, barge-in, shutdown): the client still gets an end.
                await self._safe(self.send_message(replay_end(take, reason)))
            raise

    async def _safe(self, coro: object) -> None:
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await coro  # type: ignore[misc]

    async def shutdown(self, grace_sec: float) -> None:
        """End the running take with reason ``shutdown`` (its end frame goes out), then close 1001."""
        self._shutting_down = True
        task = self._take_task
        await self._stop_take(EndReason.SHUTDOWN, wait=False)
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=grace_sec)
        await self._close(CLOSE_SHUTDOWN, b"server shutdown")

    async def close(self) -> None:
        """Release everything the connection holds; bounded, never leaves its take task behind."""
        self._dead = True
        task = self._take_task
        await self._stop_take(EndReason.CANCELLED, wait=False)
        pending = {t for t in (task, *self._retiring) if t is not None and not t.done()}
        if pending:
            _, late = await asyncio.wait(pending, timeout=REPLACE_TIMEOUT_SEC)
            for t in late:
                t.cancel()
            if late:
                await asyncio.wait(late)


def busy_error(busy: EngineBusy) -> ProtocolError:
    """The tag-0 form of an engine at capacity (HTTP answers 503 with Retry-After instead)."""
    return ProtocolError(ErrorCode.BUSY, f"the service is at capacity; retry in {busy.retry_after_sec:.0f} s")


async def websocket_handler(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    settings = state.settings
    # Everything that can refuse the socket is decided before the upgrade, as a JSON answer.
    if not websocket_origin_allowed(settings, request):
        log.info("refused WebSocket from origin %r (%s)", request.headers.get("Origin"), request.remote)
        return forbidden_origin(request.headers.get("Origin", ""))
    if state.shutting_down:
        return error_response(ErrorCode.BUSY, "the service is shutting down", headers={"Retry-After": "5"})
    if state.ws_slots >= settings.max_connections:
        log.warning("refused WebSocket from %s: %d connections open", request.remote, state.ws_slots)
        return busy_response(5.0)
    state.ws_slots += 1  # reserved now, so concurrent upgrades cannot overshoot the limit
    try:
        ws = web.WebSocketResponse(
            # PCM barely compresses; permessage-deflate would only cost CPU per frame.
            compress=False,
            heartbeat=settings.ws_heartbeat_sec if settings.ws_heartbeat_sec > 0 else None,
            # Oversize-but-sane messages get a tag-0 too_large error from the decoder; only
            # absurd ones are cut off by aiohttp itself (close 1009) before being buffered whole.
            max_msg_size=4 * settings.limits.max_message_bytes,
        )
        await ws.prepare(request)
        connection = Connection(state, ws, request)
        state.websockets.add(ws)
        state.connections.add(connection)
        try:
            await connection.run()
        except ConnectionResetError:
            log.info("client %s left", connection.client)
        finally:
            state.websockets.discard(ws)
            state.connections.discard(connection)
            await connection.close()
            await connection._close(WSCloseCode.OK, b"")
        return ws
    finally:
        state.ws_slots -= 1
