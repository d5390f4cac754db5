"""The take lifecycle state machine, sans-I/O: client messages and run reports in, actions out."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moss_rt.engine.base import AudioChunk, EndReason, TakeFinished, TakeFirstAudio
from moss_rt.protocol import AppendText, Cancel, EndOfText, ErrorCode, Ping, ProtocolError, Seek, StartTake
from moss_rt.session import (
    Action,
    Admit,
    FinishAudio,
    Go,
    Phase,
    RecentTakes,
    Replay,
    SendAudio,
    SendMessage,
    Stop,
    TakeLifecycle,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make_session(**kwargs: object) -> TakeLifecycle:
    ids = (f"t{i}" for i in itertools.count())
    seeds = itertools.count(1000)
    return TakeLifecycle(
        RecentTakes(),
        id_factory=lambda: next(ids),
        seed_factory=lambda: next(seeds),
        clock=Clock(),
        wall_clock=lambda: 5.0,
        **kwargs,  # type: ignore[arg-type]
    )


def sent(actions: list[Action]) -> list[tuple[str, ...]]:
    """What the client would see, compactly: (type, take, reason) per message, ("pcm",) per chunk."""
    out: list[tuple[str, ...]] = []
    for action in actions:
        if isinstance(action, SendMessage):
            d = action.message.to_dict()
            out.append(tuple(str(d[k]) for k in ("type", "take", "reason") if k in d))
        elif isinstance(action, SendAudio):
            out.append(("pcm",))
    return out


def only(actions: list[Action], kind: type) -> list:  # noqa: ANN001
    return [a for a in actions if isinstance(a, kind)]


def chunk(first: int, n: int = 2) -> AudioChunk:
    codes = np.full((n, 12), first, dtype=np.int64)
    return AudioChunk(first, codes, b"\x01\x00" * 3840 * n)


def stream(s: TakeLifecycle, run: int, frames: int = 4, reason: EndReason = EndReason.DONE) -> list[Action]:
    """Admission succeeds, the engine sends ``frames`` frames and ends with ``reason``."""
    actions = s.admitted(run)
    actions += s.take_event(run, TakeFirstAudio(3.0))
    for first in range(0, frames, 2):
        actions += s.take_event(run, chunk(first))
    return actions + s.take_event(run, TakeFinished(reason, frames, 10.0, 3.0))


def test_a_take_goes_idle_admitting_streaming_idle() -> None:
    s = make_session()
    assert s.phase is Phase.IDLE and not s.busy
    (admit,) = s.handle(StartTake(text="hello", seed=7, chunk_frames=3, take="scene"))
    assert isinstance(admit, Admit) and s.phase is Phase.ADMITTING and s.busy
    spec = admit.spec(None)
    assert (spec.take_id, spec.seed, spec.chunk_frames, spec.text, spec.prefix_codes) == ("t0", 7, 3, "hello", None)
    assert s.admitted(admit.run) == [] and s.phase is Phase.STREAMING
    actions = stream(s, admit.run)[0:]
    assert sent(actions) == [("start", "t0"), ("pcm",), ("pcm",), ("end", "t0", "done")]
    start = only(actions, SendMessage)[0].message.to_dict()
    assert start["seed"] == 7 and start["label"] == "scene" and start["gpu_first_ms"] == 3.0
    end = only(actions, SendMessage)[-1].message.to_dict()
    assert (end["n_frames"], end["new_frames"], end["duration_sec"]) == (4, 4, 0.32)
    assert s.phase is Phase.IDLE and s.history.get("t0").n_frames == 4


def test_start_while_admitting_ends_the_first_at_once_and_stops_its_late_admission() -> None:
    """Issue 16, finding 2: never two takes for one session, however slow admission is."""
    s = make_session()
    (first,) = s.handle(StartTake(text="first"))
    actions = s.handle(StartTake(text="second"))
    assert sent(actions) == [("start", "t0"), ("end", "t0", "replaced")]
    (second,) = only(actions, Admit)
    assert second.take.take_id == "t1" and s.phase is Phase.ADMITTING
    # The second take streams; the first one's admission finally completes in the middle of it.
    assert s.admitted(second.run) == []
    assert sent(s.take_event(second.run, chunk(0))) == [("start", "t1"), ("pcm",)]
    assert s.admitted(first.run) == [Stop(first.run, EndReason.CANCELLED)]
    assert s.take_event(first.run, chunk(0)) == [] and s.take_event(first.run, TakeFinished(EndReason.DONE, 2, 1)) == []
    # A cancel now reaches the second take, which ends; a third start is the only take after it.
    assert s.handle(Cancel()) == [Stop(second.run, EndReason.CANCELLED)]
    assert sent(s.take_event(second.run, TakeFinished(EndReason.CANCELLED, 2, 5.0))) == [("end", "t1", "cancelled")]
    (third,) = s.handle(StartTake(text="third"))
    assert isinstance(third, Admit) and s.admission_failed(first.run, ProtocolError(ErrorCode.BUSY, "x")) == []
    assert sent(stream(s, third.run)) == [("start", "t2"), ("pcm",), ("pcm",), ("end", "t2", "done")]
    assert [t.reason for t in s.history.takes] == ["replaced", "cancelled", "done"]


def test_start_while_streaming_waits_for_the_replaced_end() -> None:
    s = make_session()
    (a,) = s.handle(StartTake(text="a"))
    s.admitted(a.run)
    s.take_event(a.run, chunk(0))
    assert s.handle(StartTake(text="b")) == [Stop(a.run, EndReason.REPLACED)]
    assert s.phase is Phase.STOPPING
    # Audio the engine made before it stopped still goes out, no longer held to real time.
    (audio,) = s.take_event(a.run, chunk(2))
    assert isinstance(audio, SendAudio) and not audio.paced
    actions = s.take_event(a.run, TakeFinished(EndReason.REPLACED, 4, 5.0))
    assert sent(actions) == [("end", "t0", "replaced")] and only(actions, Admit)[0].take.take_id == "t1"
    assert s.phase is Phase.ADMITTING


def test_a_take_that_cut_in_on_a_streaming_socket_asks_the_engine_for_a_barge_in() -> None:
    """A start or a retake that replaced a streaming take (the director cut in and waits) is flagged ``barge_in`` on
    its engine request, so the engine admits it with retakes, ahead of queued new takes; a start on an idle socket or
    one replacing a take still being admitted is an ordinary new take."""
    s = make_session()
    (a,) = s.handle(StartTake(text="a"))
    assert not a.barge_in and not a.spec(None).barge_in  # nothing was streaming
    (b,) = only(s.handle(StartTake(text="b")), Admit)  # a was still being admitted: it ends at once
    assert not b.barge_in
    s.admitted(b.run)
    s.take_event(b.run, chunk(0))
    assert s.handle(StartTake(text="c")) == [Stop(b.run, EndReason.REPLACED)]
    (c,) = only(s.take_event(b.run, TakeFinished(EndReason.REPLACED, 2, 5.0)), Admit)
    assert c.barge_in and c.spec(None).barge_in and c.spec(None).parent_take is None
    s.admitted(c.run)
    s.take_event(c.run, chunk(0))
    s.handle(Seek(take="t2", frame=2))  # a retake cutting in: flagged too (retakes go first anyway)
    (r,) = only(s.take_event(c.run, TakeFinished(EndReason.REPLACED, 2, 5.0)), Admit)
    assert r.barge_in and r.spec(None).parent_take == "t2"
    s.admitted(r.run)
    s.take_event(r.run, chunk(2))
    assert sent(s.take_event(r.run, TakeFinished(EndReason.DONE, 4, 5.0))) == [("end", "t3", "done")]
    (d,) = s.handle(StartTake(text="d"))
    assert not d.barge_in  # idle again


def test_starts_while_stopping_keep_only_the_newest_and_end_the_others_in_order() -> None:
    s = make_session()
    (a,) = s.handle(StartTake(text="a"))
    s.admitted(a.run)
    s.handle(StartTake(text="b"))
    assert s.handle(StartTake(text="c")) == [] and s.handle(StartTake(text="d")) == []
    actions = s.take_event(a.run, TakeFinished(EndReason.REPLACED, 0, 1.0))
    assert sent(actions) == [
        ("start", "t0"), ("end", "t0", "replaced"),
        ("start", "t1"), ("end", "t1", "replaced"),
        ("start", "t2"), ("end", "t2", "replaced"),
    ]
    assert [a.take.take_id for a in only(actions, Admit)] == ["t3"]


def test_cancel_while_admitting_and_while_stopping() -> None:
    s = make_session()
    (a,) = s.handle(StartTake(text="a"))
    assert sent(s.handle(Cancel(take="t9"))) == []  # not the current take
    assert sent(s.handle(Cancel(take="t0"))) == [("start", "t0"), ("end", "t0", "cancelled")]
    assert s.phase is Phase.IDLE and s.admitted(a.run) == [Stop(a.run, EndReason.CANCELLED)]
    (b,) = s.handle(StartTake(text="b"))
    s.admitted(b.run)
    s.handle(StartTake(text="c"))  # b stopping, c pending
    assert s.handle(Cancel()) == []  # the pending c is dropped; b is already stopping
    actions = s.take_event(b.run, TakeFinished(EndReason.REPLACED, 0, 1.0))
    assert sent(actions) == [("start", "t1"), ("end", "t1", "replaced"), ("start", "t2"), ("end", "t2", "cancelled")]
    assert only(actions, Admit) == [] and s.phase is Phase.IDLE


def test_retake_while_streaming_acks_after_the_end_and_keeps_the_prefix() -> None:
    s = make_session()
    (a,) = s.handle(StartTake(text="line", seed=1))
    s.admitted(a.run)
    s.take_event(a.run, chunk(0, 6))
    assert s.handle(Seek(take="t0", frame=4, seed=9)) == [Stop(a.run, EndReason.REPLACED)]
    actions = s.take_event(a.run, TakeFinished(EndReason.REPLACED, 6, 1.0))
    assert sent(actions) == [("end", "t0", "replaced")]
    (retake,) = only(actions, Admit)
    # The seek is answered once the retake is admitted: only then is it known where its cache came from.
    admitted = s.admitted(retake.run, rebuilt=True)
    assert sent(admitted) == [("seek", "t1")]
    ack = only(admitted, SendMessage)[0].message.to_dict()
    assert (ack["from_take"], ack["frame"], ack["sample"], ack["rebuilt"]) == ("t0", 4, 4 * 3840, True)
    spec = retake.spec(None)
    assert spec.seed == 9 and spec.parent_take == "t0" and spec.start_frame == 4
    assert np.array_equal(spec.prefix_codes, s.history.get("t0").codes[:4])


# -- early admission (the directing socket): a take replacing a streaming one is submitted at once ----------------


def _streaming(s: TakeLifecycle) -> Admit:
    (a,) = s.handle(StartTake(text="line", seed=1))
    s.admitted(a.run)
    s.take_event(a.run, chunk(0, 6))
    return a


def test_an_early_retake_is_submitted_with_the_stop_and_goes_on_after_the_replaced_end() -> None:
    """The retake's engine request goes out together with the replaced take's stop (its prompt and admission overlap
    the stop); what the engine answers meanwhile waits: the client still hears the replaced take's end, then the
    seek's answer, then the retake (its events are read only after ``Go``)."""
    s = make_session(early_admission=True)
    a = _streaming(s)
    actions = s.handle(Seek(take="t0", frame=4, seed=9))
    assert actions[0] == Stop(a.run, EndReason.REPLACED) and sent(actions) == []
    (retake,) = only(actions, Admit)
    assert retake.early and retake.barge_in and retake.spec(None).parent_take == "t0"
    assert s.is_pending(retake.run) and not s.is_current(retake.run)
    assert s.admitted(retake.run, rebuilt=False) == []  # admitted before the replaced take ended: nothing yet
    assert s.is_pending(retake.run)
    ended = s.take_event(a.run, TakeFinished(EndReason.REPLACED, 6, 1.0))
    assert sent(ended) == [("end", "t0", "replaced"), ("seek", "t1")]
    assert ended[-1] == Go(retake.run) and only(ended, Admit) == []  # submitted already: not again
    assert s.is_current(retake.run) and s.phase is Phase.STREAMING
    assert only(ended, SendMessage)[-1].message.to_dict()["rebuilt"] is False
    assert sent(s.take_event(retake.run, chunk(4))) == [("start", "t1"), ("pcm",)]


