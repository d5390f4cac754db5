"""Directing at scale (issue 22) on the tiny model (CPU): retakes from shared codec state, batched rebuilds, the
order of a round (interactive control first, batch work last), and every block coming back.

Scheduler-level tests drive the real engine's parts round by round (tests/engine/harness.py), with the codec inline
where the order of events matters, so what they check does not depend on timing. The tiny codec's windows are 2
frames at every stage and its rings about 10 frames, so a retake shares its parent's codec state only from a frame
close to the parent's end; from further back it is rebuilt from the codes.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from moss_rt.audio import to_int16_pcm
from moss_rt.engine.base import EndReason, TakeFinished, TakePriority
from moss_rt.engine.codec_batch import CodecBatcher
from moss_rt.engine.moss import MossEngine
from moss_rt.engine.scheduler import Scheduler
from moss_rt.protocol import FRAME_SAMPLES
from tests.engine.harness import Driven, Rounds, drive, engine_settings, loaded_engine, spec

TEXT = "The rain had stopped an hour ago, and the street was quiet."


def _sample(engine: MossEngine, name: str, **labels: str) -> float:
    return engine.metrics.registry.get_sample_value(name, labels or None) or 0.0


def _pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.int32)


def _whole(engine: MossEngine, codes: np.ndarray, channels: int = 1) -> np.ndarray:
    """The whole-clip decode of ``codes`` as the int16 PCM a take streams."""
    codec: Any = engine._codec
    with torch.no_grad():
        audio = codec.decode(torch.from_numpy(np.ascontiguousarray(codes))[None])[0].float().numpy()
    return _pcm(to_int16_pcm(audio, channels))


def _ok(driven: Driven) -> None:
    for take_id, ch in driven.channels.items():
        assert not ch.problems, (take_id, ch.problems)


def _forget_codec_state(engine: MossEngine, take_id: str) -> None:
    """Give back a kept take's codec state (as when room is needed), keeping its KV blocks."""
    sched: Scheduler = engine._scheduler  # type: ignore[assignment]
    item = sched.retained.get(take_id)
    assert item is not None and item.codec is not None
    sched.decoder.drop(item.codec)
    item.codec = None


def test_a_retake_from_shared_codec_blocks_equals_the_uninterrupted_take_a_rebuild_and_the_whole_clip(
    tiny_data_dir: Path,
) -> None:
    """A take, then a retake of it from frame n with its own seed (so the same frames come again): its codec state
    continues from the parent's kept blocks with nothing decoded, and its PCM from n is the parent's, bit for bit
    (same one-frame chunks). The same retake with the parent's codec state given back is rebuilt from the codes
    (one batched call per 8 frames) and gives the same audio to the last bit of int16; both equal the whole-clip
    decode of the codes the same way. Frames before n are the parent's codes (rendered PCM: the same codes)."""
    length, n = 24, 20  # within the tiny ring of the parent's end: shareable
    with loaded_engine(engine_settings(tiny_data_dir, overlap=False)) as engine:
        first = drive(engine, [spec("a", 3, length, 1, text=TEXT)])
        _ok(first)
        a = first.channels["a"]
        assert a.end.reason is EndReason.MAX_FRAMES and len(a.codes) == length
        parent_pcm = _pcm(a.pcm)

        calls_before = _sample(engine, "moss_rt_codec_rebuild_calls_total")
        shared = drive(engine, [spec("a.1", 3, length - n, 1, text=TEXT, prefix_codes=a.codes[:n],
                                     parent_take="a")])
        _ok(shared)
        b = shared.channels["a.1"]
        assert _sample(engine, "moss_rt_codec_states_total", source="shared") == 1
        assert _sample(engine, "moss_rt_codec_rebuild_calls_total") == calls_before  # nothing decoded again
        np.testing.assert_array_equal(b.codes, a.codes[n:])  # the model's exact seek: the same frames again
        np.testing.assert_array_equal(_pcm(b.pcm), parent_pcm[n * FRAME_SAMPLES :])  # bit for bit

        _forget_codec_state(engine, "a")
        rebuilt = drive(engine, [spec("a.2", 3, length - n, 1, text=TEXT, prefix_codes=a.codes[:n],
                                      parent_take="a")])
        _ok(rebuilt)
        c = rebuilt.channels["a.2"]
        assert _sample(engine, "moss_rt_codec_states_total", source="rebuilt") == 1
        assert _sample(engine, "moss_rt_codec_rebuild_calls_total") - calls_before == 3  # 8 + 8 + 4 frames
        np.testing.assert_array_equal(c.codes, a.codes[n:])
        whole = _whole(engine, a.codes)[n * FRAME_SAMPLES :]
        for got in (_pcm(b.pcm), _pcm(c.pcm)):
            assert np.abs(got - whole).max() <= 1  # float rounding of other chunkings, at most one step of int16
        assert np.abs(_pcm(c.pcm) - _pcm(b.pcm)).max() <= 1


