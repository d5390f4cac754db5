"""One client's take lifecycle as a state machine, sans-I/O (like the ``websockets`` protocol object)."""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from moss_rt.engine.base import AudioChunk, TakeEvent, TakeFinished, TakeFirstAudio
from moss_rt.generation import FRAME_RATE, EndReason
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
    StartTake,
    TakeEnded,
    TakeStarted,
    Unset,
)
from moss_rt.session.actions import (
    Action,
    Admit,
    FinishAudio,
    FinishWords,
    Go,
    Keep,
    Replay,
    SendAudio,
    SendMessage,
    Stop,
    WordsCheckpoint,
)
from moss_rt.session.history import TakeHistory
from moss_rt.session.recent_takes import RecentTakes
from moss_rt.session.records import TakeRecord, TakeStatus, bytes_per_frame, new_take_id, random_seed
from moss_rt.text_feed import TextFeed


class Phase(enum.Enum):
    """What the lifecycle's one current take is doing (at most one at a time, by construction)."""

    IDLE = "idle"  # nothing
    ADMITTING = "admitting"  # reference voice being encoded, engine admission under way
    STREAMING = "streaming"  # the engine generates it; its frames go out as they come
    REPLAYING = "replaying"  # stored audio of an earlier take goes out again
    WAITING = "waiting"  # a take fed with text (stream_text): nothing to say until more text is ready
    STOPPING = "stopping"  # asked to stop; its end (and then any pending start) follows


class RunKind(enum.Enum):
    """What one run of the lifecycle carries out."""

    TAKE = "take"  # one engine take, admitted then streamed: a start, or a retake (a seek)
    FED = "fed"  # a take fed with text (stream_text): a chain of engine takes, its continuations, one run each
    REPLAY = "replay"  # an ended take's audio sent again from a frame (a seek with mode replay)


@dataclass
class _Run:
    """The lifecycle's current take, as one admission → stream, a chain of them (fed with text), or one replay."""

    kind: RunKind
    run: int  # the serial number the transport reports back with (a continuation of a fed take gets a new one)
    take: TakeRecord
    model: str
    t_request: float
    from_frame: int = 0  # a replay: the frame its audio starts at
    # A seek's answer: a replay's is sent when the run begins; a retake's once the engine admitted it
    # (only then is it known whether its parent's cache was reused or rebuilt elsewhere, ``rebuilt``).
    ack: SeekAck | None = None
    acked: bool = False  # the ack went out
    prefix_codes: np.ndarray | None = None
    started: bool = False  # its ``start`` message went out
    gpu_first_ms: float | None = None
    ttfa_ms: float | None = None
    stop_reason: EndReason | None = None
    # A take fed with text (``stream_text``, kind FED): its text, and the continuations that speak it.
    feed: TextFeed | None = None
    continuations: int = 0
    text_waits: int = 0  # times it had nothing to say once speaking had begun
    gpu_total_ms: float = 0.0  # of the continuations that finished
    barge_in: bool = False  # it replaced a take that was streaming (the director cut in): admitted ahead of new takes
    # Admitted early: submitted while the take it replaces was still stopping (Admit.early). What the engine answered
    # before it became current waits here: None (still admitting), True/False (admitted; rebuilt), or the error.
    early: bool = False
    early_answer: bool | ProtocolError | None = None


ClientIntent = StartTake | Seek | Cancel | Ping | AppendText | FlushText | EndOfText
TextIntent = AppendText | FlushText | EndOfText