def test_an_early_retake_still_being_admitted_when_the_replaced_take_ends_goes_on_as_any_take() -> None:
    s = make_session(early_admission=True)
    a = _streaming(s)
    (retake,) = only(s.handle(Seek(take="t0", frame=4, seed=9)), Admit)
    ended = s.take_event(a.run, TakeFinished(EndReason.REPLACED, 6, 1.0))
    assert sent(ended) == [("end", "t0", "replaced")] and only(ended, Go) == [] and only(ended, Admit) == []
    assert s.is_current(retake.run) and s.phase is Phase.ADMITTING and not s.is_pending(retake.run)
    assert sent(s.admitted(retake.run, rebuilt=True)) == [("seek", "t1")]
    assert s.phase is Phase.STREAMING


def test_an_early_take_refused_is_told_after_the_replaced_end() -> None:
    s = make_session(early_admission=True)
    a = _streaming(s)
    (b,) = only(s.handle(StartTake(text="next")), Admit)
    assert b.early
    assert s.admission_failed(b.run, ProtocolError(ErrorCode.BUSY, "full")) == []
    ended = s.take_event(a.run, TakeFinished(EndReason.REPLACED, 6, 1.0))
    assert sent(ended) == [("end", "t0", "replaced"), ("error", "t1")] and s.phase is Phase.IDLE


