"""The WebSocket directing channel ``/api/ws``: a thin shell around :class:`~moss_rt.session.TakeLifecycle`.

The shell reads messages, hands them to the take lifecycle (sans-I/O: it decides what is sent), and
performs the actions it answers: send a message or PCM, admit a take (a task per run: voice
encoding, engine submit, then its events back through the lifecycle), replay stored audio, stop a
run. The reader (this handler's own coroutine) never waits behind audio: cancel and seek are
decided by the lifecycle at once.

Guards (docs/limits.md): the upgrade is refused with a JSON 403/503 when the Origin is foreign,
the server is shutting down or ``max_connections`` sockets are open; control messages pass a
per-connection token bucket; takes count against the client's address; a send blocked for
``send_stall_timeout_sec`` (the client stopped reading) drops the connection and frees its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from aiohttp import WSCloseCode, WSMsgType, web

from moss_rt.align.base import WordTime
from moss_rt.engine.base import EngineBusy, TakeHandle
from moss_rt.protocol import (
    AUDIO_FORMATS,
    AUDIO_SAMPLE_RATES,
    UNSET,
    ClientMessage,
    Discard,
    ErrorCode,
    ErrorMessage,
    ProtocolError,
    Resume,
    Seek,
    ServerMessage,
    SessionResumed,
    StartTake,
    TakeStored,
    Words,
    decode_client_binary,
    decode_client_text,
    encode_json_frame,
    hello,
)
from moss_rt.session import (
    Action,
    Admit,
    FinishWords,
    Go,
    Keep,
    Replay,
    SendAudio,
    Stop,
    TakeRecord,
    TakeStatus,
    WordsCheckpoint,
    bytes_per_frame,
)
from moss_rt.session_records import StoredTake, TakeKind, short_id
from moss_rt.web.audio_out import AudioOuts
from moss_rt.web.errors import busy_response, error_response
from moss_rt.web.guards import TokenBucket
from moss_rt.web.owners import owner_or_mint, set_owner_cookie
from moss_rt.web.security import forbidden_origin, websocket_origin_allowed
from moss_rt.web.state import STATE, ServiceState
from moss_rt.web.takes import Pacer, admit, busy_error, held_take_audio, new_lifecycle, pump_events, send_action
from moss_rt.web.words import TakeWords, require_aligner, take_words

log = logging.getLogger(__name__)

# How long a closing connection waits for its runs to wind down before giving up on them.
RUNS_TIMEOUT_SEC = 5.0
# A resume waits at most this long for a closing connection of the same session to store its cut-off take.
RESUME_WAIT_SEC = 10.0
# A close handshake with a client that does not read cannot complete; give it this long, then abort.
CLOSE_TIMEOUT_SEC = 1.0
# Close codes (docs/limits.md).
CLOSE_IDLE = WSCloseCode.OK  # reason "idle timeout"
CLOSE_POLICY = WSCloseCode.POLICY_VIOLATION  # fatal protocol error, flooding, stalled reader
CLOSE_SHUTDOWN = WSCloseCode.GOING_AWAY


def flood_limit(burst: int) -> int:
    """Messages refused in a row (while rate limited) before the socket is closed as a flood."""
    return max(100, 5 * burst)


class Link(enum.Enum):
    """Whether the client can still be sent anything."""

    OPEN = "open"
    GONE = "gone"  # it left, was dropped (a stalled reader), or the connection is closing: nothing more is sent


class RunStage(enum.Enum):
    """Where the transport is with one run (what a stop acts on)."""

    ADMITTING = "admitting"  # a take: the client's take slot, its voice, the engine's submit
    STREAMING = "streaming"  # a take the engine admitted: a stop cancels its engine take (``handle``)
    STREAMED = "streamed"  # a take whose events are over: its task is winding down
    QUEUED = "queued"  # a replay whose task has not begun (it takes its client's take slot first)
    FETCHING = "fetching"  # a replay getting its audio (held, or rendered): a stop cancels the task
    SENDING = "sending"  # a replay sending its audio: it stops by itself (each chunk is checked before it goes)


@dataclass
class RunIO:
    """The transport side of one run of the take lifecycle: its task, the pacer of its audio, its engine take."""

    run: int
    take_id: str
    replay: bool
    pacer: Pacer
    stage: RunStage
    task: asyncio.Task[None] | None = None
    handle: TakeHandle | None = None  # while STREAMING
    # A take admitted early (Admit.early): set when it became current (Go) or was stopped before; its events are
    # read only then.
    go: asyncio.Event = field(default_factory=asyncio.Event)


class Connection:
    def __init__(self, state: ServiceState, ws: web.WebSocketResponse, request: web.Request) -> None:
        self.state = state
        self.ws = ws
        self.client = request.remote or "unknown"
        self._transport = request.transport
        limits = state.settings.limits
        self.lifecycle = new_lifecycle(state, max_takes_kept=limits.max_takes_kept, client=self.client,
                                       early_admission=True)
        self._bucket = TokenBucket(limits.ws_messages_per_sec, limits.ws_message_burst)
        self._refused_in_row = 0
        self._send_lock = asyncio.Lock()
        # The lifecycle's actions are performed from several tasks (the receive loop, each run's task), and some
        # await (a take is stored, its words finished, before its `end`). Their control actions go out one list at a
        # time, in the order the lifecycle made them, so nothing of a later state overtakes an `end` still being
        # stored (docs/protocol.md, "Barge-in"). Audio (paced) and stops never wait for it.
        self._order = asyncio.Lock()
        # The transport side of the lifecycle's runs, by run number: one task each (admission and
        # stream, or replay), the engine handle once admitted, the pacer of its audio.
        self._runs: dict[int, RunIO] = {}
        self._outs = AudioOuts()  # the files of takes that asked for a format (tag-2 frames)
        self._take_pacer: tuple[str, Pacer] | None = None  # the pacer of the last take admitted
        self._link = Link.OPEN
        self.session_id: str | None = None  # the stored directing session this connection is bound to (resume)
        self._keeps_on_close: list[TakeRecord] = []  # takes the client's leaving cut off, stored by close()
        # Splices and comps of the bound session adopted for retakes and replays: their audio is their stored PCM,
        # not their codes' decoding (moss_rt/splices.py), held as heard before either (_edit_audio_for_seek).
        self._edits: set[str] = set()
        self._unkept: set[str] = set()  # running takes the client discarded: not kept when they end (discard)
        self.owner: str | None = None  # who the connection acts as for stored sessions (moss_rt/web/owners.py)
        # Takes that asked for ``words``: their word aligners (by take id).
        self._words: dict[str, TakeWords] = {}

    # -- sending ------------------------------------------------------------------------

    async def send_frame(self, frame: bytes) -> None:
        """Send one frame; a client that leaves it unread for the stall timeout is dropped.

        aiohttp's writer waits for the socket to drain once 256 KiB are buffered, so an awaited
        send is what bounds the buffer; the timeout is what frees the take of a dead reader.
        """
        async with self._send_lock:
            await self._write(frame)

    async def _write(self, frame: bytes) -> None:
        """One frame out; the caller holds the send lock."""
        if self._link is Link.GONE or self.ws.closed:
            raise ConnectionResetError("the connection is closed")
        try:
            # A timeout scope, not wait_for: no task per frame (a relaying front end sends hundreds a second).
            async with asyncio.timeout(self.state.settings.send_stall_timeout_sec):
                await self.ws.send_bytes(frame)
        except TimeoutError:
            log.warning(
                "client %s stopped reading for %.1f s; dropping it",
                self.client,
                self.state.settings.send_stall_timeout_sec,
            )
            # No close frame: the socket buffer it would go through is the one that is full.
            self._abort()
            raise ConnectionResetError("client stopped reading") from None

    async def _send_audio(self, action: SendAudio) -> bool:
        """Send one chunk of a run's audio, only while the lifecycle still has the run as its current take.

        The lifecycle may let go of a run at any moment (a cancel or a barge-in on a replay ends it from the
        reader, which sends its ``end`` at once), so the check is made before the pacing wait, before encoding,
        and again under the send lock right before the frame goes out: every end goes through that lock too,
        so no audio of a run can follow its end (issue 23, finding 3). Bytes a stale run had encoded stay in
        its file's queue and leave with the file's end (``FinishAudio``), before the ``end``. False: not sent.
        """
        run = action.run
        if not self.lifecycle.is_current(run):
            return False
        io = self._runs.get(run)
        if io is not None and action.paced:
            await io.pacer.wait(action.seconds)
        if not self.lifecycle.is_current(run):
            return False
        await self._outs.encode(run, action.pcm)
        async with self._send_lock:
            if not self.lifecycle.is_current(run):
                return False
            for frame in self._outs.ready(run, action.pcm):
                await self._write(frame)
        return True

    async def send_message(self, message: ServerMessage) -> None:
        await self.send_frame(encode_json_frame(message.to_dict()))

    async def send_error(self, err: ProtocolError, take: str | None = None) -> None:
        await self.send_message(ErrorMessage.of(err, take=take))

    def _abort(self) -> None:
        """Give up on the client now: free its take and drop the TCP connection.

        Unsent bytes would keep the socket (and its buffers) alive for as long as the peer keeps
        its window shut; abort discards them. The reader then sees EOF and the handler ends.
        """
        self._link = Link.GONE
        self._close_lifecycle()
        if self._transport is not None:
            self._transport.abort()

    def _close_lifecycle(self) -> None:
        """The client is gone: stop the lifecycle's runs; the takes it cut off are stored by :meth:`close`."""
        for action in self.lifecycle.close():
            if isinstance(action, Stop):
                self._stop(action)
            elif action.take.take_id not in self._unkept:
                self._keeps_on_close.append(action.take)

    # -- performing the lifecycle's actions -----------------------------------------------

    async def _perform(self, actions: Sequence[Action]) -> None:
        """Perform a list of the lifecycle's actions in order: its runs of control actions (messages, stores, runs
        started) under the order lock, its audio and stops directly."""
        i = 0
        while i < len(actions):
            if isinstance(actions[i], SendAudio | Stop):
                await self._perform_one(actions[i])
                i += 1
                continue
            j = i
            while j < len(actions) and not isinstance(actions[j], SendAudio | Stop):
                j += 1
            async with self._order:
                for action in actions[i:j]:
                    await self._perform_one(action)
            i = j

    async def _perform_one(self, action: Action) -> None:
        if isinstance(action, Stop):
            self._stop(action)
        elif isinstance(action, Admit):
            self._outs.track(action.run, action.take)
            self._follow_words(action.take)
            self._spawn(action.run, action.take.take_id, functools.partial(self._run_take, action))
        elif isinstance(action, Go):
            io = self._runs.get(action.run)
            if io is not None:
                io.go.set()
        elif isinstance(action, Replay):
            self._outs.track(action.run, action.take, replay=True)
            self._spawn(action.run, action.take.take_id, functools.partial(self._run_replay, action), replay=True)
        elif isinstance(action, Keep):
            await self._keep(action.take)
        elif isinstance(action, FinishWords):
            await self._finish_words(action)
        elif isinstance(action, WordsCheckpoint):
            words = self._words.get(action.take.take_id)
            if words is not None:
                words.checkpoint(action.text)
        elif isinstance(action, SendAudio):
            if await self._send_audio(action):
                io = self._runs.get(action.run)
                words = None if io is None or io.replay else self._words.get(io.take_id)
                if words is not None:
                    words.audio(action.pcm)
        else:
            await send_action(action, self.send_frame, None, self._outs)

    # -- word timing (docs/words.md) -----------------------------------------------------

    def _follow_words(self, take: TakeRecord) -> None:
        """A take that asked for ``words``: align its audio as it is sent (the continuations of a take fed with
        text share one)."""
        if take.request.words and take.take_id not in self._words and self.state.aligner is not None:
            self._words[take.take_id] = TakeWords(self.state, self.state.aligner, take, self.send_frame)

    async def _finish_words(self, action: FinishWords) -> None:
        """Its last words before its ``end``: the rest aligned now (a take that never streamed: its kept words)."""
        words = self._words.pop(action.take.take_id, None)  # its audio from now on (none) is not aligned
        if words is not None:
            await words.finish(complete=action.complete)
            return
        kept = action.take.words or []
        message = Words(take=action.take.take_id, words=[w.to_dict() for w in kept], index=0, final=True)
        await self.send_message(message)

    async def _words_for_seek(self, msg: Seek) -> None:
        """``seek`` by ``word`` needs the take's words: a finished take without them is aligned first."""
        take = self.lifecycle.history.get(msg.take)  # not_found for an unknown take
        if take.words is None and take.status is TakeStatus.ENDED:
            require_aligner(self.state)
            take.words = await take_words(self.state, take)

    def _spawn(self, run: int, take_id: str, body: Callable[[], Awaitable[None]], *, replay: bool = False) -> None:
        """Start the task of a run; the connection owns it (close cancels it). The runs of one take
        (the continuations of a take fed with text) share its pacer: it is paced as one stream."""
        if not replay and self._take_pacer is not None and self._take_pacer[0] == take_id:
            pacer = self._take_pacer[1]
        else:
            pacer = Pacer(self.state.settings.max_lead_sec)
            self._take_pacer = None if replay else (take_id, pacer)
        # Not cancelled before its body runs (its ``finally`` forgets the run): a replay is cancellable once fetching.
        stage = RunStage.QUEUED if replay else RunStage.ADMITTING
        io = self._runs[run] = RunIO(run, take_id, replay, pacer, stage)
        io.task = asyncio.create_task(self._owned(run, body), name=f"{'replay' if replay else 'take'}-{take_id}")

    async def _owned(self, run: int, body: Callable[[], Awaitable[None]]) -> None:
        try:
            await body()
        except ConnectionResetError:
            log.debug("client %s left during run %d", self.client, run)  # nobody to tell
        except Exception:
            log.exception("run %d of %s failed", run, self.client)
        finally:
            self._runs.pop(run, None)
            self._outs.forget(run)

    def _stop(self, action: Stop) -> None:
        """Stop a run: an engine take is cancelled (its end then comes through the lifecycle). A replay
        (whose end the lifecycle already sent) stops sending by itself: each of its chunks is checked against
        the lifecycle right before it goes out; one still fetching its audio (a render) is cancelled. A run
        still being admitted is left to finish admission: the lifecycle stops what it admits as soon as it
        reports back."""
        io = self._runs.get(action.run)
        if io is None:
            return
        io.go.set()  # a take admitted early and waiting to be current: it sees that it is not, and lets go
        if io.stage is RunStage.STREAMING and io.handle is not None:
            io.handle.cancel(action.reason)
        elif io.stage is RunStage.FETCHING and io.task is not None:
            # Only while fetching: cancelling a task in the middle of a send or an encode would not stop
            # anything sooner (Python 3.11's wait_for can even swallow the cancel) and could lose encoded bytes.
            io.task.cancel()

    @property
    def current_handle(self) -> TakeHandle | None:
        """The engine handle of the take now streaming (tests and diagnostics)."""
        take = self.lifecycle.current_take
        streaming = [
            io.handle for io in self._runs.values()
            if io.handle is not None and take is not None and io.handle.take_id == take.take_id
        ]  # fmt: skip
        return streaming[-1] if streaming else None

    async def _run_take(self, action: Admit) -> None:
        run = action.run
        try:
            # Counted per client address across all its sockets and HTTP streams. A take admitted early replaces
            # this socket's take that is stopping: for a moment both count, and the cap does not refuse it for that.
            self.state.client_takes.acquire(self.client, replacing=action.early)
        except ProtocolError as err:
            await self._perform(self.lifecycle.admission_failed(run, err))
            return
        try:
            try:
                handle = await admit(self.state, action)
            except ProtocolError as err:
                await self._perform(self.lifecycle.admission_failed(run, err))
                return
            except EngineBusy as busy:
                await self._perform(self.lifecycle.admission_failed(run, busy_error(busy)))
                return
            io = self._runs[run]
            io.handle, io.stage = handle, RunStage.STREAMING
            try:
                await self._perform(self.lifecycle.admitted(run, rebuilt=handle.rebuilt))
                if self.lifecycle.is_pending(run):
                    await io.go.wait()  # the replaced take's end goes out first (Go), or this one is stopped
                if self.lifecycle.is_current(run):
                    await pump_events(handle, run, self.lifecycle, self._perform)
                else:
                    handle.cancel()  # let go of while being admitted (already ended for the client)
            except (ConnectionResetError, asyncio.CancelledError):
                raise
            except Exception:
                log.exception("take %s failed", action.take.take_id)
                await self._perform(self.lifecycle.take_failed(run))
            finally:
                io.handle, io.stage = None, RunStage.STREAMED
        finally:
            self.state.client_takes.release(self.client)

    async def _run_replay(self, action: Replay) -> None:
        run = action.run
        try:
            # A replay streams (and renders) like a take, so it counts toward the client's take cap.
            with self.state.client_takes.hold(self.client):
                io = self._runs[run]
                io.stage = RunStage.FETCHING  # a Stop cancels the fetch (a render nobody will hear)
                try:
                    async with held_take_audio(self.state, action.take, client=self.client) as pcm:
                        io.stage = RunStage.SENDING
                        await self._perform(self.lifecycle.replay_audio(run, pcm))
                        await self._perform(self.lifecycle.replay_finished(run))
                finally:
                    io.stage = RunStage.SENDING
        except ProtocolError as err:
            await self._perform(self.lifecycle.replay_failed(run, err))
        except EngineBusy as busy:
            await self._perform(self.lifecycle.replay_failed(run, busy_error(busy)))
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception:  # a replay acknowledged must end (error, then end), whatever its audio did
            log.exception("replay of take %s failed", action.take.take_id)
            failed = ProtocolError(ErrorCode.INTERNAL, "the take's audio could not be replayed")
            await self._perform(self.lifecycle.replay_failed(run, failed))

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
                # What start may ask for: delivery formats (tag-2 frames) and their rates.
                formats=list(AUDIO_FORMATS),
                sample_rates=list(AUDIO_SAMPLE_RATES),
                sessions=self.state.sessions is not None,
                # Word timing: start/seek may ask for "words" (docs/protocol.md "Word timing").
                words=self.state.aligner is not None,
                aligner=self.state.aligner.name if self.state.aligner is not None else None,
            )
        )
        idle = self.state.settings.ws_idle_timeout_sec
        try:
            while not self.ws.closed:
                try:
                    msg = await self.ws.receive(timeout=idle if idle > 0 else None)
                except TimeoutError:
                    if self.lifecycle.busy:
                        continue  # a listener that only listens is not idle
                    # A take still waiting for text that never came ends first, with reason "timeout".
                    await self._perform(self.lifecycle.idle_timeout())
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
            if self.ws.closed:
                self._link = Link.GONE
            self._close_lifecycle()

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
            if isinstance(msg, StartTake | Seek) and self.state.shutting_down:
                raise ProtocolError(ErrorCode.BUSY, "the service is shutting down; reconnect shortly")
            if isinstance(msg, Resume):
                await self._resume(msg)
                return
            if isinstance(msg, Discard):
                self._discard(msg.take)
                return
            if (isinstance(msg, StartTake) and msg.words) or (isinstance(msg, Seek) and msg.words):
                require_aligner(self.state)
            if isinstance(msg, Seek) and msg.word is not None:
                await self._words_for_seek(msg)
            if isinstance(msg, Seek) and msg.take in self._edits:
                await self._edit_audio_for_seek(msg.take)
            if isinstance(msg, StartTake) or (isinstance(msg, Seek) and msg.mode == "retake"):
                await self._check_session_room()
            await self._perform(self.lifecycle.handle(msg))
        except ProtocolError as err:
            await self.send_error(err)
            if err.fatal:
                await self._close(CLOSE_POLICY, err.message.encode()[:120])

    # -- stored directing sessions (session_store.py, docs/protocol.md "resume") ----------

    async def _resume(self, msg: Resume) -> None:
        """Bind to a stored session (a new one without an id) and answer its takes."""
        store = self.state.sessions
        if store is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, "this service keeps no sessions", field="session")
        if self.session_id is not None and msg.session != self.session_id:
            raise ProtocolError(ErrorCode.INVALID_FIELD, "this connection is bound to another session", field="session")
        if self.owner is None:  # no identity to own a session (not reached past the auth checks)
            raise ProtocolError(ErrorCode.NOT_FOUND, "no such session (it may have been deleted)", field="session")
        resumed = msg.session is not None
        if msg.session is not None:
            # Another owner's session answers not_found, exactly as an unknown id does.
            await asyncio.to_thread(store.check_access, msg.session, self.owner)
            session_id = msg.session
            await asyncio.to_thread(store.touch, session_id)  # in use: retention counts from now
        else:
            session_id = await asyncio.to_thread(store.create, owner=self.owner, client=self.client)
        await self._wait_for_closing_keeps(session_id)  # a reload: the take its old socket cut off, stored first
        stored = await asyncio.to_thread(store.takes, session_id)  # not_found for an unknown id
        # The session's limit first: adopted into a history still bounded like a connection without a
        # session (max_takes_kept), the oldest stored takes would be dropped again at once (issue 23, finding 6).
        self.lifecycle.keep_takes(store.max_session_takes)
        codebook = self.state.engine.info.codebook_size
        held = {t.take_id for t in self.lifecycle.history.takes}
        for record in stored:
            if record.take_id in held or not record.has_codes:  # audio only: played and downloaded from the session
                continue
            try:
                codes = await asyncio.to_thread(store.codes, session_id, record.take_id)
                if codes.size and (int(codes.min()) < 0 or int(codes.max()) >= codebook):
                    raise ValueError(f"codes outside the codebook [0, {codebook})")
                # The take's one seed rides on its request (the record's; its stored request has it only when the
                # director gave it).
                request = dataclasses.replace(
                    StartTake.parse(record.request, self.state.settings.limits), seed=record.seed
                )
            except (OSError, ValueError, ProtocolError) as exc:  # damaged, or the limits tightened since
                log.warning("session %s: take %s cannot be resumed: %s", short_id(session_id), record.take_id, exc)
                continue
            take = TakeRecord(
                record.take_id, request, parent=record.parent, branch_frame=record.branch_frame,
                reason=record.reason, stats=dict(record.stats), seed_given="seed" in record.request,
            )  # fmt: skip
            take.append(0, codes)
            take.words = await self._stored_words(session_id, record.take_id)
            edit = record.kind != TakeKind.TAKE
            if edit:
                self._edits.add(record.take_id)
            # A retake of it rebuilds the model state from these codes.
            self.lifecycle.history.adopt(take, shared=not edit)
        self.session_id = session_id
        next_number = await asyncio.to_thread(store.next_number, session_id)
        await self.send_message(
            SessionResumed(
                session=session_id, resumed=resumed, max_takes=store.max_session_takes,
                takes=[t.public() for t in stored], next_number=next_number,
            )
        )

    async def _edit_audio_for_seek(self, take_id: str) -> None:
        """A splice or comp about to be replayed or retaken: its stored audio held as heard (unless it is), so the
        replay sends, and the retake keeps, exactly its samples. Unreadable: its codes are rendered instead."""
        store, session_id, heard = self.state.sessions, self.session_id, self.state.heard
        take = self.lifecycle.history.get(take_id)  # not_found: no such take here
        frame_bytes = bytes_per_frame(take)
        if store is None or session_id is None or heard.get(take_id, take.n_frames, frame_bytes) is not None:
            return
        try:
            pcm = await asyncio.to_thread(store.pcm, session_id, take_id)
        except (OSError, ProtocolError) as exc:
            log.warning("session %s: the audio of %s is unreadable (%s); its codes are rendered", short_id(session_id),
                        take_id, exc)  # fmt: skip
            return
        if len(pcm) == take.n_frames * frame_bytes:
            heard.begin(take_id, frame_bytes)
            heard.append(take_id, 0, pcm)

    async def _wait_for_closing_keeps(self, session_id: str) -> None:
        """A reload right after a disconnect: the old connection may still be storing the take it cut off."""
        keeps = set(self.state.closing_keeps.get(session_id, ()))
        if keeps:
            await asyncio.wait(keeps, timeout=RESUME_WAIT_SEC)

    async def _stored_words(self, session_id: str, take_id: str) -> list[WordTime] | None:
        store = self.state.sessions
        if store is None:
            return None
        try:
            records = await asyncio.to_thread(store.words, session_id, take_id)
            return None if records is None else [WordTime.from_record(r) for r in records]
        except (KeyError, TypeError, ValueError, ProtocolError):  # a damaged row: aligned again on demand
            log.warning("session %s: the stored words of take %s are unreadable", session_id, take_id)
            return None

    async def _check_session_room(self) -> None:
        """A bound session that cannot keep one more take refuses it before anything is generated."""
        if self.session_id is not None and self.state.sessions is not None:
            await asyncio.to_thread(self.state.sessions.check_room, self.session_id)

    def _discard(self, take: str) -> None:
        """The client never had the take (an id, or a start's label: it replaced it before hearing it, perhaps
        before it started): it is not kept when it ends (or when its words are done); one kept already stays. A
        discard that comes after its take ended is no error (the client sends it when it replaces the take, which may
        end on its own meanwhile, and an error there reads to a client as the refusal of its next request): a take
        that ended is kept only if the discard came after it was."""
        takes = self.lifecycle.history.takes
        named = {t.take_id for t in takes if take in (t.take_id, t.label)}
        if not named:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no take {take!r} in this session", field="take")
        # Bounded by the history: a take that ended without being kept (no frames) never comes to _keep.
        self._unkept = (self._unkept | named) & {t.take_id for t in takes}

    async def _keep(self, take: TakeRecord) -> None:
        """Store an ended take in the bound session: its record, codes and the audio as it was streamed; the client
        is told its number (``stored``), or why it was not kept."""
        if take.take_id in self._unkept:
            self._unkept.discard(take.take_id)
            return
        kept = await self._store_take(take)
        if isinstance(kept, ProtocolError):
            await self.send_error(kept, take=take.take_id)
        elif kept is not None:
            await self.send_message(TakeStored(take=take.take_id, number=kept.number, session=self.session_id or UNSET))

    async def _store_take(self, take: TakeRecord) -> StoredTake | ProtocolError | None:
        """Store ``take`` in the bound session: its record as stored, or the error to tell the client."""
        store, session_id = self.state.sessions, self.session_id
        if store is None or session_id is None:
            return None
        record = StoredTake(
            take_id=take.take_id, request=take.request_as_asked(), seed=take.seed, n_frames=take.n_frames,
            channels=take.request.channels, parent=take.parent, branch_frame=take.branch_frame, reason=take.reason,
            stats={k: v for k, v in take.stats.items() if isinstance(v, int | float)},
        )  # fmt: skip
        try:
            # The PCM as streamed, exactly the take's frames so far (held, else rendered from the codes).
            async with held_take_audio(self.state, take, client=self.client) as pcm:
                record = await asyncio.to_thread(store.put_take, session_id, record, take.codes, pcm)
            if take.words is not None and self.state.aligner is not None:
                words = [w.to_record() for w in take.words]
                await asyncio.to_thread(store.put_words, session_id, take.take_id, words, self.state.aligner.name)
        except ProtocolError as err:  # the session is full, out of storage, or was deleted meanwhile
            return err
        except (OSError, ValueError, EngineBusy):
            log.exception("could not keep take %s in session %s", take.take_id, short_id(session_id))
            return ProtocolError(ErrorCode.INTERNAL, "the take could not be stored")
        return record

    def _keep_cut_off_takes(self) -> asyncio.Task[None] | None:
        """Start storing the takes the client's leaving cut off (a reload, a network drop), as heard so far.

        The store runs as a task of its own, registered in the service state at once: aiohttp cancels the
        handler of a client that left (and whatever it awaits), and the take must be stored anyway; a resume of
        the session (the reload) waits for the task, and so does shutdown.
        """
        takes, self._keeps_on_close = self._keeps_on_close, []
        session_id = self.session_id
        if not takes or session_id is None:
            return None
        task = asyncio.create_task(self._store_cut_off(takes), name=f"keep-cut-off-{short_id(session_id)}")
        keeps = self.state.closing_keeps
        keeps.setdefault(session_id, set()).add(task)

        def forget(done: asyncio.Task[None]) -> None:
            waiting = keeps.get(session_id)
            if waiting is not None:
                waiting.discard(done)
                if not waiting:
                    del keeps[session_id]

        task.add_done_callback(forget)
        return task

    async def _store_cut_off(self, takes: list[TakeRecord]) -> None:
        for take in takes:
            kept = await self._store_take(take)
            if isinstance(kept, ProtocolError):  # nobody left to tell
                log.warning("take %s cut off by a disconnect was not kept: %s", take.take_id, kept.message)

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
            with contextlib.suppress(ConnectionResetError, RuntimeError):
                await self.send_error(ProtocolError(ErrorCode.RATE_LIMITED, "message flood; closing", fatal=True))
            await self._close(CLOSE_POLICY, b"rate limit exceeded")

    async def shutdown(self, grace_sec: float) -> None:
        """End the running take with reason ``shutdown`` (its end frame goes out), then close 1001."""
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await self._perform(self.lifecycle.shutdown())
        # Streams and replays send their ends; takes still being admitted were ended by the lifecycle already.
        running = {io.task for io in self._runs.values() if io.task is not None and io.stage is not RunStage.ADMITTING}
        if running:
            await asyncio.wait(running, timeout=grace_sec)
        await self._close(CLOSE_SHUTDOWN, b"server shutdown")

    async def close(self) -> None:
        """Release everything the connection holds; bounded, never leaves a task behind."""
        self._link = Link.GONE
        self._close_lifecycle()
        keeping = self._keep_cut_off_takes()  # registered before anything is awaited: a resume waits for it
        pending = {io.task for io in self._runs.values() if io.task is not None and not io.task.done()}
        for task in pending:
            # Cancelling a run also closes its event iterator, which cancels its engine take; an
            # engine's submit is cancel-safe (a cancelled submit admits nothing).
            task.cancel()
        for words in list(self._words.values()):
            await words.close()
        self._words.clear()
        if keeping is not None:
            await asyncio.shield(keeping)
        if pending:
            _, late = await asyncio.wait(pending, timeout=RUNS_TIMEOUT_SEC)
            if late:
                log.warning("%d run(s) of %s did not end within %.0f s", len(late), self.client, RUNS_TIMEOUT_SEC)
        self._outs.close()


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
        # Who the connection acts as for stored sessions; a keyless client without an owner cookie gets one
        # with the upgrade (a browser that loaded the studio page has it already).
        owner, cookie = owner_or_mint(request)
        set_owner_cookie(ws, request, cookie)
        await ws.prepare(request)
        connection = Connection(state, ws, request)
        connection.owner = owner
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
