"""The directing session, sans-I/O: takes, their history, and seek/replay bookkeeping.

A session turns client intents (start, seek) into plans for the transport to carry out, and
records what the engine produced (codes per frame) so any take can be replayed, branched from,
or downloaded. It touches no socket and no tensor; codes are small numpy arrays.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moss_rt.align.base import WordTime, kept_words
from moss_rt.engine.base import AudioChunk, TakeEvent, TakeFinished, TakeFirstAudio, TakeSpec
from moss_rt.generation import FRAME_RATE, FRAME_SAMPLES, N_CODEBOOKS, EndReason, frame_at_time
from moss_rt.heard_audio import HeardAudio
from moss_rt.protocol import (
    DEFAULT_LIMITS,
    DEFAULT_MODEL_ALIAS,
    UNSET,
    AppendText,
    Cancel,
    EndOfText,
    ErrorCode,
    ErrorMessage,
    FlushText,
    Ping,
    Pong,
    ProtocolError,
    Seek,
    SeekAck,
    ServerMessage,
    StartTake,
    TakeEnded,
    TakeStarted,
    Unset,
    seek_ack,
)
from moss_rt.text_feed import TextFeed


def new_take_id() -> str:
    # Unguessable: a take id doubles as the capability to download it.
    return "t_" + secrets.token_urlsafe(9)


def random_seed() -> int:
    return secrets.randbelow(2**31)


class TakeStatus(enum.StrEnum):
    RUNNING = "running"  # being admitted, streamed or stopped: its codes may still grow
    ENDED = "ended"


@dataclass
class TakeRecord:
    """One take: its direction, seed, lineage and the codes generated so far."""

    take_id: str
    request: StartTake  # as resolved: its ``seed`` is set, the take's one seed
    parent: str | None = None
    branch_frame: int = 0  # frames [0, branch_frame) come from the parent
    label: str | None = None
    status: TakeStatus = TakeStatus.RUNNING
    reason: str | None = None
    stats: dict[str, float] = field(default_factory=dict)
    # Whether the director gave the seed (False: the server picked it). Stored takes keep their request as asked,
    # without a picked seed, so a studio can tell a fixed seed from a random one after a reload.
    seed_given: bool = True
    # When each word of its text is said (moss_rt.align), once aligned: streamed with the take (``words``), or on
    # demand for downloads and ``seek`` by word. None: not aligned (yet).
    words: list[WordTime] | None = None
    _chunks: list[np.ndarray] = field(default_factory=list)
    _n_frames: int = 0

    @property
    def seed(self) -> int:
        assert self.request.seed is not None, "a take's request carries its resolved seed"
        return self.request.seed

    @property
    def n_frames(self) -> int:
        return self._n_frames

    @property
    def codes(self) -> np.ndarray:
        """All frames so far, [n_frames, 12] int64."""
        if not self._chunks:
            return np.zeros((0, N_CODEBOOKS), dtype=np.int64)
        if len(self._chunks) > 1:
            self._chunks = [np.concatenate(self._chunks, axis=0)]
        return self._chunks[0]

    def append(self, first_frame: int, codes: np.ndarray) -> None:
        if first_frame != self._n_frames:
            raise ValueError(f"take {self.take_id}: chunk at frame {first_frame}, expected {self._n_frames}")
        self._chunks.append(np.asarray(codes, dtype=np.int64).reshape(-1, N_CODEBOOKS))
        self._n_frames += int(codes.shape[0])

    def engine_spec(
        self, *, reference_codes: np.ndarray | None = None, prefix_codes: np.ndarray | None = None
    ) -> TakeSpec:
        """The engine's request for this take: the wire request resolved (one seed, reference codes)."""
        r = self.request
        return TakeSpec(
            take_id=self.take_id,
            text=r.text,
            instruction=r.instruction,
            language=r.language,
            seed=self.seed,
            sampling=r.sampling,
            max_frames=r.max_new_tokens,
            chunk_frames=r.chunk_frames,
            channels=r.channels,
            tokens=r.tokens,
            reference_codes=reference_codes,
            prefix_codes=prefix_codes if prefix_codes is not None and len(prefix_codes) else None,
            parent_take=self.parent,
        )

    def request_as_asked(self) -> dict[str, Any]:
        """The request as the director sent it: its ``seed`` only when one was given (the take's one seed is
        :attr:`seed`). What a stored take keeps."""
        asked = self.request.to_dict()
        if not self.seed_given:
            asked.pop("seed", None)
        return asked

    def summary(self) -> dict[str, object]:
        return {
            "take": self.take_id,
            "label": self.label,
            "parent": self.parent,
            "branch_frame": self.branch_frame,
            "seed": self.seed,
            "status": self.status,
            "reason": self.reason,
            "n_frames": self.n_frames,
            "request": self.request.to_dict(),
            **self.stats,
        }