def test_a_burst_of_retakes_is_rebuilt_in_batched_calls(tiny_data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Six retakes from frame 10 of takes that went on to 30 frames (past what their rings keep): their codec
    states are rebuilt together, every take's next 8 frames in one call: 2 calls (8 + 2 frames), not one unit per
    take (before: 6 units, 12 decoder forwards on the engine's thread). Their audio equals the whole-clip decode."""
    advances: list[int] = []
    real = CodecBatcher.advance

    def advance(self: CodecBatcher, states: list[Any], chunks: list[np.ndarray]) -> None:
        advances.append(len(states))
        real(self, states, chunks)

    monkeypatch.setattr(CodecBatcher, "advance", advance)
    n, length = 10, 30
    with loaded_engine(engine_settings(tiny_data_dir, overlap=True)) as engine:
        parents = drive(engine, [spec(f"p{i}", i, length, 4, text=f"{TEXT} Line {i}.") for i in range(6)])
        _ok(parents)
        codes = {k: ch.codes for k, ch in parents.channels.items()}
        retakes = drive(engine, [
            spec(f"p{i}.r", 100 + i, 6, 2, text=f"{TEXT} Line {i}.", prefix_codes=codes[f"p{i}"][:n],
                 parent_take=f"p{i}")
            for i in range(6)
        ])
        _ok(retakes)
        assert advances == [6, 6]
        assert _sample(engine, "moss_rt_codec_rebuild_calls_total") == 2
        assert _sample(engine, "moss_rt_codec_rebuild_frames_total") == 6 * n
        assert _sample(engine, "moss_rt_codec_states_total", source="rebuilt") == 6
        for i in range(6):
            ch = retakes.channels[f"p{i}.r"]
            assert ch.end.reason is EndReason.MAX_FRAMES
            full = np.concatenate([codes[f"p{i}"][:n], ch.codes])
            assert np.abs(_pcm(ch.pcm) - _whole(engine, full)[n * FRAME_SAMPLES :]).max() <= 1


def test_a_cancel_is_handled_before_the_next_prefill_pass(tiny_data_dir: Path) -> None:
    """A take streams while a burst of prompts goes in as one small pass a round. The director cancels in the middle
    of a pass: the take stops, its frames go to the codec and its end goes out before the next pass starts. With
    nothing streaming, a round prepares everything at once; a take cancelled during one of those passes ends
    before the next one too, and is not prefilled any further."""
    settings = engine_settings(tiny_data_dir, overlap=False, prefill_chunk=16, prefill_stream_rows=32)
    with loaded_engine(settings) as engine:
        rounds = Rounds(engine)
        runner: Any = engine._runner
        (x,) = rounds.add(spec("x", 1, 200, 4, text=TEXT))
        rounds.until(lambda: x.frames >= 3)
        log: list[tuple[str, Any]] = []
        real = runner.prefill_batch

        def prefill_batch(requests: list[Any]) -> int:
            log.append(("pass", sorted(r.slot for r in requests)))
            if len([e for e in log if e[0] == "pass"]) == 2:
                x.channel.cancel()  # the director's cancel arrives while this pass runs
            return real(requests)

        runner.prefill_batch = prefill_batch
        x_push = x.channel.push

        def push(event: Any) -> None:
            if isinstance(event, TakeFinished):
                log.append(("end", "x"))
            x_push(event)

        x.channel.push = push  # type: ignore[method-assign]
        burst = rounds.add(*[spec(f"b{i}", 10 + i, 6, 4, text=f"{TEXT} Take {i} of the burst.") for i in range(4)])
        rounds.until(lambda: x.channel.finished and all(t.channel.finished for t in burst))
        kinds = [k for k, _ in log]
        second = kinds.index("pass", kinds.index("pass") + 1)
        assert kinds[second + 1] == "end", log  # the cancelled take ended before any further pass
        assert x.channel.end.reason is EndReason.CANCELLED  # type: ignore[attr-defined]
        assert sum(c.n_frames for c in x.channel.chunks) == x.channel.end.n_frames  # type: ignore[attr-defined]

        # Nothing streaming: one round runs every pass, unless a cancel comes in between.
        log.clear()
        burst = rounds.add(*[spec(f"c{i}", 20 + i, 6, 4, text=f"{TEXT} Another take, number {i}.")
                             for i in range(3)])
        victim = burst[1]
        victim_slot: list[int | None] = []

        def prefill_cancelling(requests: list[Any]) -> int:
            log.append(("pass", sorted(r.slot for r in requests)))
            if len(log) == 1:
                victim_slot.append(victim.model_slot)
                victim.channel.cancel()
            return real(requests)

        runner.prefill_batch = prefill_cancelling
        engine._scheduler.iterate()  # type: ignore[union-attr]
        assert victim.channel.finished and victim.channel.end.reason is EndReason.CANCELLED  # type: ignore[attr-defined]
        assert len(log) == 1  # the round stopped after the pass the cancel came in
        rounds.until(lambda: all(t.channel.finished for t in burst))
        assert victim_slot[0] is not None and len(log) > 1
        assert all(victim_slot[0] not in slots for _, slots in log[1:])  # none of its rows went in after the cancel


def test_batch_work_gets_what_interactive_takes_leave(tiny_data_dir: Path) -> None:
    """Script renders (BATCH takes) submitted before two directors' takes: the directors are admitted first and
    their prompts fill the first pass; batch work holds at most its share of the slots (half of 4), waits while
    that is full, and still runs to its end."""
    settings = engine_settings(tiny_data_dir, overlap=False, max_slots=4, prefill_max_rows=256, batch_share=0.5)
    with loaded_engine(settings) as engine:
        rounds = Rounds(engine)
        renders = rounds.add(*[spec(f"r{i}", i, 8, 4, text=f"{TEXT} Script line {i}.", priority=TakePriority.BATCH)
                               for i in range(4)])
        directors = rounds.add(*[spec(f"d{i}", 50 + i, 8, 4, text=f"{TEXT} A director's line {i}.")
                                 for i in range(2)])
        sched = rounds.sched
        sched.iterate()
        admitted = {t.take_id for t in [*sched.preparing, *sched.running]}
        assert admitted == {"d0", "d1", "r0", "r1"}, admitted  # the directors first, then half the slots
        assert [t.take_id for t in sched.waiting] == ["r2", "r3"]
        everyone = [*directors, *renders]
        started: dict[str, int] = {}  # the round each take began to stream
        most_batch, n = 0, 0

        def done() -> bool:
            nonlocal most_batch, n
            n += 1
            most_batch = max(most_batch, sched._batch_count())
            for take in sched.running:
                started.setdefault(take.take_id, n)
            return all(t.channel.finished for t in everyone)

        rounds.until(done)
        assert most_batch == 2  # never more than its share of the slots
        assert max(started["d0"], started["d1"]) <= min(started[f"r{i}"] for i in range(4)), started
        firsts = {t.take_id: t.first_audio for t in everyone}
        assert max(firsts["d0"], firsts["d1"]) <= min(firsts[f"r{i}"] for i in range(4))  # type: ignore[type-var]
        for take in [*directors, *renders]:
            assert take.channel.end.reason is EndReason.MAX_FRAMES  # type: ignore[attr-defined]


def test_a_retake_cancelled_while_its_rebuild_runs_ends_at_once_and_gives_its_state_back_after_the_call(
    tiny_data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A take in the round (one small prefill pass a round) and a codec call held until the test releases it: a retake
    with a new direction is cancelled while its prompt is still going in and the call rebuilding its codec state
    still runs on the codec worker. Its end goes out in the next round, with no audio; its codec state waits in
    ``draining`` and is given back only once that call is done (never closed under a running decode); the take in the
    same rebuild call goes on to its end."""
    closed_during: list[bool] = []
    started, release = threading.Event(), threading.Event()
    real = CodecBatcher.advance

    def slow_advance(self: CodecBatcher, states: list[Any], chunks: list[np.ndarray]) -> None:
        started.set()
        release.wait(30)  # the call runs until the test lets it finish
        real(self, states, chunks)
        closed_during.append(any(s.closed for s in states))

    monkeypatch.setattr(CodecBatcher, "advance", slow_advance)
    n, length = 8, 30  # one rebuild call (8 frames) holds both retakes
    settings = engine_settings(tiny_data_dir, overlap=True, prefill_chunk=16, prefill_stream_rows=16)
    with loaded_engine(settings) as engine:
        parents = drive(engine, [spec(f"p{i}", i, length, 8, text=f"{TEXT} Line {i}.") for i in range(2)])
        _ok(parents)
        rounds = Rounds(engine)
        (streaming,) = rounds.add(spec("s", 9, 60, 4, text=TEXT))
        rounds.until(lambda: streaming.frames >= 4 and streaming.pending == 0)
        # Its client falls behind: it stays in the round (one pass a round) but makes no codec calls meanwhile, so
        # the blocked rebuild call is the only one (the scheduler would otherwise wait for the codec's queue).
        streaming.channel.paused = True  # type: ignore[misc]
        victim, other = rounds.add(*[
            spec(f"p{i}.r", 100 + i, 6, 2, text=f"{TEXT} Line {i}.", instruction="Slower, darker.",
                 prefix_codes=parents.channels[f"p{i}"].codes[:n], parent_take=f"p{i}")
            for i in range(2)
        ])
        # Rounds until the rebuild call is handed over, then no more rounds until the worker has started it: rounds
        # run meanwhile (a loaded machine's codec thread can start late) would finish the victim's prompt.
        rounds.until(lambda: victim.rebuild_left == 0 and other.rebuild_left == 0)
        assert started.wait(30)
        assert victim in rounds.sched.preparing  # its prompt is still going in
        state = victim.decoder
        victim.channel.cancel()
        rounds.sched.iterate()
        assert victim.channel.finished and victim.channel.end.reason is EndReason.CANCELLED  # type: ignore[attr-defined]
        assert victim in rounds.sched.draining and state is not None and not state.closed  # the call still runs
        release.set()
        streaming.channel.paused = False  # type: ignore[misc]
        rounds.until(lambda: not rounds.sched.draining and other.channel.finished and streaming.channel.finished)
        assert state.closed
        assert not victim.channel.chunks and not victim.channel.problems  # type: ignore[attr-defined]
        assert other.channel.end.reason is EndReason.MAX_FRAMES  # type: ignore[attr-defined]
        assert closed_during and not any(closed_during)
        assert engine._decoder.free_slots == engine._decoder.max_streams  # type: ignore[attr-defined]


def test_a_retake_that_reaches_the_engine_before_its_parent_ended_waits_for_the_end_and_shares_its_state(
    tiny_data_dir: Path,
) -> None:
    """A director's socket submits a retake together with the stop of the take it replaces (web/ws: early
    admission), so the retake can be up for admission in the round its parent's cancel arrived in, after that
    round's control. It is not admitted beside its live parent: it waits one round, the parent ends (control), and
    the retake shares the parent's kept cache and codec state, making the parent's frames again from the seek
    point, bit for bit (admitted next to the live parent it would find nothing kept and rebuild everything). Needing
    no preparation, it is admitted before that round's step and makes its first frame in it (before: a round
    later, after the step and the hand-over to the codec of everyone else's frames)."""
    with loaded_engine(engine_settings(tiny_data_dir, overlap=False)) as engine:
        rounds = Rounds(engine)
        sched = rounds.sched
        (parent,) = rounds.add(spec("a", 3, 200, 1, text=TEXT))
        rounds.until(lambda: parent.frames >= 24 and parent.pending == 0)
        made = parent.frames
        n = made - 2  # within the tiny codec's ring of the parent's end: shareable
        codes = parent.channel.codes  # type: ignore[attr-defined]
        assert len(codes) == made
        retake: list[Any] = []
        real_control = sched._control

        def control_then_the_stop_and_the_retake_arrive() -> bool:
            worked = real_control()
            if not retake:  # after this round's control: the cancel and the retake come in mid-round
                parent.channel.cancel(EndReason.REPLACED)
                retake.extend(rounds.add(spec("a.1", 3, 2, 1, text=TEXT, prefix_codes=codes[:n], parent_take="a")))
            return worked

        sched._control = control_then_the_stop_and_the_retake_arrive  # type: ignore[method-assign]
        sched.iterate()
        (r,) = retake
        assert r in sched.waiting and parent in sched.running  # not admitted beside its live parent
        sched.iterate()
        assert parent.channel.finished and parent.channel.end.reason is EndReason.REPLACED  # type: ignore[attr-defined]
        assert r in sched.running and r.frames == n + 1  # its first frame came from the round its parent ended in
        rounds.until(lambda: r.channel.finished)
        assert not parent.channel.problems and not r.channel.problems  # type: ignore[attr-defined]
        assert _sample(engine, "moss_rt_codec_states_total", source="shared") == 1
        assert _sample(engine, "moss_rt_codec_states_total", source="rebuilt") == 0
        assert _sample(engine, "moss_rt_seeks_total", path="share") == 1
        np.testing.assert_array_equal(r.channel.codes, codes[n:])  # type: ignore[attr-defined]
        parent_pcm = _pcm(parent.channel.pcm)  # type: ignore[attr-defined]  # (a frame more: its last round)
        np.testing.assert_array_equal(_pcm(r.channel.pcm), parent_pcm[n * FRAME_SAMPLES : made * FRAME_SAMPLES])  # type: ignore[attr-defined]