def test_an_early_take_replaced_or_cancelled_while_waiting_is_stopped_and_ends_in_order() -> None:
    """The newest request wins while the replaced take stops: an early take it displaces gets a stop for its
    engine take (at once, or when its admission reports), and its start and end go out after the replaced end."""
    s = make_session(early_admission=True)
    a = _streaming(s)
    (b,) = only(s.handle(StartTake(text="b")), Admit)
    s.admitted(b.run)
    actions = s.handle(StartTake(text="c"))
    assert actions[0] == Stop(b.run, EndReason.REPLACED)
    (c,) = only(actions, Admit)
    assert c.early and s.is_pending(c.run) and not s.is_pending(b.run)
    assert s.handle(Cancel()) == [Stop(c.run, EndReason.CANCELLED)]  # c dropped while still being admitted...
    assert s.admitted(c.run) == [Stop(c.run, EndReason.CANCELLED)]  # ...and stopped once it reports
    ended = s.take_event(a.run, TakeFinished(EndReason.REPLACED, 6, 1.0))
    assert sent(ended) == [
        ("end", "t0", "replaced"), ("start", "t1"), ("end", "t1", "replaced"), ("start", "t2"),
        ("end", "t2", "cancelled"),
    ]
    assert only(ended, Admit) == [] and only(ended, Go) == [] and s.phase is Phase.IDLE