class TakeStore:
    """App-wide, bounded store of recent takes (by id), shared by every connection.

    Past ``max_takes`` a take is evicted from the client that holds the most (its oldest that is not running;
    a running take is never evicted), and never from a client holding fewer takes than the one adding. So a
    client that adds takes in bulk (many resumed sessions, a burst of requests) pushes out its own, never the
    takes of a client that holds fewer: eviction is per client, and a victim's download cannot be made to
    vanish by somebody else's traffic. (When only running takes are left to evict, the store stays over its
    cap by them until they end.)
    """

    def __init__(self, max_takes: int = 1024) -> None:
        self._takes: OrderedDict[str, TakeRecord] = OrderedDict()
        self._max = max_takes
        self._client_of: dict[str, str] = {}  # take id -> the client that added it ("" when unknown)
        self._counts: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._takes)

    def held_by(self, client: str) -> int:
        return self._counts.get(client, 0)

    def add(self, take: TakeRecord, client: str | None = None) -> None:
        self._forget_owner(take.take_id)
        self._takes[take.take_id] = take
        owner = client or ""
        self._client_of[take.take_id] = owner
        self._counts[owner] += 1
        self._evict(owner)

    def get(self, take_id: str) -> TakeRecord | None:
        return self._takes.get(take_id)

    def discard(self, take_id: str) -> None:
        take = self._takes.get(take_id)
        if take is not None and take.status is not TakeStatus.RUNNING:
            self._drop(take_id)

    def _drop(self, take_id: str) -> None:
        del self._takes[take_id]
        self._forget_owner(take_id)

    def _forget_owner(self, take_id: str) -> None:
        owner = self._client_of.pop(take_id, None)
        if owner is not None:
            self._counts[owner] -= 1
            if self._counts[owner] <= 0:
                del self._counts[owner]

    def _evict(self, adder: str) -> None:
        while len(self._takes) > self._max:
            floor = self._counts.get(adder, 0)
            for owner, held in self._counts.most_common():
                if held < floor:
                    return  # everyone left holds fewer takes than the adder: not theirs to give up
                victim = next(
                    (
                        take_id
                        for take_id, take in self._takes.items()
                        if self._client_of.get(take_id) == owner and take.status is not TakeStatus.RUNNING
                    ),
                    None,
                )
                if victim is not None:
                    self._drop(victim)
                    break
            else:
                return  # only running takes are left over the cap


@dataclass(frozen=True)
class StartPlan:
    take: TakeRecord


@dataclass(frozen=True)
class SeekPlan:
    mode: str  # retake | replay
    source: TakeRecord
    frame: int
    take: TakeRecord  # the new take (retake) or the source itself (replay)

    @property
    def sample(self) -> int:
        return self.frame * FRAME_SAMPLES

    @property
    def prefix_codes(self) -> np.ndarray:
        return self.source.codes[: self.frame]

    def ack(self) -> SeekAck:
        return seek_ack(take=self.take.take_id, from_take=self.source.take_id, frame=self.frame)


class TakeHistory:
    """One client's takes: a bounded history (by id), what is running, plans for starts and seeks.

    Bookkeeping only; :class:`DirectingSession` decides when takes start and stop.
    """

    def __init__(
        self,
        store: TakeStore,
        *,
        max_takes: int = 32,
        id_factory: Callable[[], str] = new_take_id,
        seed_factory: Callable[[], int] = random_seed,
        client: str | None = None,
    ) -> None:
        self._store = store
        self._client = client  # whose takes these are, for the store's per-client eviction
        self._max_takes = max_takes
        self._new_id = id_factory
        self._new_seed = seed_factory
        self._history: OrderedDict[str, TakeRecord] = OrderedDict()
        self.running: TakeRecord | None = None

    @property
    def takes(self) -> list[TakeRecord]:
        return list(self._history.values())

    def get(self, take_id: str) -> TakeRecord:
        take = self._history.get(take_id)
        if take is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no take {take_id!r} in this session", field="take")
        return take

    def plan_start(self, request: StartTake) -> StartPlan:
        seed = request.seed if request.seed is not None else self._new_seed()
        take = TakeRecord(
            self._new_id(), dataclasses.replace(request, seed=seed), label=request.take,
            seed_given=request.seed is not None,
        )  # fmt: skip
        self._remember(take)
        self.running = take
        return StartPlan(take)

    def plan_seek(self, msg: Seek) -> SeekPlan:
        source = self.get(msg.take)
        if msg.word is not None:
            msg = dataclasses.replace(msg, frame=word_frame(source, msg.word), word=None)
        if msg.frame > source.n_frames:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"frame {msg.frame} is past the {source.n_frames} frames take {source.take_id} has",
                field="frame",
            )
        if msg.mode == "replay":
            if source.status is TakeStatus.RUNNING:
                raise ProtocolError(ErrorCode.INVALID_FIELD, "cannot replay a take while it is running", field="take")
            self.running = None
            return SeekPlan("replay", source, msg.frame, source)
        parent = source.request
        request = dataclasses.replace(
            parent,
            text=parent.text if msg.text is None else msg.text,
            instruction=parent.instruction if msg.instruction is None else msg.instruction,
            sampling=parent.sampling.replace(**msg.sampling),
            seed=msg.seed if msg.seed is not None else self._new_seed(),
            words=parent.words if msg.words is None else msg.words,
        )
        take = TakeRecord(
            self._new_id(), request, parent=source.take_id, branch_frame=msg.frame, label=source.label,
            seed_given=msg.seed is not None,
        )  # fmt: skip
        if msg.frame:
            take.append(0, source.codes[: msg.frame])
        if source.words is not None and request.words:
            # The kept frames keep their words: those that end before the branch point (and are still the text's).
            take.words = kept_words(source.words, request.text, msg.frame / FRAME_RATE)
        self._remember(take)
        self.running = take
        return SeekPlan("retake", source, msg.frame, take)

    def keep_until_deleted(self, max_takes: int) -> None:
        """Bound to a stored session: takes stay until the director deletes them (the store's quota applies)."""
        self._max_takes = max(self._max_takes, max_takes)

    def adopt(self, take: TakeRecord) -> None:
        """An ended take of this session from an earlier connection (or before a restart), rebuilt from its stored
        codes: replayable and retakeable like one made here (a retake rebuilds the cache from the codes)."""
        take.status = TakeStatus.ENDED
        self._remember(take)

    def record_chunk(self, take: TakeRecord, first_frame: int, codes: np.ndarray) -> None:
        take.append(first_frame, codes)

    def record_end(self, take: TakeRecord, reason: str, stats: dict[str, float]) -> None:
        take.status = TakeStatus.ENDED
        take.reason = reason
        take.stats.update(stats)
        if self.running is take:
            self.running = None

    def _remember(self, take: TakeRecord) -> None:
        self._history[take.take_id] = take
        self._store.add(take, self._client)
        while len(self._history) > self._max_takes:
            for take_id, old in self._history.items():
                if old.status is not TakeStatus.RUNNING:
                    del self._history[take_id]
                    self._store.discard(take_id)
                    break
            else:
                break

    def close(self) -> None:
        """The connection is gone: its takes stay downloadable until the store evicts them."""
        self.running = None


