"""Interactive work first, at scale (issue 22 targets, issue 26 fairness) on the tiny model (CPU): a cancel ends at once
with what was sent, a director's first chunks go in the codec's priority lane ahead of queued bulk calls, bulk calls are
short, batch work never shares a director's prefill pass, a barge-in start is admitted with retakes.

The engine's parts are driven round by round (tests/engine/harness.py); where a codec call must be in flight, the test
holds it on the codec worker until it lets it go, so what is checked (which calls, in which order, what reached a
channel) never depends on timing.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from moss_rt.audio import to_int16_pcm
from moss_rt.engine.base import RAMP_FRAMES, EndReason, TakeFinished, TakePriority
from moss_rt.engine.codec_batch import CodecBatcher
from moss_rt.engine.codec_calls import Chunk, CodecCalls
from moss_rt.engine.codec_worker import CodecCall
from moss_rt.engine.moss import MossEngine
from moss_rt.protocol import FRAME_SAMPLES
from tests.engine.harness import Rounds, drive, engine_settings, loaded_engine, spec

TEXT = "The rain had stopped an hour ago, and the street was quiet."


def _sample(engine: MossEngine, name: str, **labels: str) -> float:
    return engine.metrics.registry.get_sample_value(name, labels or None) or 0.0


def _pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.int32)


def _whole(engine: MossEngine, codes: np.ndarray) -> np.ndarray:
    """The whole-clip decode of ``codes`` as the mono int16 PCM a take streams."""
    codec: Any = engine._codec
    with torch.no_grad():
        audio = codec.decode(torch.from_numpy(np.ascontiguousarray(codes))[None])[0].float().numpy()
    return _pcm(to_int16_pcm(audio, 1))


def _assert_retake_exact(engine: MossEngine, parent_codes: np.ndarray, n: int, channel: Any) -> None:
    """A retake from frame n: every chunk in order, and its audio the whole-clip decode of its codes from n."""
    assert not channel.problems, channel.problems
    full = np.concatenate([parent_codes[:n], channel.codes])
    got = _pcm(channel.pcm)
    assert len(got) == len(channel.codes) * FRAME_SAMPLES > 0
    assert np.abs(got - _whole(engine, full)[n * FRAME_SAMPLES :]).max() <= 1  # float rounding, one int16 step


def test_a_cancelled_take_ends_in_the_next_round_with_what_it_sent_and_nothing_is_decoded_for_it(
    tiny_data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past its ramp a take sends 8-frame chunks; cancelled with frames made but not sent, it ends in the very next
    round with the frames its channel got: no codec call for it (before: one more call for those frames, queued behind
    the calls in flight), its codes and end stop at its last sent frame, the dropped frames are counted. Its caches are
    kept with what it sent, and a retake of it from a frame it sent repeats its frames and decodes exactly."""
    decodes: list[list[int]] = []
    real = CodecBatcher.decode_pcm

    def decode_pcm(self: CodecBatcher, states: list[Any], chunks: list[np.ndarray], channels: list[int]) -> Any:
        decodes.append([s.slot for s in states])
        return real(self, states, chunks, channels)

    monkeypatch.setattr(CodecBatcher, "decode_pcm", decode_pcm)
    with loaded_engine(engine_settings(tiny_data_dir, overlap=False)) as engine:
        rounds = Rounds(engine)
        sched = rounds.sched
        (x,) = rounds.add(spec("x", 7, 200, 8, text=TEXT))
        rounds.until(lambda: x.frames >= RAMP_FRAMES + 4 and x.pending > 0)
        made, sent = x.frames, x.sent
        assert sent == x.flushed < made  # inline: every frame handed to the codec was sent
        x.channel.cancel()
        decodes.clear()
        sched.iterate()
        ch: Any = x.channel
        assert ch.finished and ch.end.reason is EndReason.CANCELLED
        assert decodes == []  # its end waited for no codec call
        assert ch.end.n_frames == sent == len(ch.codes) and not ch.problems
        assert _sample(engine, "moss_rt_cancel_dropped_frames_total") == made - sent
        kept = sched.retained.get("x")
        assert kept is not None and kept.codes.shape[0] == sent and kept.codec is not None
        assert kept.codec.frames == sent  # its stream decoded exactly what it sent
        np.testing.assert_array_equal(kept.codes, ch.codes)

        n = sent - 3
        retake = drive(engine, [spec("x.1", 7, 6, 2, text=TEXT, prefix_codes=ch.codes[:n], parent_take="x")])
        r = retake.channels["x.1"]
        assert r.end.reason is EndReason.MAX_FRAMES
        np.testing.assert_array_equal(r.codes[:3], ch.codes[n:])  # the model's exact seek: its frames again
        _assert_retake_exact(engine, ch.codes, n, r)