def test_without_early_admission_a_replacing_take_is_submitted_after_the_end() -> None:
    """HTTP and other one-take users keep the default: nothing is submitted before the replaced take ended."""
    s = make_session()
    a = _streaming(s)
    assert s.handle(Seek(take="t0", frame=4, seed=9)) == [Stop(a.run, EndReason.REPLACED)]
    (retake,) = only(s.take_event(a.run, TakeFinished(EndReason.REPLACED, 6, 1.0)), Admit)
    assert not retake.early


def test_shutdown_and_close_stop_an_early_take() -> None:
    s = make_session(early_admission=True)
    _streaming(s)
    (b,) = only(s.handle(StartTake(text="b")), Admit)
    assert s.shutdown() == [Stop(b.run, EndReason.SHUTDOWN)]
    t = make_session(early_admission=True)
    a = _streaming(t)
    (c,) = only(t.handle(StartTake(text="c")), Admit)
    stops = t.close()
    assert Stop(a.run, EndReason.CANCELLED) in stops and Stop(c.run, EndReason.CANCELLED) in stops


def test_a_retake_that_never_streams_still_gets_its_seek_answer_first() -> None:
    s = make_session()
    (a,) = s.handle(StartTake(text="line", chunk_frames=2))
    stream(s, a.run, frames=6)
    # Refused at admission: the answer (not rebuilt), then the error.
    (refused,) = only(s.handle(Seek(take="t0", frame=2, seed=3)), Admit)
    actions = s.admission_failed(refused.run, ProtocolError(ErrorCode.BUSY, "full"))
    assert sent(actions) == [("seek", "t1"), ("error", "t1")]
    assert only(actions, SendMessage)[0].message.to_dict()["rebuilt"] is False
    # Cancelled while being admitted: the answer, then its start and end.
    (cancelled,) = only(s.handle(Seek(take="t0", frame=2, seed=4)), Admit)
    assert sent(s.handle(Cancel())) == [("seek", "t2"), ("start", "t2"), ("end", "t2", "cancelled")]
    assert s.admitted(cancelled.run, rebuilt=True) == [Stop(cancelled.run, EndReason.CANCELLED)]