# --------------------------------------------------------------------------- the take lifecycle


class Phase(enum.Enum):
    """What the session's one current take is doing (at most one per session, by construction)."""

    IDLE = "idle"  # nothing
    ADMITTING = "admitting"  # reference voice being encoded, engine admission under way
    STREAMING = "streaming"  # the engine generates it; its frames go out as they come
    REPLAYING = "replaying"  # stored audio of an earlier take goes out again
    WAITING = "waiting"  # a take fed with text (stream_text): nothing to say until more text is ready
    STOPPING = "stopping"  # asked to stop; its end (and then any pending start) follows


# Actions: what the transport must do. Each names its ``run``, the session's serial number of one
# admission / stream / replay, which is how the transport reports back (and how stale reports of a
# run the session has already let go of are recognised and ignored).


@dataclass(frozen=True)
class SendMessage:
    message: ServerMessage


@dataclass(frozen=True)
class SendAudio:
    """PCM of the current take. ``paced``: hold the client to real time (not while stopping)."""

    run: int
    pcm: bytes
    seconds: float
    paced: bool = True


@dataclass(frozen=True)
class Admit:
    """Resolve the reference voice, submit ``spec(reference_codes)`` to the engine, then report
    :meth:`DirectingSession.admitted` (or :meth:`DirectingSession.admission_failed`)."""

    run: int
    take: TakeRecord
    prefix_codes: np.ndarray | None = None
    # A continuation of a take fed with text: its own engine take id, the previous one as parent
    # (the engine may keep that one's cache), and the frames left of the take's budget.
    engine_take_id: str | None = None
    parent_take: str | None = None
    max_frames: int | None = None
    # It interrupted the take this socket was streaming (barge-in): the engine admits it with retakes.
    barge_in: bool = False

    def spec(self, reference_codes: np.ndarray | None) -> TakeSpec:
        spec = self.take.engine_spec(reference_codes=reference_codes, prefix_codes=self.prefix_codes)
        if self.barge_in:
            spec = dataclasses.replace(spec, barge_in=True)
        if self.engine_take_id is None:
            return spec
        return dataclasses.replace(
            spec,
            take_id=self.engine_take_id,
            parent_take=self.parent_take,
            max_frames=spec.max_frames if self.max_frames is None else self.max_frames,
        )


@dataclass(frozen=True)
class Replay:
    """Fetch the take's audio (as heard, else rendered) and report :meth:`DirectingSession.replay_audio`."""

    run: int
    take: TakeRecord
    frame: int


@dataclass(frozen=True)
class Stop:
    """Stop run ``run``: cancel its engine take with ``reason`` (a replay: stop sending at once)."""

    run: int
    reason: EndReason


@dataclass(frozen=True)
class Keep:
    """Store the ended ``take`` in the directing session the connection is bound to (``resume``), before its
    ``end`` goes out: a client that has seen the end and reloads at once finds the take."""

    take: TakeRecord


@dataclass(frozen=True)
class FinishAudio:
    """The take's audio is complete: a take delivered in a format (tag 2) flushes the rest of its
    file now, before its ``end``; nothing for native PCM. ``replay``: the file of a replay run."""

    run: int
    take: TakeRecord
    replay: bool = False


@dataclass(frozen=True)
class FinishWords:
    """A take that asked for ``words`` is over: align what is left of it and send its last ``words`` message
    (``final``) now, before its record is kept and its ``end`` goes out. ``complete``: it ended ``done``, so its
    whole text is in its audio; otherwise only the words its audio reached are kept."""

    run: int
    take: TakeRecord
    complete: bool


@dataclass(frozen=True)
class WordsCheckpoint:
    """A take fed with text that asked for ``words``: a continuation ended, so the text handed out so far is all in
    its audio so far (the word aligner may settle it). Nothing to wait for."""

    run: int
    take: TakeRecord
    text: str  # the take's text as handed out so far (the take's record moves on with the next continuation)


Action = SendMessage | SendAudio | Admit | Replay | Stop | FinishAudio | Keep | FinishWords | WordsCheckpoint