def test_a_take_cancelled_with_codec_calls_in_flight_ends_at_once_and_its_retake_waits_for_its_state(
    tiny_data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two takes stream one-frame chunks together; the codec is held in a call on both, and their next call is queued.
    A cancel of x ends it in the next round with what it sent (not what the held call is decoding); the queued call
    gives x's stream up (a padding row on the scratch slot in its place, so y's call keeps its shape) and x's codec
    state waits in ``draining`` for the held call only. A retake of x made meanwhile shares x's kept KV blocks at once
    but opens its codec state once that call is done: x's stream went one frame past what it sent, and the retake
    still continues from it exactly, from the round whose control saw that call done: its state opens before that
    round's step and it makes its first frame in it. y never notices."""
    decodes: list[list[int]] = []  # the decoder slots of each call's streams
    states_seen: list[set[int]] = []  # and which state objects they were
    hold, started, release = threading.Event(), threading.Event(), threading.Event()
    real = CodecBatcher.decode_pcm

    def decode_pcm(self: CodecBatcher, states: list[Any], chunks: list[np.ndarray], channels: list[int]) -> Any:
        decodes.append([s.slot for s in states])
        states_seen.append({id(s) for s in states})
        if hold.is_set():
            hold.clear()
            started.set()
            release.wait(30)
        return real(self, states, chunks, channels)

    monkeypatch.setattr(CodecBatcher, "decode_pcm", decode_pcm)
    with loaded_engine(engine_settings(tiny_data_dir, overlap=True, max_seq_len=512)) as engine:
        rounds = Rounds(engine)
        sched, worker, decoder = rounds.sched, rounds.sched.worker, rounds.sched.decoder
        x, y = rounds.add(spec("x", 7, 200, 1, text=TEXT), spec("y", 8, 200, 1, text=f"{TEXT} Again."))
        rounds.until(lambda: x.frames >= RAMP_FRAMES + 4)
        worker.drain()  # every frame made so far is sent
        assert x.sent == x.frames and y.sent == y.frames
        hold.set()
        sched.iterate()  # both make a frame; the call decoding it holds the codec
        assert started.wait(30)
        sched.iterate()  # the next one queues behind it
        assert worker.pending == 2 and x.sent == x.frames - 2
        state, slots = x.decoder, (x.decoder.slot, y.decoder.slot)  # type: ignore[union-attr]
        sent = x.sent
        y.channel.paused = True  # type: ignore[misc]  (y makes no call meanwhile: the bulk lane is full)
        x.channel.cancel()
        sched.iterate()
        ch: Any = x.channel
        assert ch.finished and ch.end.reason is EndReason.CANCELLED and ch.end.n_frames == sent == len(ch.codes)
        assert x in sched.draining and state is not None and not state.closed  # the held call still runs on it
        kept = sched.retained.get("x")
        assert kept is not None and kept.codec_pending and kept.codec is None and kept.codes.shape[0] == sent

        (r,) = rounds.add(spec("x.1", 7, 6, 2, text=TEXT, prefix_codes=ch.codes[:sent], parent_take="x"))
        sched.iterate()
        assert r in sched.preparing and r.codec_after is kept and r.decoder is None and r.reuse_path == "share"
        mark = len(decodes)
        assert decodes[mark - 1] == list(slots)  # the held call: x and y
        release.set()
        worker.drain()  # the held call and the one queued behind it are done
        assert r.codec_after is kept and x in sched.draining  # seen in the next round's control
        sched.iterate()
        assert x not in sched.draining and r.codec_after is None and r.decoder is not None
        assert r in sched.running and r.frames == sent + 1  # opened before the step, and stepped in it
        y.channel.paused = False  # type: ignore[misc]
        rounds.until(lambda: r.channel.finished and not sched.draining)
        assert decodes[mark] == [decoder.max_streams, slots[1]]  # the queued call: x's row withdrawn, same shape
        assert all(id(state) not in seen for seen in states_seen[mark:])  # nothing more was decoded on x's state
        assert kept.codec is not None and kept.codec.frames == sent + 1  # the held call decoded one unsent frame
        assert _sample(engine, "moss_rt_codec_states_total", source="shared") == 1
        rc: Any = r.channel
        assert rc.end.reason is EndReason.MAX_FRAMES
        _assert_retake_exact(engine, ch.codes, sent, rc)
        y.channel.cancel()
        rounds.until(lambda: y.channel.finished and not sched.draining)
        assert not y.channel.problems  # type: ignore[attr-defined]
        assert decoder.free_slots == decoder.max_streams


