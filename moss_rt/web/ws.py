"""The WebSocket directing channel ``/api/ws``.

Per connection there are two kinds of task: the reader (this handler's own coroutine), which
handles every control message as it arrives, and at most one take task that streams audio.
Control never waits behind audio: cancel and seek act on the take task from the reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiohttp import WSMsgType, web

from moss_rt.engine.base import EndReason, EngineBusy, TakeHandle
from moss_rt.protocol import (
    Cancel,
    ClientMessage,
    ErrorCode,
    Ping,
    ProtocolError,
    Seek,
    StartTake,
    decode_client_binary,
    decode_client_text,
    encode_json_frame,
    error_message,
    hello,
)
from moss_rt.session import DirectingSession, SeekPlan, TakeRecord
from moss_rt.web.state import STATE, ServiceState
from moss_rt.web.takes import build_spec, replay_take, resolve_model, stream_take

log = logging.getLogger(__name__)

# How long barge-in waits for the replaced take to send its end (it stops within one frame).
REPLACE_TIMEOUT_SEC = 5.0


class Connection:
    def __init__(self, state: ServiceState, ws: web.WebSocketResponse) -> None:
        self.state = state
        self.ws = ws
        self.session = DirectingSession(state.takes, max_takes=state.settings.limits.max_takes_kept)
        self._send_lock = asyncio.Lock()
        self._take_task: asyncio.Task[None] | None = None
        self._handle: TakeHandle | None = None

    # -- sending ------------------------------------------------------------------------

    async def send_frame(self, frame: bytes) -> None:
        async with self._send_lock:
            await self.ws.send_bytes(frame)

    async def send_json(self, obj: dict[str, object]) -> None:
        await self.send_frame(encode_json_frame(obj))

    async def send_error(self, err: ProtocolError, take: str | None = None) -> None:
        await self.send_json(error_message(err, take=take).to_dict())

    # -- lifecycle ----------------------------------------------------------------------

    async def run(self) -> None:
        info = self.state.engine.info
        await self.send_json(
            hello(
                models=list(info.models),
                default_model=info.default_model,
                demo=info.demo,
                limits=self.state.settings.limits,
                engine=info.name,
            ).to_dict()
        )
        try:
            async for msg in self.ws:
                if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    await self._on_message(msg.data, text=msg.type == WSMsgType.TEXT)
                elif msg.type == WSMsgType.ERROR:
                    log.info("websocket error: %s", self.ws.exception())
        finally:
            await self._stop_take(EndReason.CANCELLED, wait=False)
            self.session.close()

    async def _on_message(self, data: str | bytes, *, text: bool) -> None:
        limits = self.state.settings.limits
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
                await self.ws.close(code=1008, message=err.message.encode()[:120])

    async def _dispatch(self, msg: ClientMessage) -> None:
        if isinstance(msg, Ping):
            await self.send_json({"type": "pong", "t": msg.t, "server_t": time.time()})
        elif isinstance(msg, Cancel):
            running = self.session.running
            if running is not None and (msg.take is None or msg.take in (running.take_id, running.label)):
                await self._stop_take(EndReason.CANCELLED, wait=False)
        elif isinstance(msg, StartTake):
            await self._start(msg)
        elif isinstance(msg, Seek):
            await self._seek(msg)

    # -- takes --------------------------------------------------------------------------

    async def _stop_take(self, reason: EndReason, *, wait: bool) -> None:
        """Ask the running take to end; with ``wait`` return once its end frame was sent."""
        task, handle = self._take_task, self._handle
        if handle is not None:
            handle.cancel(reason)
        if task is None or task.done():
            return
        if wait:
            try:
                await asyncio.wait_for(asyncio.shield(task), REPLACE_TIMEOUT_SEC)
            except TimeoutError:
                task.cancel()
        elif self.ws.closed:
            task.cancel()

    async def _start(self, request: StartTake) -> None:
        await self._stop_take(EndReason.REPLACED, wait=True)
        model = resolve_model(self.state, request.model)
        plan = self.session.plan_start(request)
        self._launch(plan.take, model, prefix=None, t_request=time.monotonic())

    async def _seek(self, msg: Seek) -> None:
        t_request = time.monotonic()
        plan: SeekPlan = self.session.plan_seek(msg)
        await self._stop_take(EndReason.REPLACED, wait=True)
        model = resolve_model(self.state, plan.take.request.model)
        await self.send_json({"type": "seek", **plan.ack()})
        if plan.mode == "replay":
            self._take_task = asyncio.create_task(self._replay(plan.source, plan.frame, model))
            self._handle = None
        else:
            self._launch(plan.take, model, prefix=plan.prefix_codes, t_request=t_request)

    def _launch(self, take: TakeRecord, model: str, *, prefix: object, t_request: float) -> None:
        self._handle = None
        self._take_task = asyncio.create_task(self._run_take(take, model, prefix, t_request))

    async def _run_take(self, take: TakeRecord, model: str, prefix: object, t_request: float) -> None:
        handle: TakeHandle | None = None
        try:
            spec = await build_spec(self.state, take, prefix_codes=prefix)  # type: ignore[arg-type]
            handle = await self.state.engine.submit(spec)
            self._handle = handle
            if self.session.running is not take:  # cancelled while we were being admitted
                handle.cancel(EndReason.CANCELLED)
            await stream_take(self.state, handle, take, self.session, self.send_frame, t_request=t_request, model=model)
        except ProtocolError as err:
            self.session.record_end(take, EndReason.ERROR.value, {})
            await self._safe(self.send_error(err, take=take.take_id))
        except EngineBusy as busy:
            self.session.record_end(take, EndReason.ERROR.value, {})
            err = ProtocolError(ErrorCode.BUSY, f"the service is at capacity; retry in {busy.retry_after_sec:.0f} s")
            await self._safe(self.send_error(err, take=take.take_id))
        except (ConnectionResetError, asyncio.CancelledError):
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

    async def _replay(self, take: TakeRecord, frame: int, model: str) -> None:
        try:
            await replay_take(self.state, take, frame, self.send_frame, model=model)
        except ConnectionResetError:
            pass

    async def _safe(self, coro: object) -> None:
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await coro  # type: ignore[misc]

    async def close(self) -> None:
        task = self._take_task
        await self._stop_take(EndReason.CANCELLED, wait=False)
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def websocket_handler(request: web.Request) -> web.WebSocketResponse:
    state = request.app[STATE]
    ws = web.WebSocketResponse(
        heartbeat=30.0,
        # Oversize-but-sane messages get a tag-0 too_large error from the decoder; only
        # absurd ones are cut off by aiohttp itself (close 1009).
        max_msg_size=4 * state.settings.limits.max_message_bytes,
        receive_timeout=state.settings.ws_idle_timeout_sec,
    )
    await ws.prepare(request)
    connection = Connection(state, ws)
    state.websockets.add(ws)
    try:
        await connection.run()
    except asyncio.TimeoutError:
        log.info("closing idle websocket")
    finally:
        state.websockets.discard(ws)
        await connection.close()
        await ws.close()
    return ws