@dataclass
class _Run:
    """The session's current take, as one admission → stream, or one replay."""

    run: int
    take: TakeRecord
    model: str
    t_request: float
    replay_frame: int | None = None  # a replay from this frame
    # A seek's answer: a replay's is sent when the run begins; a retake's once the engine admitted it
    # (only then is it known whether its parent's cache was reused or rebuilt elsewhere, ``rebuilt``).
    ack: SeekAck | None = None
    acked: bool = False  # the ack went out
    prefix_codes: np.ndarray | None = None
    started: bool = False  # its ``start`` message went out
    gpu_first_ms: float | None = None
    ttfa_ms: float | None = None
    stop_reason: EndReason | None = None
    # A take fed with text (``stream_text``): its text, and the continuations that speak it.
    feed: TextFeed | None = None
    continuations: int = 0
    text_waits: int = 0  # times it had nothing to say once speaking had begun
    gpu_total_ms: float = 0.0  # of the continuations that finished
    barge_in: bool = False  # it replaced a take that was streaming (the director cut in): admitted ahead of new takes


ClientIntent = StartTake | Seek | Cancel | Ping | AppendText | FlushText | EndOfText
TextIntent = AppendText | FlushText | EndOfText


class DirectingSession:
    """One client's take lifecycle as a state machine, sans-I/O (like the ``websockets`` protocol object).

    The transport feeds it client messages (:meth:`handle`) and what happened to the runs it was
    asked to carry out (:meth:`admitted`, :meth:`take_event`, :meth:`replay_audio`, …); every call
    returns the actions to perform, in order. The rules it keeps by construction:

    - at most one current take; a start or seek while one runs replaces it (barge-in), and the
      replaced take's ``end`` goes out before anything of the new one;
    - every take that was started gets exactly one ``end`` (or one take-level ``error``);
    - reports about a run the session has let go of (replaced while still being admitted, a replay
      stopped) are ignored, and an engine take admitted too late is stopped at once;
    - a run's audio goes out only while it is the current run (:meth:`is_current`): the transport
      checks that right before each frame, since it sends a replay's chunks long after
      :meth:`replay_audio` answered them, and a replay let go of (cancel, barge-in) has its ``end``
      sent at once. A streaming take told to stop stays current until its end (its last frames go
      out first).
    """

    def __init__(
        self,
        store: TakeStore,
        *,
        models: tuple[str, ...] = (DEFAULT_MODEL_ALIAS,),
        default_model: str = DEFAULT_MODEL_ALIAS,
        heard: HeardAudio | None = None,
        max_takes: int = 32,
        max_text_chars: int = DEFAULT_LIMITS.max_text_chars,
        id_factory: Callable[[], str] = new_take_id,
        seed_factory: Callable[[], int] = random_seed,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        client: str | None = None,
    ) -> None:
        self.history = TakeHistory(
            store, max_takes=max_takes, id_factory=id_factory, seed_factory=seed_factory, client=client
        )
        self._models = models
        self._default_model = default_model
        self._heard = heard if heard is not None else HeardAudio(0)
        self._max_text_chars = max_text_chars
        self._clock = clock
        self._wall_clock = wall_clock
        self._phase = Phase.IDLE
        self._current: _Run | None = None
        self._pending: _Run | None = None  # begins once the stopping take has ended
        self._queued: list[Action] = []  # ends of pending runs replaced while stopping, sent after its end
        self._runs = 0
        self._refusing: str | None = None  # why new takes are refused (shutdown, closed)
        self._keeping = False  # bound to a stored session: every ended take is kept (a Keep action)

    def keep_takes(self, max_takes: int) -> None:
        """The connection is bound to a stored directing session: ended takes are kept (a :class:`Keep` before
        their ``end``) and stay in the history until deleted, up to the session's ``max_takes``."""
        self._keeping = True
        self.history.keep_until_deleted(max_takes)

    # -- state ----------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def current_take(self) -> TakeRecord | None:
        return None if self._current is None else self._current.take

    @property
    def busy(self) -> bool:
        """A take is being admitted, streamed, replayed or stopped (the socket is not idle).

        A take waiting for text (``stream_text``) is not: it sends nothing until the client sends text, so
        a client that sends nothing for the idle timeout is idle (issue 23, finding 11)."""
        return self._phase not in (Phase.IDLE, Phase.WAITING)

    def idle_timeout(self) -> list[Action]:
        """The socket had no message for the idle timeout while not :attr:`busy`: a take waiting for text
        ends with reason ``timeout`` (its file ended, kept like any take), before the socket closes."""
        if self._phase is not Phase.WAITING:
            return []
        return self._stop_current(EndReason.TIMEOUT)

    def is_current(self, run: int) -> bool:
        """Run ``run`` is the session's current one: its audio may still go out (its end has not)."""
        return self._current is not None and self._current.run == run

    # -- client messages --------------------------------------------------------------------

    def handle(self, msg: ClientIntent, *, received_at: float | None = None) -> list[Action]:
        """One validated client message → actions. Raises ProtocolError for a request that cannot be
        carried out (unknown take or model, bad frame, refused); the current take is then untouched.
        ``received_at`` (this session's clock) is when the request arrived, for ``ttfa_ms``."""
        if isinstance(msg, Ping):
            return [SendMessage(Pong(t=msg.t, server_t=self._wall_clock()))]
        if isinstance(msg, Cancel):
            return self._cancel(msg.take)
        if isinstance(msg, AppendText | FlushText | EndOfText):
            return self._feed_text(msg)
        if self._refusing is not None:
            raise ProtocolError(ErrorCode.BUSY, self._refusing)
        if isinstance(msg, StartTake):
            model = self.resolve_model(msg.model)
            t_request = self._clock() if received_at is None else received_at
            take = self.history.plan_start(msg).take
            run = _Run(self._next_run(), take, model, t_request)
            if msg.stream_text:
                run.feed = TextFeed(self._max_text_chars, msg.text)
            return self._replace(run)
        t_request = self._clock() if received_at is None else received_at
        plan = self.history.plan_seek(msg)
        model = self.resolve_model(plan.take.request.model)
        if plan.mode == "replay":
            run = _Run(self._next_run(), plan.source, model, t_request, replay_frame=plan.frame, ack=plan.ack())
        else:
            run = _Run(self._next_run(), plan.take, model, t_request, ack=plan.ack(), prefix_codes=plan.prefix_codes)
        return self._replace(run)

    def resolve_model(self, requested: str) -> str:
        return resolve_model(requested, self._models, self._default_model)

    def _next_run(self) -> int:
        self._runs += 1
        return self._runs

    def _replace(self, new: _Run) -> list[Action]:
        """Barge-in: the current take (if any) makes way for ``new``."""
        cur = self._current
        if self._phase is Phase.IDLE:
            return self._begin(new)
        assert cur is not None
        if self._phase is Phase.STOPPING:
            # Still waiting for the stopping take's end: the newest request wins; one replaced
            # while waiting ends right after that end, before the newest begins.
            if self._pending is not None:
                self._queued += self._retire(self._pending, EndReason.REPLACED)
            new.barge_in = True
            self._pending = new
            return []
        if self._phase is Phase.STREAMING:
            new.barge_in = True
            cur.stop_reason = EndReason.REPLACED
            self._phase = Phase.STOPPING
            self._pending = new
            return [Stop(cur.run, EndReason.REPLACED)]
        # ADMITTING or REPLAYING: nothing of it is in flight on the wire, so it ends here and now.
        actions = self._let_go(cur, EndReason.REPLACED)
        return actions + self._begin(new)

    def _cancel(self, target: str | None) -> list[Action]:
        cur = self._current
        if cur is None:
            return []
        if self._phase is Phase.STOPPING:
            pending = self._pending
            if pending is not None and (target is None or target in (pending.take.take_id, pending.take.label)):
                self._pending = None
                self._queued += self._retire(pending, EndReason.CANCELLED)
            return []
        named = target is None or target in (cur.take.take_id, cur.take.label)
        if not named and self._phase is not Phase.REPLAYING:  # a replay stops on any cancel (as it always did)
            return []  # a cancel for a take that is no longer current
        return self._stop_current(EndReason.CANCELLED)

    def _stop_current(self, reason: EndReason) -> list[Action]:
        cur = self._current
        assert cur is not None
        if self._phase is Phase.STREAMING:
            cur.stop_reason = reason
            self._phase = Phase.STOPPING
            return [Stop(cur.run, reason)]
        actions = self._let_go(cur, reason)
        self._current, self._phase = None, Phase.IDLE
        return actions

    def _let_go(self, cur: _Run, reason: EndReason) -> list[Action]:
        """End a take still being admitted, or a replay, at once (their run's later reports are stale)."""
        if cur.replay_frame is not None:
            if not cur.started:  # its audio never began: like a take that never streamed, start then end
                return [Stop(cur.run, reason), *self._retire(cur, reason)]
            finish = FinishAudio(cur.run, cur.take, replay=True)  # a replay in a format: its file, cut here
            return [Stop(cur.run, reason), finish, SendMessage(self._replay_end(cur, reason))]
        # Admission may still finish: the transport then hears that the run is stale and stops it.
        return self._retire(cur, reason)

    def _ack(self, run: _Run, *, rebuilt: bool = False) -> list[Action]:
        """The answer to the run's seek, once (a retake's says whether its cache was rebuilt)."""
        if run.ack is None or run.acked:
            return []
        run.acked = True
        ack = run.ack if run.replay_frame is not None else dataclasses.replace(run.ack, rebuilt=rebuilt)
        return [SendMessage(ack)]

    def _retire(self, run: _Run, reason: EndReason) -> list[Action]:
        """A take that never streamed ends: ``start`` then ``end`` with ``reason`` (a replay: its end),
        after the answer to its seek if that did not go out yet."""
        actions = self._ack(run)
        if run.replay_frame is not None:
            start = SendMessage(self._started(run, None, first_frame=run.replay_frame, replay=True))
            return [*actions, start, SendMessage(self._replay_end(run, reason))]
        take = run.take
        text_stats = self._text_stats(run)
        self.history.record_end(take, reason.value, dict(text_stats))
        if not run.started:
            actions.append(SendMessage(self._started(run, None)))
        if take.request.words:
            actions.append(FinishWords(run.run, take, complete=False))
        if run.started:  # a take fed with text, between two continuations: its audio file ends here
            if self._keeping and take.n_frames > 0:
                actions.append(Keep(take))  # what it spoke is a take like any other (its words first)
            actions.append(FinishAudio(run.run, take))
        actions.append(
            SendMessage(
                TakeEnded(
                    take=take.take_id,
                    reason=reason.value,
                    n_frames=take.n_frames,
                    new_frames=take.n_frames - take.branch_frame,
                    duration_sec=round(take.n_frames / FRAME_RATE, 3),
                    gpu_total_ms=round(run.gpu_total_ms, 2),
                    extra=text_stats,
                )
            )
        )
        return actions

    @staticmethod
    def _text_stats(run: _Run) -> dict[str, int]:
        """What a take fed with text reports in its ``end``: continuations, and waits for text."""
        return {} if run.feed is None else {"continuations": run.continuations, "text_waits": run.text_waits}

    def _begin(self, run: _Run) -> list[Action]:
        self._current = run
        if run.replay_frame is not None:
            self._phase = Phase.REPLAYING
            return [*self._ack(run), Replay(run.run, run.take, run.replay_frame)]
        if run.feed is not None:
            return [*self._ack(run), *self._next_continuation(run)]
        self._phase = Phase.ADMITTING
        # A retake is acknowledged once admitted.
        return [Admit(run.run, run.take, run.prefix_codes, barge_in=run.barge_in)]

    def _finish_current(self) -> list[Action]:
        """The current take is over: flush the ends queued behind it, then begin what was pending."""
        actions, self._queued = self._queued, []
        pending, self._pending = self._pending, None
        self._current, self._phase = None, Phase.IDLE
        if pending is not None and self._refusing is None:
            actions += self._begin(pending)
        elif pending is not None:
            actions += self._retire(pending, EndReason.SHUTDOWN)
        return actions

    # -- takes fed with text (stream_text) -------------------------------------------------
    # Such a take is spoken by a chain of engine takes ("continuations"), one at a time: each gets the
    # whole text handed out so far and every frame of the take so far as its prefix (the model's
    # continuation mode), so it picks up where the audio stopped. The next one is admitted as soon as
    # the previous one is done and text is ready; with none ready the take WAITS (nothing in flight).

    def _feed_text(self, msg: TextIntent) -> list[Action]:
        # A take started right behind a stopping one is pending: its text is kept for when it begins.
        run = self._pending if self._phase is Phase.STOPPING else self._current
        named = run is not None and (msg.take is None or msg.take in (run.take.take_id, run.take.label))
        if run is None or run.feed is None or not named:
            raise ProtocolError(
                ErrorCode.NOT_FOUND,
                "no running take is waiting for text (open one with start and stream_text: true)",
                field="take",
            )
        if isinstance(msg, AppendText):
            run.feed.append(msg.text)
        elif isinstance(msg, FlushText):
            run.feed.flush()
        else:
            run.feed.end()
        if run is self._current and self._phase is Phase.WAITING:
            return self._next_continuation(run)
        return []

    def _next_continuation(self, cur: _Run) -> list[Action]:
        """The take has nothing generating: admit its next continuation, wait for text, or end it."""
        feed, take = cur.feed, cur.take
        assert feed is not None
        budget = take.request.max_new_tokens - (take.n_frames - take.branch_frame)
        if feed.has_ready:
            if budget <= 0:
                return self._end_fed(cur, EndReason.MAX_FRAMES)
            feed.take_ready()
            # The record carries the text spoken so far: summaries, downloads and retakes see it.
            take.request = dataclasses.replace(take.request, text=feed.spoken)
            parent = continuation_id(take.take_id, cur.continuations - 1) if cur.continuations else take.parent
            engine_id = continuation_id(take.take_id, cur.continuations)
            cur.continuations += 1
            cur.run = self._next_run()
            self._phase = Phase.ADMITTING
            prefix = take.codes if take.n_frames else None
            return [Admit(cur.run, take, prefix, engine_take_id=engine_id, parent_take=parent, max_frames=budget,
                          barge_in=cur.barge_in and cur.continuations == 1)]
        if feed.finished:
            return self._end_fed(cur, EndReason.DONE)
        if cur.continuations:
            cur.text_waits += 1
        self._phase = Phase.WAITING
        return []

    def _continuation_finished(self, cur: _Run, event: TakeFinished) -> list[Action]:
        cur.gpu_total_ms += event.gpu_total_ms
        if event.reason is EndReason.DONE and self._phase is Phase.STREAMING:
            checkpoint: list[Action] = []
            if cur.take.request.words:  # the text handed out so far has all been said
                checkpoint.append(WordsCheckpoint(cur.run, cur.take, cur.take.request.text))
            return checkpoint + self._next_continuation(cur)
        reason = event.reason
        if reason is EndReason.DONE and cur.stop_reason is not None:
            reason = cur.stop_reason  # it was asked to stop: the rest of its text is not spoken
        error = None
        if reason is EndReason.ERROR:
            error = ProtocolError(ErrorCode.INTERNAL, event.error or "generation failed")
        return self._end_fed(cur, reason, error)

    def _end_fed(self, cur: _Run, reason: EndReason, error: ProtocolError | None = None) -> list[Action]:
        """A take fed with text ends: the rest of its file, any error, its one ``end``; then what is pending."""
        take = cur.take
        actions: list[Action] = []
        if not cur.started:
            cur.started = True
            actions.append(SendMessage(self._started(cur, cur.gpu_first_ms)))
        text_stats = self._text_stats(cur)
        actions += self._close(cur, reason, n_frames=take.n_frames, gpu_total_ms=cur.gpu_total_ms,
                               gpu_first_ms=cur.gpu_first_ms, extra=text_stats, recorded=text_stats, error=error)
        return actions + self._finish_current()

    def _close(
        self, cur: _Run, reason: EndReason, *, n_frames: int, gpu_total_ms: float, gpu_first_ms: float | None,
        extra: Mapping[str, float], recorded: Mapping[str, float], error: ProtocolError | None = None,
    ) -> list[Action]:
        """A take that streamed ends: its record (stored first when the session keeps takes), the end of
        its audio file, any error, then its one ``end`` with the timing figures."""
        take = cur.take
        new_frames = n_frames - take.branch_frame
        wall_ms = (self._clock() - cur.t_request) * 1000.0
        gpu_first = None if gpu_first_ms is None else round(gpu_first_ms, 2)
        ttfa_ms = None if cur.ttfa_ms is None else round(cur.ttfa_ms, 2)
        rtf = round(new_frames / FRAME_RATE / (wall_ms / 1000.0), 3) if wall_ms > 0 else None
        stats = {"gpu_total_ms": round(gpu_total_ms, 2), "gpu_first_ms": gpu_first, "ttfa_ms": ttfa_ms, "rtf": rtf}
        self.history.record_end(take, reason.value, {**{k: v for k, v in stats.items() if v is not None}, **recorded})
        actions: list[Action] = []
        if take.request.words:
            actions.append(FinishWords(cur.run, take, complete=reason is EndReason.DONE))
        if self._keeping and take.n_frames > 0:
            actions.append(Keep(take))
        actions.append(FinishAudio(cur.run, take))
        if error is not None:
            actions.append(SendMessage(ErrorMessage.of(error, take=take.take_id)))
        ended = TakeEnded(
            take=take.take_id,
            reason=reason.value,
            n_frames=n_frames,
            new_frames=new_frames,
            duration_sec=round(n_frames / FRAME_RATE, 3),
            gpu_total_ms=round(gpu_total_ms, 2),
            gpu_first_ms=_opt(gpu_first),
            ttfa_ms=_opt(ttfa_ms),
            rtf=_opt(rtf),
            extra=dict(extra),
        )
        return [*actions, SendMessage(ended)]

    # -- engine takes -----------------------------------------------------------------------

    def admitted(self, run: int, *, rebuilt: bool = False) -> list[Action]:
        """The engine accepted run ``run`` (``rebuilt``: a retake whose parent's cache was not where it
        was kept, rebuilt from the stored codes); a run the session let go of meanwhile is stopped."""
        cur = self._current
        if cur is None or cur.run != run or self._phase is not Phase.ADMITTING:
            return [Stop(run, EndReason.CANCELLED)]
        self._phase = Phase.STREAMING
        take = cur.take
        if cur.continuations <= 1:  # a later continuation adds to the take's audio, already begun
            self._heard.begin(
                take.take_id, bytes_per_frame(take), parent=take.parent, branch_frame=take.branch_frame
            )
        return self._ack(cur, rebuilt=rebuilt)

    def admission_failed(self, run: int, err: ProtocolError) -> list[Action]:
        """Admission refused (busy, bad reference, prompt too long…): the take ends with an error."""
        cur = self._current
        if cur is None or cur.run != run:
            return []
        if cur.feed is not None and cur.started:  # a later continuation of a take that is under way
            return self._end_fed(cur, EndReason.ERROR, err)
        self.history.record_end(cur.take, EndReason.ERROR.value, {})
        return [*self._ack(cur), SendMessage(ErrorMessage.of(err, take=cur.take.take_id)), *self._finish_current()]

    def take_event(self, run: int, event: TakeEvent) -> list[Action]:
        """One engine event of run ``run`` → what goes to the client."""
        cur = self._current
        if cur is None or cur.run != run or self._phase not in (Phase.STREAMING, Phase.STOPPING):
            return []
        take = cur.take
        if isinstance(event, TakeFirstAudio):
            if cur.gpu_first_ms is None:  # a take fed with text: its first continuation's
                cur.gpu_first_ms = event.gpu_first_ms
            return []
        actions: list[Action] = []
        if not cur.started and (isinstance(event, AudioChunk) or cur.feed is None):
            cur.started = True
            gpu_first = cur.gpu_first_ms if isinstance(event, AudioChunk) else event.gpu_first_ms
            actions.append(SendMessage(self._started(cur, gpu_first)))
        if isinstance(event, AudioChunk):
            take.append(event.first_frame, event.codes)
            self._heard.append(take.take_id, event.first_frame, event.pcm)
            if cur.ttfa_ms is None:
                cur.ttfa_ms = (self._clock() - cur.t_request) * 1000.0
            seconds = event.n_frames / FRAME_RATE
            actions.append(SendAudio(run, event.pcm, seconds, paced=self._phase is Phase.STREAMING))
            return actions
        # TakeFinished
        if cur.feed is not None:
            return actions + self._continuation_finished(cur, event)
        error = None
        if event.reason is EndReason.ERROR:
            # A cluster says when the replica running the take was lost (replica_lost).
            code = ErrorCode(event.error_code) if event.error_code else ErrorCode.INTERNAL
            error = ProtocolError(code, event.error or "generation failed")
        actions += self._close(cur, event.reason, n_frames=event.n_frames, gpu_total_ms=event.gpu_total_ms,
                               gpu_first_ms=event.gpu_first_ms, extra=dict(event.timings), recorded={}, error=error)
        return actions + self._finish_current()

    def take_failed(self, run: int, message: str = "generation failed") -> list[Action]:
        """The stream of run ``run`` broke without an end (an engine fault)."""
        cur = self._current
        if cur is None or cur.run != run:
            return []
        error = ProtocolError(ErrorCode.INTERNAL, message)
        if cur.feed is not None and cur.started:
            return self._end_fed(cur, EndReason.ERROR, error)
        self.history.record_end(cur.take, EndReason.ERROR.value, {})
        return [SendMessage(ErrorMessage.of(error, take=cur.take.take_id)), *self._finish_current()]

    # -- replays ----------------------------------------------------------------------------

    def replay_audio(self, run: int, pcm: bytes) -> list[Action]:
        """The replayed take's whole PCM is at hand → its ``start`` and paced chunks from the frame."""
        cur = self._current
        if cur is None or cur.run != run or self._phase is not Phase.REPLAYING or cur.replay_frame is None:
            return []
        take, frame = cur.take, cur.replay_frame
        cur.started = True
        actions: list[Action] = [SendMessage(self._started(cur, None, first_frame=frame, replay=True))]
        frame_bytes = bytes_per_frame(take)
        step = max(1, take.request.chunk_frames)
        for first in range(frame, take.n_frames, step):
            last = min(take.n_frames, first + step)
            actions.append(SendAudio(run, pcm[first * frame_bytes : last * frame_bytes], (last - first) / FRAME_RATE))
        return actions

    def replay_finished(self, run: int) -> list[Action]:
        cur = self._current
        if cur is None or cur.run != run or self._phase is not Phase.REPLAYING:
            return []
        gpu_total_ms = (self._clock() - cur.t_request) * 1000.0
        end = SendMessage(self._replay_end(cur, EndReason.DONE, gpu_total_ms=gpu_total_ms))
        return [FinishAudio(run, cur.take, replay=True), end, *self._finish_current()]

    def replay_failed(self, run: int, err: ProtocolError) -> list[Action]:
        cur = self._current
        if cur is None or cur.run != run or self._phase is not Phase.REPLAYING:
            return []
        return [SendMessage(ErrorMessage.of(err, take=cur.take.take_id)), *self._finish_current()]

    # -- the connection ---------------------------------------------------------------------

    def shutdown(self) -> list[Action]:
        """The service is going down: refuse new takes, end the current one with reason ``shutdown``."""
        self._refusing = "the service is shutting down; reconnect shortly"
        if self._current is None:
            return []
        if self._phase is Phase.STOPPING:
            pending, self._pending = self._pending, None
            if pending is not None:
                self._queued += self._retire(pending, EndReason.SHUTDOWN)
            return []
        return self._stop_current(EndReason.SHUTDOWN)

    def close(self) -> list[Stop | Keep]:
        """The client is gone (a reload, a network drop): stop what runs; nothing is sent any more.

        Takes stay downloadable. A take cut off while its audio was going out ends ``cancelled``, as for a
        ``cancel``, and when the session keeps takes it is kept as heard, with the frames made up to now
        (a :class:`Keep` after the stops; issue 23, finding 5)."""
        self._refusing = "the connection is closed"
        actions: list[Stop | Keep] = []
        keeps: list[Keep] = []
        for run in (self._current, self._pending):
            if run is None:
                continue
            actions.append(Stop(run.run, EndReason.CANCELLED))
            take = run.take
            if run.replay_frame is not None or take.status is not TakeStatus.RUNNING:
                continue  # a replay's take ended long ago (and was kept then)
            reason = run.stop_reason or EndReason.CANCELLED
            self.history.record_end(take, reason.value, dict(self._text_stats(run)))
            if self._keeping and run.started and take.n_frames > 0:
                keeps.append(Keep(take))
        self._current = self._pending = None
        self._queued = []
        self._phase = Phase.IDLE
        return actions + keeps

    # -- messages ---------------------------------------------------------------------------

    def _started(
        self, run: _Run, gpu_first_ms: float | None, *, first_frame: int | None = None, replay: bool = False
    ) -> TakeStarted:
        take = run.take
        delivery = take.request.delivery()
        return TakeStarted(
            # Whole milliseconds, as the original playground sends it (rounded up: never 0 for a real wait).
            gpu_first_ms=math.ceil(gpu_first_ms) if gpu_first_ms is not None else None,
            take=take.take_id,
            channels=take.request.channels,
            seed=take.seed,
            model=run.model,
            first_frame=take.branch_frame if first_frame is None else first_frame,
            label=UNSET if take.label is None else take.label,
            replay=True if replay else UNSET,
            format=UNSET if delivery is None else delivery[0],
            sample_rate=UNSET if delivery is None else delivery[1],
        )

    @staticmethod
    def _replay_end(run: _Run, reason: EndReason, *, gpu_total_ms: float | None = None) -> TakeEnded:
        take = run.take
        done = reason is EndReason.DONE
        return TakeEnded(
            take=take.take_id,
            reason=reason.value,
            replay=True,
            n_frames=take.n_frames,
            new_frames=take.n_frames - (run.replay_frame or 0) if done else UNSET,
            duration_sec=round(take.n_frames / FRAME_RATE, 3),
            gpu_total_ms=UNSET if gpu_total_ms is None else round(gpu_total_ms, 2),
        )