def test_replay_sends_stored_audio_and_a_cancel_ends_it_at_once() -> None:
    s = make_session()
    (a,) = s.handle(StartTake(text="x", chunk_frames=2))
    stream(s, a.run, frames=6)
    actions = s.handle(Seek(take="t0", frame=2, mode="replay"))
    assert sent(actions) == [("seek", "t0")]
    (replay,) = only(actions, Replay)
    assert s.phase is Phase.REPLAYING and replay.frame == 2
    audio = s.replay_audio(replay.run, bytes(range(256)) * 6 * 30)
    assert sent(audio) == [("start", "t0"), ("pcm",), ("pcm",)]
    assert only(audio, SendMessage)[0].message.to_dict()["replay"] is True
    assert sent(s.handle(Cancel())) == [("end", "t0", "cancelled")] and s.phase is Phase.IDLE
    assert s.replay_finished(replay.run) == []  # stale: its end already went out
    (again,) = only(s.handle(Seek(take="t0", frame=0, mode="replay")), Replay)
    s.replay_audio(again.run, b"\x00" * 3840 * 2 * 6)
    end = only(s.replay_finished(again.run), SendMessage)[0].message.to_dict()
    assert (end["reason"], end["replay"], end["new_frames"]) == ("done", True, 6)


def test_refusals_leave_the_current_take_alone() -> None:
    s = make_session()
    (a,) = s.handle(StartTake(text="a"))
    s.admitted(a.run)
    with pytest.raises(ProtocolError) as info:
        s.handle(StartTake(text="b", model="nope"))
    assert info.value.code == ErrorCode.NOT_FOUND
    with pytest.raises(ProtocolError):
        s.handle(Seek(take="t0", frame=0, mode="replay"))  # still running
    assert s.phase is Phase.STREAMING and s.current_take is not None and s.current_take.take_id == "t0"
    assert sent(s.handle(Ping(t=1.5))) == [("pong",)]


def test_admission_failure_is_a_take_error() -> None:
    s = make_session()
    (a,) = s.handle(StartTake(text="a"))
    actions = s.admission_failed(a.run, ProtocolError(ErrorCode.BUSY, "full"))
    error = only(actions, SendMessage)[0].message.to_dict()
    assert (error["code"], error["take"]) == ("busy", "t0") and s.phase is Phase.IDLE


def test_shutdown_ends_the_take_and_refuses_new_ones() -> None:
    s = make_session()
    (a,) = s.handle(StartTake(text="a"))
    s.admitted(a.run)
    assert s.shutdown() == [Stop(a.run, EndReason.SHUTDOWN)]
    with pytest.raises(ProtocolError) as info:
        s.handle(StartTake(text="b"))
    assert info.value.code == ErrorCode.BUSY
    assert sent(s.take_event(a.run, TakeFinished(EndReason.SHUTDOWN, 0, 1.0))) == [
        ("start", "t0"), ("end", "t0", "shutdown")
    ]


def test_close_stops_everything_and_sends_nothing() -> None:
    s = make_session()
    (a,) = s.handle(StartTake(text="a"))
    s.admitted(a.run)
    s.handle(StartTake(text="b"))
    actions = s.close()
    assert all(isinstance(x, Stop) for x in actions) and Stop(a.run, EndReason.CANCELLED) in actions
    assert s.phase is Phase.IDLE and s.take_event(a.run, chunk(0)) == []
    assert all(t.status == "ended" for t in s.history.takes)


# --------------------------------------------------------------------------- any interleaving

OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["start", "retake", "replay", "cancel", "admit", "refuse", "chunk", "finish", "replay_io",
             "start_fed", "append", "end_of_text", "replay_send"]
        ),
        st.integers(0, 7),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
# A replay's chunk sent after a cancel let go of the replay (issue 23, finding 3).
@example([("start", 0), ("admit", 0), ("chunk", 0), ("finish", 0), ("replay", 0), ("replay_io", 0), ("cancel", 0),
          ("replay_send", 0)])