class TakeLifecycle:
    """One client's take lifecycle as a state machine, sans-I/O (like the ``websockets`` protocol object).

    The transport feeds it client messages (:meth:`handle`) and what happened to the runs it was
    asked to carry out (:meth:`admitted`, :meth:`take_event`, :meth:`replay_audio`, …); every call
    returns the actions to perform, in order. The rules it keeps by construction:

    - at most one current take; a start or seek while one runs replaces it (barge-in), and the
      replaced take's ``end`` goes out before anything of the new one;
    - every take that was started gets exactly one ``end`` (or one take-level ``error``);
    - reports about a run the lifecycle has let go of (replaced while still being admitted, a replay
      stopped) are ignored, and an engine take admitted too late is stopped at once;
    - a run's audio goes out only while it is the current run (:meth:`is_current`): the transport
      checks that right before each frame, since it sends a replay's chunks long after
      :meth:`replay_audio` answered them, and a replay let go of (cancel, barge-in) has its ``end``
      sent at once. A streaming take told to stop stays current until its end (its last frames go
      out first).
    """

    def __init__(
        self,
        recent: RecentTakes,
        *,
        models: tuple[str, ...] = (DEFAULT_MODEL_ALIAS,),
        default_model: str = DEFAULT_MODEL_ALIAS,
        heard: HeardAudio | None = None,
        max_takes_kept: int = DEFAULT_LIMITS.max_takes_kept,
        max_text_chars: int = DEFAULT_LIMITS.max_text_chars,
        id_factory: Callable[[], str] = new_take_id,
        seed_factory: Callable[[], int] = random_seed,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        client: str | None = None,
        early_admission: bool = False,
    ) -> None:
        self.history = TakeHistory(
            recent, max_takes_kept=max_takes_kept, id_factory=id_factory, seed_factory=seed_factory, client=client
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
        # A take that replaces a streaming one is submitted at once (Admit.early), not after that one's end: its
        # prompt, queue and admission overlap the stop (the engine defers it until the take it retakes has ended).
        # The wire order stays: its events are read only once it is current (Go), after the replaced take's end.
        self._early_admission = early_admission

    def keep_takes(self, max_session_takes: int) -> None:
        """The connection is bound to a stored directing session: ended takes are kept (a :class:`Keep` before
        their ``end``) and stay in the history until deleted, up to the takes one stored session keeps."""
        self._keeping = True
        self.history.keep_until_deleted(max_session_takes)

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
        """Run ``run`` is the current one: its audio may still go out (its end has not)."""
        return self._current is not None and self._current.run == run

    def is_pending(self, run: int) -> bool:
        """Run ``run`` was admitted early and waits for the stopping take's end (then :class:`Go`, or a stop)."""
        return self._pending is not None and self._pending.run == run and self._pending.early

    # -- client messages --------------------------------------------------------------------

    def handle(self, msg: ClientIntent, *, received_at: float | None = None) -> list[Action]:
        """One validated client message → actions. Raises ProtocolError for a request that cannot be
        carried out (unknown take or model, bad frame, refused); the current take is then untouched.
        ``received_at`` (this lifecycle's clock) is when the request arrived, for ``ttfa_ms``."""
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
            if msg.stream_text:
                feed = TextFeed(self._max_text_chars, msg.text)
                return self._replace(_Run(RunKind.FED, self._next_run(), take, model, t_request, feed=feed))
            return self._replace(_Run(RunKind.TAKE, self._next_run(), take, model, t_request))
        t_request = self._clock() if received_at is None else received_at
        plan = self.history.plan_seek(msg)
        model = self.resolve_model(plan.take.request.model)
        if plan.mode == "replay":
            run = _Run(RunKind.REPLAY, self._next_run(), plan.source, model, t_request, from_frame=plan.frame,
                       ack=plan.ack())
        else:
            run = _Run(RunKind.TAKE, self._next_run(), plan.take, model, t_request, ack=plan.ack(),
                       prefix_codes=plan.prefix_codes)
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
            actions = self._drop_pending(EndReason.REPLACED)
            new.barge_in = True
            self._pending = new
            return actions + self._admit_early(new)
        if self._phase is Phase.STREAMING:
            new.barge_in = True
            cur.stop_reason = EndReason.REPLACED
            self._phase = Phase.STOPPING
            self._pending = new
            return [Stop(cur.run, EndReason.REPLACED), *self._admit_early(new)]
        # ADMITTING or REPLAYING: nothing of it is in flight on the wire, so it ends here and now.
        actions = self._let_go(cur, EndReason.REPLACED)
        return actions + self._begin(new)

    def _admit_early(self, new: _Run) -> list[Action]:
        """Submit ``new`` now, while the take it replaces stops (``early_admission``): an engine take only (a replay
        or a take fed with text begins when it is current, as before)."""
        if not self._early_admission or new.kind is not RunKind.TAKE:
            return []
        new.early = True
        return [Admit(new.run, new.take, new.prefix_codes, barge_in=new.barge_in, early=True)]

    def _drop_pending(self, reason: EndReason) -> list[Action]:
        """The pending run will never begin: its ``start`` and ``end`` go out after the stopping take's end, and an
        engine take submitted for it early is stopped now (one still being admitted is stopped when it reports)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        self._queued += self._retire(pending, reason)
        return [Stop(pending.run, reason)] if pending.early else []

    def _cancel(self, target: str | None) -> list[Action]:
        cur = self._current
        if cur is None:
            return []
        if self._phase is Phase.STOPPING:
            pending = self._pending
            if pending is not None and (target is None or target in (pending.take.take_id, pending.take.label)):
                return self._drop_pending(EndReason.CANCELLED)
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
        if cur.kind is RunKind.REPLAY:
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
        ack = run.ack if run.kind is RunKind.REPLAY else dataclasses.replace(run.ack, rebuilt=rebuilt)
        return [SendMessage(ack)]

    def _retire(self, run: _Run, reason: EndReason) -> list[Action]:
        """A take that never streamed ends: ``start`` then ``end`` with ``reason`` (a replay: its end),
        after the answer to its seek if that did not go out yet."""
        actions = self._ack(run)
        if run.kind is RunKind.REPLAY:
            start = SendMessage(self._started(run, None, first_frame=run.from_frame, replay=True))
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
        if run.kind is not RunKind.FED:
            return {}
        return {"continuations": run.continuations, "text_waits": run.text_waits}

    def _begin(self, run: _Run) -> list[Action]:
        self._current = run
        if run.kind is RunKind.REPLAY:
            self._phase = Phase.REPLAYING
            return [*self._ack(run), Replay(run.run, run.take, run.from_frame)]
        if run.kind is RunKind.FED:
            return [*self._ack(run), *self._next_continuation(run)]
        self._phase = Phase.ADMITTING
        if run.early:  # submitted already: what the engine answered meanwhile happens now, in order
            answer = run.early_answer
            if answer is None:
                return []  # still being admitted: admitted() or admission_failed() comes as for any take
            if isinstance(answer, ProtocolError):
                return self.admission_failed(run.run, answer)
            return [*self.admitted(run.run, rebuilt=answer), Go(run.run)]
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
            if pending.early:
                actions.append(Stop(pending.run, EndReason.SHUTDOWN))
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
        if run is None or run.kind is not RunKind.FED or run.feed is None or not named:
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
        """A take that streamed ends: its record (stored first when the lifecycle keeps takes), the end of
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
        was kept, rebuilt from the stored codes); a run the lifecycle let go of meanwhile is stopped."""
        pending = self._pending
        if pending is not None and pending.run == run and pending.early:
            pending.early_answer = rebuilt  # it goes on once the stopping take has ended (_begin)
            return []
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
        pending = self._pending
        if pending is not None and pending.run == run and pending.early:
            pending.early_answer = err  # told once the stopping take has ended (_begin)
            return []
        cur = self._current
        if cur is None or cur.run != run:
            return []
        if cur.kind is RunKind.FED and cur.started:  # a later continuation of a take that is under way
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
        if not cur.started and (isinstance(event, AudioChunk) or cur.kind is not RunKind.FED):
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
        if cur.kind is RunKind.FED:
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
        if cur.kind is RunKind.FED and cur.started:
            return self._end_fed(cur, EndReason.ERROR, error)
        self.history.record_end(cur.take, EndReason.ERROR.value, {})
        return [SendMessage(ErrorMessage.of(error, take=cur.take.take_id)), *self._finish_current()]

    # -- replays ----------------------------------------------------------------------------

    def replay_audio(self, run: int, pcm: bytes) -> list[Action]:
        """The replayed take's whole PCM is at hand → its ``start`` and paced chunks from the frame."""
        cur = self._current
        if cur is None or cur.run != run or self._phase is not Phase.REPLAYING or cur.kind is not RunKind.REPLAY:
            return []
        take, frame = cur.take, cur.from_frame
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
            return self._drop_pending(EndReason.SHUTDOWN)
        return self._stop_current(EndReason.SHUTDOWN)

    def close(self) -> list[Stop | Keep]:
        """The client is gone (a reload, a network drop): stop what runs; nothing is sent any more.

        Takes stay downloadable. A take cut off while its audio was going out ends ``cancelled``, as for a
        ``cancel``, and when the lifecycle keeps takes it is kept as heard, with the frames made up to now
        (a :class:`Keep` after the stops; issue 23, finding 5)."""
        self._refusing = "the connection is closed"
        actions: list[Stop | Keep] = []
        keeps: list[Keep] = []
        for run in (self._current, self._pending):
            if run is None:
                continue
            actions.append(Stop(run.run, EndReason.CANCELLED))
            take = run.take
            if run.kind is RunKind.REPLAY or take.status is not TakeStatus.RUNNING:
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
            new_frames=take.n_frames - run.from_frame if done else UNSET,
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


def _opt(value: float | None) -> float | Unset:
    return UNSET if value is None else value