def test_first_chunks_go_in_the_priority_lane_and_bulk_calls_stay_short(tiny_data_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Three directors' takes and three script lines (batch work), chunks of 4, bulk calls of at most 2 streams: every
    call is one lane; directors' chunks of their ramp (first audio and the one-frame chunks after it) go in priority
    calls, nothing else does (a batch take's ramp neither); bulk calls hold equal-length chunks of at most 2 streams.
    Every take's audio is still the whole-clip decode of its codes."""
    calls: list[list[tuple[str, int, bool]]] = []
    lengths: dict[str, list[int]] = {}
    real = CodecCalls.decode_and_push

    def decode_and_push(self: CodecCalls, chunks: list[Chunk]) -> None:
        calls.append([(c.take.take_id, c.first_frame, c.priority) for c in chunks])
        for c in chunks:
            lengths.setdefault(c.take.take_id, []).append(int(c.codes.shape[0]))
        real(self, chunks)

    patience: dict[tuple[str, ...], float | None] = {}
    real_call = CodecCalls.codec_call

    def codec_call(self: CodecCalls, run: Any, chunks: list[Chunk]) -> CodecCall:
        made = real_call(self, run, chunks)
        patience[tuple(c.take.take_id for c in chunks)] = made.patience_s
        return made

    monkeypatch.setattr(CodecCalls, "decode_and_push", decode_and_push)
    monkeypatch.setattr(CodecCalls, "codec_call", codec_call)
    settings = engine_settings(tiny_data_dir, overlap=False, codec_call_streams=2, codec_batch_patience_ms=300.0)
    with loaded_engine(settings) as engine:
        specs = [spec(f"d{i}", i, 20, 4, text=f"{TEXT} Director {i}.") for i in range(3)]
        specs += [spec(f"b{i}", 10 + i, 20, 4, text=f"{TEXT} Line {i}.", priority=TakePriority.BATCH)
                  for i in range(3)]
        driven = drive(engine, specs)
        priority_calls = [c for c in calls if c[0][2]]
        bulk_calls = [c for c in calls if not c[0][2]]
        assert all(len({lane for _, _, lane in call}) == 1 for call in calls)  # one lane a call
        assert priority_calls and bulk_calls
        for take, frame, lane in [chunk for call in calls for chunk in call]:
            assert lane is (take.startswith("d") and frame < RAMP_FRAMES), (take, frame, lane)
        ramp = {(take, frame) for call in priority_calls for take, frame, _ in call}
        assert {(f"d{i}", f) for i in range(3) for f in range(4)} <= ramp  # first audio and one-frame chunks
        assert max(len(call) for call in bulk_calls) == 2
        # A render's chunks never share a call with a listened stream's (3 + 3 streams in calls of 2 would mix), and
        # their calls wait longer behind directors' first chunks; the others have the worker's patience.
        assert all(len({take[0] for take, _, _ in call}) == 1 for call in bulk_calls)
        assert {p for takes, p in patience.items() if takes[0].startswith("b")} == {0.3}
        assert {p for takes, p in patience.items() if takes[0].startswith("d")} == {None}
        # A script line has no listener waiting for its first sound: no one-frame ramp, whole chunks on the shared
        # cadence (its first one shorter to get in phase, its last what is left).
        for i in range(3):
            assert sum(n < 4 for n in lengths[f"b{i}"][1:-1]) == 0 and lengths[f"b{i}"].count(1) <= 2, lengths
            assert lengths[f"d{i}"][:4] == [1, 1, 1, 1]
        assert _sample(engine, "moss_rt_codec_calls_total", lane="priority") == len(priority_calls)
        assert _sample(engine, "moss_rt_codec_calls_total", lane="bulk") == len(bulk_calls)
        for take_id, ch in driven.channels.items():
            assert not ch.problems and ch.end.reason is EndReason.MAX_FRAMES, take_id
            assert np.abs(_pcm(ch.pcm) - _whole(engine, ch.codes)).max() <= 1, take_id


def test_a_first_chunk_runs_ahead_of_queued_bulk_calls(tiny_data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A take streams steady one-frame chunks (bulk calls); one of its calls holds the codec and the next is queued.
    A director's new take arrives: its first chunk (priority lane) is decoded right after the held call, before the
    queued bulk call that was handed over earlier."""
    order: list[tuple[str, ...]] = []
    hold, started, release = threading.Event(), threading.Event(), threading.Event()
    real = CodecCalls.decode_and_push

    def decode_and_push(self: CodecCalls, chunks: list[Chunk]) -> None:
        order.append(tuple(c.take.take_id for c in chunks))
        if hold.is_set():
            hold.clear()
            started.set()
            release.wait(30)
        real(self, chunks)

    monkeypatch.setattr(CodecCalls, "decode_and_push", decode_and_push)
    with loaded_engine(engine_settings(tiny_data_dir, overlap=True, max_seq_len=512)) as engine:
        rounds = Rounds(engine)
        sched, worker = rounds.sched, rounds.sched.worker
        (a,) = rounds.add(spec("a", 1, 200, 1, text=TEXT))
        rounds.until(lambda: a.frames >= RAMP_FRAMES + 2)
        worker.drain()
        hold.set()
        sched.iterate()
        assert started.wait(30)
        sched.iterate()  # a's next call queues behind the held one
        a.channel.paused = True  # type: ignore[misc]  (the bulk lane is full: a makes no call meanwhile)
        (b,) = rounds.add(spec("b", 2, 6, 2, text=f"{TEXT} A director cuts in."))
        rounds.until(lambda: b.flushed > 0)  # its first chunk is handed over
        assert worker.pending == 3
        order.clear()
        release.set()
        a.channel.paused = False  # type: ignore[misc]
        rounds.until(lambda: b.channel.finished)
        # b's first chunk comes next, ahead of a's bulk call queued before it (b's next ramp chunks, priority too, may
        # also pass that bulk call if they are handed over before the worker takes its next call).
        assert order[0] == ("b",) and ("a",) in order, order
        a.channel.cancel()
        rounds.until(lambda: a.channel.finished and not sched.draining)
        assert not a.channel.problems and not b.channel.problems  # type: ignore[attr-defined]


@pytest.mark.parametrize("share", [0.5, 0.25])
def test_batch_rows_never_share_a_directors_prefill_pass_and_stay_small_while_directors_work(
    tiny_data_dir: Path, share: float,
) -> None:
    """A director's take streams while script lines (batch work) prefill long prompts in pieces: with a director about,
    a pass of batch rows alone holds at most ``batch_pass_share`` of the streaming budget's rows (the default
    quarter, or half); a new director's take arrives and its rows go in the very next pass, alone (no batch rows ride
    along and make it longer)."""
    settings = engine_settings(tiny_data_dir, overlap=False, max_slots=8, prefill_chunk=64, prefill_stream_rows=256,
                               prompt_cache=False, max_seq_len=1024, batch_pass_share=share)
    with loaded_engine(settings) as engine:
        rounds = Rounds(engine)
        sched = rounds.sched
        runner: Any = engine._runner
        passes: list[tuple[list[str], int]] = []  # (take ids, padded rows) of each pass
        real = runner.prefill_batch

        def prefill_batch(requests: list[Any]) -> int:
            by_slot = {t.model_slot: t.take_id for t in sched.preparing}
            ids = [by_slot[r.slot] for r in requests]
            passes.append((ids, len(requests) * max(len(r.rows) for r in requests)))
            return real(requests)

        runner.prefill_batch = prefill_batch
        (d0,) = rounds.add(spec("d0", 1, 200, 4, text=TEXT))
        rounds.until(lambda: d0.frames >= 2)
        long_text = " ".join([TEXT] * 6)
        lines = rounds.add(*[spec(f"b{i}", 10 + i, 6, 4, text=f"{long_text} Line {i}.", priority=TakePriority.BATCH)
                             for i in range(4)])
        rounds.until(lambda: len(passes) >= 2)
        (d1,) = rounds.add(spec("d1", 2, 8, 4, text=f"{TEXT} A second director."))
        before = len(passes)
        sched.iterate()
        assert passes[before][0] == ["d1"], passes[before:]  # the next pass is the director's, alone
        rounds.until(lambda: all(t.channel.finished for t in [d1, *lines]))
        assert all(t.channel.end.reason is EndReason.MAX_FRAMES for t in [d1, *lines])  # type: ignore[attr-defined]
        batch_passes = [rows for ids, rows in passes if all(i.startswith("b") for i in ids)]
        assert batch_passes and max(batch_passes) <= 256 * share  # the share of 256 while a director streams
        assert all(len({i[0] for i in ids}) == 1 for ids, _ in passes)  # never directors and lines together
        d0.channel.cancel()
        rounds.until(lambda: d0.channel.finished)


def test_a_barge_in_start_is_admitted_ahead_of_queued_new_takes(tiny_data_dir: Path) -> None:
    """Every slot is taken and new takes wait; a director cuts in on a streaming socket (a ``start`` flagged
    ``barge_in`` by the session): when a slot frees, it goes before the new takes queued earlier."""
    with loaded_engine(engine_settings(tiny_data_dir, overlap=False, max_slots=2)) as engine:
        rounds = Rounds(engine)
        sched = rounds.sched
        busy = rounds.add(*[spec(f"s{i}", i, 200, 4, text=f"{TEXT} {i}.") for i in range(2)])
        rounds.until(lambda: all(t.frames >= 1 for t in busy))
        queued = rounds.add(*[spec(f"n{i}", 10 + i, 4, 4, text=f"{TEXT} New {i}.") for i in range(2)])
        (cut,) = rounds.add(spec("cut", 20, 4, 4, text=f"{TEXT} Cut in.", barge_in=True))
        assert cut.admission_class == 0 < queued[0].admission_class
        busy[0].channel.cancel()
        sched.iterate()
        assert [t.take_id for t in sched.waiting] == ["n0", "n1"] and cut in [*sched.preparing, *sched.running]
        for take in busy[1:]:
            take.channel.cancel()
        rounds.until(lambda: all(t.channel.finished for t in [*queued, cut]))


def test_interactive_takes_are_admitted_before_the_step_and_one_with_its_whole_prompt_kept_runs_in_it(
    tiny_data_dir: Path,
) -> None:
    """While a take streams, a director's take whose whole prompt is kept from an earlier take (nothing to prefill)
    makes its first frame in the round it reached the engine in: it is admitted before that round's step and runs in
    it (before: admitted after the step, its first frame a round later). A script line that arrives with it is
    admitted after the step, as before, and has no frame yet; a director's take with rows to prefill is admitted
    before the step and prefilled after it (no frame yet either)."""
    with loaded_engine(engine_settings(tiny_data_dir, overlap=False)) as engine:
        rounds = Rounds(engine)
        sched = rounds.sched
        (done,) = rounds.add(spec("first", 1, 2, 1, text=TEXT))
        rounds.until(lambda: done.channel.finished)
        (busy,) = rounds.add(spec("busy", 2, 200, 4, text=f"{TEXT} Busy."))
        rounds.until(lambda: busy.frames >= 2)
        again, new = rounds.add(spec("again", 3, 4, 1, text=TEXT), spec("new", 4, 4, 1, text=f"{TEXT} New line."))
        (line,) = rounds.add(spec("line", 5, 4, 4, text=TEXT, priority=TakePriority.BATCH))
        before = busy.frames
        waiting_at_step: list[list[str]] = []
        real_step = sched._step

        def step() -> bool:
            waiting_at_step.append([t.take_id for t in sched.waiting])
            return real_step()

        sched._step = step  # type: ignore[method-assign]
        sched.iterate()
        sched._step = real_step  # type: ignore[method-assign]
        assert waiting_at_step == [["line"]]  # both directors' takes were admitted before the step, the line was not
        assert busy.frames == before + 1
        assert again in sched.running and again.frames == 1  # admitted before the step, and stepped in it
        assert new in [*sched.preparing, *sched.running] and new.frames == 0  # prefilled after the step
        assert line not in sched.waiting and line.frames == 0  # batch work: admitted after the step
        busy.channel.cancel()
        rounds.until(lambda: all(t.channel.finished for t in (busy, again, new, line)))
        for take in (again, new, line):
            assert take.channel.end.reason is EndReason.MAX_FRAMES and not take.channel.problems  # type: ignore[attr-defined]


def test_a_replaced_takes_end_goes_out_after_its_retakes_admission_and_before_the_step(tiny_data_dir: Path) -> None:
    """A director seeks: the take streaming is cancelled and its retake submitted at once. In the next round the take
    ends and its retake (sharing its cache and codec state) is admitted; the take's ``end`` reaches its channel after
    that admission and before the round's step (before: pushed during the cancel, so the web server's work for it ran
    beside the admissions). A cancel with nothing admitted behind it still ends in that round. Nothing is lost: the
    end carries the frames that were sent, and the retake decodes exactly."""
    with loaded_engine(engine_settings(tiny_data_dir, overlap=False)) as engine:
        rounds = Rounds(engine)
        sched = rounds.sched
        (x,) = rounds.add(spec("x", 7, 200, 4, text=TEXT))
        rounds.until(lambda: x.sent >= RAMP_FRAMES + 4)
        seen_at_end: list[tuple[str, int]] = []  # the retake's phase and frames when x's end was pushed
        steps_at_end: list[int] = []
        real_push = x.channel.push
        retake: list[Any] = []

        def push(event: Any) -> None:
            if isinstance(event, TakeFinished):
                seen_at_end.append((retake[0].phase.value, retake[0].frames))
                steps_at_end.append(sched.steps)
            real_push(event)

        x.channel.push = push  # type: ignore[method-assign]
        x.channel.cancel()
        n = x.sent
        codes = np.asarray(x.channel.codes)
        retake.extend(rounds.add(spec("x.1", 8, 6, 2, text=TEXT, prefix_codes=codes[:n], parent_take="x")))
        steps = sched.steps
        sched.iterate()
        (r,) = retake
        assert seen_at_end == [("running", n)]  # admitted (and ready to step) when the end went out, not yet stepped
        assert steps_at_end == [steps] and sched.steps == steps + 1 and r.frames == n + 1  # the step came after
        assert x.channel.end.reason is EndReason.CANCELLED and x.channel.end.n_frames == n  # type: ignore[attr-defined]
        assert r.codec_source.value == "shared"
        rounds.until(lambda: r.channel.finished)
        _assert_retake_exact(engine, codes, n, r.channel)
        (y,) = rounds.add(spec("y", 9, 200, 4, text=TEXT))
        rounds.until(lambda: y.sent >= 2)
        y.channel.cancel()
        sched.iterate()
        assert y.channel.finished and y.channel.end.reason is EndReason.CANCELLED  # type: ignore[attr-defined]


def test_bulk_calls_are_short_while_a_director_waits_for_a_first_sound(tiny_data_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty script lines share one bulk call per chunk (the default allows 255 streams); once a director's take is
    waiting, preparing or in its ramp, their calls hold at most STARTING_CALL_STREAMS streams (the director's first
    chunks wait for at most one short call), and after its ramp they are whole again."""
    from moss_rt.engine import codec_calls

    monkeypatch.setattr(codec_calls, "STARTING_CALL_STREAMS", 4)
    bulk_calls: list[tuple[int, bool]] = []
    real = CodecCalls.pieces

    def pieces(self: CodecCalls, chunks: list[Chunk], *, bulk: bool, starting: bool = False) -> list[list[Chunk]]:
        made = real(self, chunks, bulk=bulk, starting=starting)
        if bulk:
            bulk_calls.extend((len(piece), starting) for piece in made)
        return made

    monkeypatch.setattr(CodecCalls, "pieces", pieces)
    settings = engine_settings(tiny_data_dir, overlap=False, max_seq_len=256, max_slots=24, max_queue=24,
                               batch_share=1.0)
    with loaded_engine(settings) as engine:
        rounds = Rounds(engine)
        lines = rounds.add(*[spec(f"b{i}", i, 48, 4, text=f"{TEXT} Line {i}.", priority=TakePriority.BATCH)
                             for i in range(20)])
        rounds.until(lambda: all(t.flushed >= 8 for t in lines))
        assert max(n for n, _ in bulk_calls) == 20  # alone: one call for every line's chunk
        bulk_calls.clear()
        (d,) = rounds.add(spec("d", 99, 24, 4, text=f"{TEXT} A director."))
        rounds.until(lambda: not d.in_ramp)
        during = [n for n, starting in bulk_calls if starting]
        assert during and max(during) <= 4
        bulk_calls.clear()
        rounds.until(lambda: d.channel.finished)
        assert max(n for n, starting in bulk_calls if not starting) > 4
        for take in [*lines, d]:
            take.channel.cancel()
        rounds.until(lambda: all(t.channel.finished for t in [*lines, d]) and not rounds.sched.draining)