def test_any_interleaving_keeps_one_take_at_a_time(ops: list[tuple[str, int]]) -> None:
    """Client messages and late run reports in any order: what the client receives is always
    start, audio, end of one take after another (never interleaved), each started take ends once,
    and at most one engine take of the session is ever running."""
    s = make_session()
    admitting: list[Admit] = []  # Admit actions whose run has not reported yet
    engine: dict[int, list[int]] = {}  # admitted runs still generating → [next frame]
    stopped: set[int] = set()  # runs told to stop
    replays: list[Replay] = []
    replay_chunks: dict[int, list[SendAudio]] = {}  # a replay's audio, sent a chunk at a time (replay_send)
    run_take: dict[int, str] = {}  # run → the take whose audio it sends
    wire: list[Action] = []

    def perform(actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Admit | Replay):
                run_take[a.run] = a.take.take_id
            if isinstance(a, Admit):
                admitting.append(a)
            elif isinstance(a, Replay):
                replays.append(a)
            elif isinstance(a, Stop):
                stopped.add(a.run)
            else:
                wire.append(a)

    for op, n in ops:
        ended = [t for t in s.history.takes if t.status == "ended" and t.n_frames > 0]
        try:
            if op == "start":
                perform(s.handle(StartTake(text="x", seed=n, chunk_frames=1 + n % 2)))
            elif op == "retake" and ended:
                take = ended[n % len(ended)]
                perform(s.handle(Seek(take=take.take_id, frame=n % (take.n_frames + 1))))
            elif op == "replay" and ended:
                take = ended[n % len(ended)]
                perform(s.handle(Seek(take=take.take_id, frame=n % (take.n_frames + 1), mode="replay")))
            elif op == "cancel":
                perform(s.handle(Cancel()))
            elif op == "start_fed":  # a take fed with text: continuations, waits (issue 14)
                perform(s.handle(StartTake(text="One. " if n % 2 else "", seed=n, stream_text=True)))
            elif op == "append":
                perform(s.handle(AppendText(text="More. " if n % 2 else "more")))
            elif op == "end_of_text":
                perform(s.handle(EndOfText()))
        except ProtocolError:
            pass
        if op in ("admit", "refuse") and admitting:
            a = admitting.pop(n % len(admitting))
            if op == "refuse":
                perform(s.admission_failed(a.run, ProtocolError(ErrorCode.BUSY, "full")))
                continue
            actions = s.admitted(a.run)
            perform(actions)
            # A continuation of a fed take goes on after its prefix (every frame of the take so far).
            engine[a.run] = [a.take.branch_frame if a.prefix_codes is None else len(a.prefix_codes)]
        elif op in ("chunk", "finish") and engine:
            run = sorted(engine)[n % len(engine)]
            frame = engine[run]
            if op == "chunk" and run not in stopped:
                perform(s.take_event(run, chunk(frame[0], 1)))
                frame[0] += 1
            else:
                reason = EndReason.CANCELLED if run in stopped else EndReason.DONE
                del engine[run]
                perform(s.take_event(run, TakeFinished(reason, frame[0], 1.0)))
        elif op == "replay_io" and replays:
            r = replays.pop(0)
            actions = s.replay_audio(r.run, b"\x00" * 3840 * 2 * r.take.n_frames)
            perform([a for a in actions if not isinstance(a, SendAudio)])
            replay_chunks[r.run] = [a for a in actions if isinstance(a, SendAudio)]
        elif op == "replay_send" and replay_chunks:
            # The transport sends a replay's chunks one by one, later, while client messages keep coming;
            # the rule it keeps: a chunk goes out only while its run is the session's current one.
            run = sorted(replay_chunks)[n % len(replay_chunks)]
            if replay_chunks[run]:
                chunk_action = replay_chunks[run].pop(0)
                if s.is_current(run):
                    wire.append(chunk_action)
            else:
                del replay_chunks[run]
                perform(s.replay_finished(run))
        running = [run for run in engine if run not in stopped]
        assert len(running) <= 1, "two engine takes for one session"

    # The wire: start (audio)* end, one take after another; a refused take is one error.
    open_take: str | None = None
    ended_takes: list[tuple[str, bool]] = []
    for a in wire:
        if isinstance(a, SendAudio | FinishAudio):
            assert open_take is not None, "audio outside a take"
            assert run_take.get(a.run, a.take.take_id if isinstance(a, FinishAudio) else None) == open_take, (
                "audio of another take"
            )
            continue
        d = a.message.to_dict()
        if d["type"] == "start":
            assert open_take is None, f"{d['take']} started inside {open_take}"
            open_take = d["take"]
        elif d["type"] == "end":
            assert d["take"] == open_take, "an end for a take that is not the open one"
            ended_takes.append((d["take"], bool(d.get("replay"))))
            open_take = None
        elif d["type"] == "error":
            # A refused take is one error; an error after streaming began names the open take (its end follows).
            assert open_take is None or d.get("take") == open_take
    takes_ended = [take for take, replay in ended_takes if not replay]
    assert len(takes_ended) == len(set(takes_ended)), "a take ended twice"