def resolve_model(requested: str, models: tuple[str, ...], default_model: str) -> str:
    """The model a request names ("" or the default alias: the default), or not_found."""
    if requested in ("", default_model):
        return default_model
    if requested in models:
        return requested
    raise ProtocolError(ErrorCode.NOT_FOUND, f"unknown model {requested!r}; available: {list(models)}", field="model")


def continuation_id(take_id: str, index: int) -> str:
    """The engine's take id of a take's ``index``-th continuation (the first is the take itself)."""
    return take_id if index == 0 else f"{take_id}.{index}"


def word_frame(take: TakeRecord, index: int) -> int:
    """The frame where the take's ``index``-th word starts (``seek`` by ``word``); the take's words must be known."""
    words = take.words
    if words is None:
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"take {take.take_id} has no word timings yet", field="word")
    if index >= len(words):
        raise ProtocolError(
            ErrorCode.INVALID_FIELD, f"word {index} is past the {len(words)} words of take {take.take_id}", field="word"
        )
    return frame_at_time(words[index].start)


def bytes_per_frame(take: TakeRecord) -> int:
    """Bytes of one 80 ms frame of the take's PCM (int16, its channel count)."""
    return FRAME_SAMPLES * take.request.channels * 2


def _opt(value: float | None) -> float | Unset:
    return UNSET if value is None else value