def test_a_round_admits_a_bounded_number_of_script_lines_and_every_director(tiny_data_dir: Path) -> None:
    """Twenty script lines posted at once are admitted BATCH_ADMITS_PER_ROUND a round (a director arriving meanwhile
    waits for a short round, not for every line's admission), while twenty directors' takes all start in one round;
    the rounds' parts are timed in /metrics."""
    from moss_rt.engine.scheduler import BATCH_ADMITS_PER_ROUND

    settings = engine_settings(tiny_data_dir, overlap=False, max_seq_len=256, max_slots=48, max_queue=48,
                               batch_share=1.0)
    with loaded_engine(settings) as engine:
        rounds = Rounds(engine)
        sched = rounds.sched
        lines = rounds.add(*[spec(f"b{i}", i, 4, 4, text=f"{TEXT} Line {i}.", priority=TakePriority.BATCH)
                             for i in range(20)])
        sched.iterate()
        assert sum(t in sched.waiting for t in lines) == 20 - BATCH_ADMITS_PER_ROUND
        sched.iterate()
        assert not any(t in sched.waiting for t in lines)
        directors = rounds.add(*[spec(f"d{i}", 50 + i, 4, 4, text=f"{TEXT} Director {i}.") for i in range(20)])
        sched.iterate()
        assert not any(t in sched.waiting for t in directors)
        for take in [*lines, *directors]:
            take.channel.cancel()
        rounds.until(lambda: all(t.channel.finished for t in [*lines, *directors]) and not sched.draining)
        for phase in ("control", "step", "flush", "admit", "prepare"):
            assert _sample(engine, "moss_rt_round_phase_seconds_sum", phase=phase) > 0, phase
        assert _sample(engine, "moss_rt_round_seconds_count") >= 3