def test_a_session_bound_to_a_store_keeps_every_ended_take_before_its_end_goes_out() -> None:
    from moss_rt.session import Keep, TakeRecord, TakeStatus

    s = make_session(max_takes_kept=2)
    s.keep_takes(500)  # resume: takes stay until deleted, not the connection's bounded history
    ends: list[tuple[int, int]] = []  # (index of the Keep, index of the end) per take
    for n in range(4):
        (admit,) = only(s.handle(StartTake(text=f"line {n}", seed=n)), Admit)
        actions = stream(s, admit.run, frames=4)
        keep = next(i for i, a in enumerate(actions) if isinstance(a, Keep))
        end = next(i for i, a in enumerate(actions) if isinstance(a, SendMessage) and a.message.type == "end")
        assert actions[keep].take is admit.take and actions[keep].take.n_frames == 4
        ends.append((keep, end))
    assert all(k < e for k, e in ends)
    assert len(s.history.takes) == 4  # none forgotten at max_takes_kept=2

    # A take of the session from an earlier connection: adopted, then retaken from its stored codes.
    old = TakeRecord("t_old", StartTake(text="stored", seed=42))
    old.append(0, np.arange(60, dtype=np.int64).reshape(5, 12))
    s.history.adopt(old)
    assert old.status is TakeStatus.ENDED
    (admit,) = only(s.handle(Seek(take="t_old", frame=3)), Admit)
    assert admit.take.parent == "t_old" and np.array_equal(admit.prefix_codes, old.codes[:3])


def test_a_session_not_bound_keeps_nothing() -> None:
    from moss_rt.session import Keep

    s = make_session()
    (admit,) = only(s.handle(StartTake(text="x", seed=1)), Admit)
    assert not only(stream(s, admit.run), Keep)


def test_a_replay_replaced_before_its_audio_still_gets_a_start_before_its_end() -> None:
    """Found by the any-interleaving property with many examples: a replay let go before its PCM was
    at hand sent its ``end`` (and the end of its format file) with no ``start``; every end follows its start."""
    s = make_session()
    (a,) = s.handle(StartTake(text="a"))
    stream(s, a.run, frames=3)
    (replay,) = only(s.handle(Seek(take="t0", frame=1, mode="replay")), Replay)
    actions = s.handle(StartTake(text="b"))
    assert Stop(replay.run, EndReason.REPLACED) in actions
    wire = [a for a in actions if isinstance(a, SendMessage)]
    kinds = [(m.message.to_dict()["type"], m.message.to_dict().get("take")) for m in wire]
    assert kinds[:2] == [("start", "t0"), ("end", "t0")]
    assert wire[0].message.to_dict()["replay"] is True and wire[1].message.to_dict()["reason"] == "replaced"
    assert not any(isinstance(a, SendAudio | FinishAudio) for a in actions)
    assert s.replay_audio(replay.run, b"\x00" * 3840 * 2 * 3) == []  # its late PCM is stale


def test_only_the_current_run_may_send_audio_so_a_replay_let_go_sends_nothing_after_its_end() -> None:
    """Issue 23, finding 3: the transport sends a replay's chunks one by one, long after ``replay_audio``
    answered them; it checks ``is_current(run)`` right before each. A replay that was cancelled or replaced
    is not current the moment its end is decided; a streaming take told to stop still is, until its end
    (the frames it made go out before that end)."""
    s = make_session()
    (a,) = s.handle(StartTake(text="a", chunk_frames=1))
    stream(s, a.run, frames=6)
    (replay,) = only(s.handle(Seek(take="t0", frame=0, mode="replay")), Replay)
    chunks = only(s.replay_audio(replay.run, b"\x00" * 3840 * 2 * 6), SendAudio)
    assert len(chunks) == 6 and s.is_current(replay.run)
    assert sent(s.handle(Cancel())) == [("end", "t0", "cancelled")] and not s.is_current(replay.run)

    (replay,) = only(s.handle(Seek(take="t0", frame=2, mode="replay")), Replay)
    s.replay_audio(replay.run, b"\x00" * 3840 * 2 * 6)
    actions = s.handle(StartTake(text="b"))  # barge-in
    (b,) = only(actions, Admit)
    assert sent(actions) == [("end", "t0", "replaced")]
    assert not s.is_current(replay.run) and s.is_current(b.run)

    s.admitted(b.run)
    s.take_event(b.run, chunk(0))
    assert s.handle(Cancel()) == [Stop(b.run, EndReason.CANCELLED)] and s.is_current(b.run)
    assert sent(s.take_event(b.run, chunk(2))) == [("pcm",)]  # made before the stop took effect: still its own
    assert sent(s.take_event(b.run, TakeFinished(EndReason.CANCELLED, 4, 1.0))) == [("end", "t1", "cancelled")]
    assert not s.is_current(b.run)


def test_a_take_cut_off_by_the_client_leaving_is_kept_as_heard() -> None:
    """Issue 23, finding 5: a reload or a network drop ends the take like a cancel, and a session that keeps
    takes keeps it, with the frames made so far; a take that never sounded is not kept, a replay not again."""
    from moss_rt.session import Keep

    s = make_session()
    s.keep_takes(200)
    (a,) = only(s.handle(StartTake(text="a", seed=1)), Admit)
    s.admitted(a.run)
    s.take_event(a.run, chunk(0, 3))
    s.handle(StartTake(text="b"))  # a barge-in: a is stopping, b pending
    actions = s.close()
    assert actions[:2] == [Stop(a.run, EndReason.CANCELLED), Stop(a.run + 1, EndReason.CANCELLED)]
    (keep,) = only(actions, Keep)
    assert keep.take is a.take and (a.take.n_frames, a.take.reason, a.take.status) == (3, "replaced", "ended")
    assert s.take_event(a.run, chunk(3)) == [] and a.take.n_frames == 3  # frozen as heard

    s = make_session()
    s.keep_takes(200)
    (a,) = only(s.handle(StartTake(text="a")), Admit)
    assert not only(s.close(), Keep)  # still being admitted: nothing was heard

    s = make_session()
    s.keep_takes(200)
    (a,) = only(s.handle(StartTake(text="a", chunk_frames=1)), Admit)
    stream(s, a.run, frames=2)
    s.handle(Seek(take="t0", frame=0, mode="replay"))
    assert not only(s.close(), Keep)  # a replay: its take was kept when it ended


def test_a_take_fed_with_text_cancelled_while_waiting_for_text_is_kept() -> None:
    from moss_rt.session import Keep

    s = make_session()
    s.keep_takes(200)
    (a,) = only(s.handle(StartTake(text="One. ", stream_text=True)), Admit)
    stream(s, a.run, frames=2)
    assert s.phase is Phase.WAITING
    actions = s.handle(Cancel())
    (keep,) = only(actions, Keep)
    assert keep.take.n_frames == 2 and actions.index(keep) < actions.index(only(actions, FinishAudio)[0])
    assert sent(actions) == [("end", "t0", "cancelled")]


def test_a_take_waiting_for_text_is_idle_and_the_idle_timeout_ends_it() -> None:
    """Issue 23, finding 11: a take waiting for text does not hold the socket busy; the idle timeout ends it
    (``timeout``), and touches nothing else."""
    s = make_session()
    assert only(s.handle(StartTake(text="", stream_text=True)), Admit) == []
    assert s.phase is Phase.WAITING and not s.busy  # no text ready yet: it waits at once
    assert sent(s.idle_timeout()) == [("start", "t0"), ("end", "t0", "timeout")] and s.phase is Phase.IDLE

    (b,) = only(s.handle(StartTake(text="One. ", stream_text=True)), Admit)
    assert s.busy and s.idle_timeout() == []  # speaking: a listener that only listens is not idle
    actions = stream(s, b.run, frames=2)
    assert sent(actions) == [("start", "t1"), ("pcm",)] and not s.busy
    actions = s.idle_timeout()
    assert sent(actions) == [("end", "t1", "timeout")] and only(actions, FinishAudio)
    assert s.history.get("t1").reason == "timeout" and s.history.get("t1").n_frames == 2
    assert s.idle_timeout() == []
