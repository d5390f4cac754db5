"""The codec overlapped with the model steps (codec_overlap) on the tiny model (CPU): same audio as inline,
takes end after their last chunk, cancel/seek/disconnect/shutdown with decodes in flight, codec failures.

Scheduler-level tests drive the real engine's parts round by round (tests/engine/harness.py), so chunks and
batches are deterministic and "overlapped == inline" is checked bit for bit; server-level tests run the real
session flow (seek, disconnect) with a codec slowed down so that a decode is always in flight.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from moss_rt.client import DirectingClient
from moss_rt.engine.base import AudioChunk, EndReason, TakeFinished
from moss_rt.engine.codec_batch import CodecBatcher
from moss_rt.engine.codec_flow import HoldClock
from moss_rt.engine.moss import MossEngine
from moss_rt.engine.scheduler import Scheduler
from moss_rt.protocol import FRAME_SAMPLES
from tests.engine.harness import drive, engine_settings, loaded_engine, overlap_scenario, spec
from tests.engine.helpers import LONG, metrics, take_codes
from tests.helpers import run, wait_until

CODEC_THREAD = "moss-rt-codec"


@dataclass
class CodecWatch:
    """What the (slowed) batched decode saw: its threads and any state closed before or during a decode."""

    delay_s: float = 0.0
    # The worker's decodes wait (after the delay) until the scheduler holds a step back for room in the codec's bulk
    # lane, once: a codec slower than the model however fast the machine runs the model (wait_for_a_hold).
    until_held: bool = False
    held: threading.Event = field(default_factory=threading.Event)
    schedulers: list[Scheduler] = field(default_factory=list)
    threads: set[str] = field(default_factory=set)
    violations: list[str] = field(default_factory=list)
    calls: int = 0
    fail_when: Callable[[list[Any]], bool] | None = None


@pytest.fixture
def codec_watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[CodecWatch]:
    watch = CodecWatch()
    real = CodecBatcher.decode_pcm

    def decode_pcm(
        self: CodecBatcher, states: list[Any], chunks: list[np.ndarray], channels: list[int]
    ) -> list[bytes]:
        watch.threads.add(threading.current_thread().name)
        watch.calls += 1
        if any(s.closed for s in states):
            watch.violations.append("decode on a closed state")
        if watch.fail_when is not None and watch.fail_when(list(chunks)):
            raise RuntimeError("injected codec failure")
        if watch.delay_s:
            time.sleep(watch.delay_s)  # a slow codec: the scheduler runs ahead, decodes are in flight
        if watch.until_held and threading.current_thread().name == CODEC_THREAD:
            wait_for_a_hold(watch)
        out = real(self, states, chunks, channels)
        if any(s.closed for s in states):
            watch.violations.append("a state was closed while its decode ran")
        return out

    monkeypatch.setattr(CodecBatcher, "decode_pcm", decode_pcm)
    real_init, real_held = Scheduler.__init__, HoldClock.held

    def init(self: Scheduler, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        watch.schedulers.append(self)

    def held(self: HoldClock) -> None:
        real_held(self)
        watch.held.set()

    monkeypatch.setattr(Scheduler, "__init__", init)
    monkeypatch.setattr(HoldClock, "held", held)
    yield watch


def wait_for_a_hold(watch: CodecWatch) -> None:
    """Keep the codec's call until the scheduler has held a step back for codec room (the bulk lane full and a
    hand-over parked), unless a director's chunk waits in the priority lane (it must not wait behind a bulk call the
    test holds) or no stream is left to step. The bound only keeps a broken scheduler from hanging the test."""
    if not watch.schedulers:
        return  # the engine's warm-up, before its scheduler exists
    sched = watch.schedulers[-1]
    deadline = time.monotonic() + 60.0
    while not watch.held.is_set() and time.monotonic() < deadline:
        if sched.worker.handovers(True) or not any(not t.ending for t in list(sched.running)):
            return
        time.sleep(0.002)


def test_overlapped_codec_gives_the_same_codes_and_pcm_as_inline(tiny_data_dir, codec_watch) -> None:
    # Bulk calls of at most 2 streams: a round's chunks go in several calls, and the worker runs the priority lane's
    # first chunks ahead of queued bulk calls (overlapped); inline they run in the order given. The audio is the same.
    inline = overlap_scenario(tiny_data_dir, overlap=False, codec_call_streams=2)
    assert codec_watch.threads == {threading.current_thread().name}
    codec_watch.threads.clear()
    codec_watch.until_held = True  # slower than the model, however busy the machine: the bulk lane fills
    overlapped = overlap_scenario(tiny_data_dir, overlap=True, codec_call_streams=2)
    assert codec_watch.threads == {CODEC_THREAD}  # every decode on the worker (warm-up's included)
    assert not codec_watch.violations
    for take_id in ("a", "b", "c", "d", "e", "f", "c.share", "c.new"):
        assert overlapped[take_id] == inline[take_id], take_id
    ends = {k: v["end"] for k, v in inline.items() if not k.startswith("_")}
    assert all(reason in (EndReason.MAX_FRAMES, EndReason.DONE) for reason, _, _ in ends.values()), ends
    assert ends["d"][1] == 25 and ends["c.share"][1] == 6 + 12 and ends["c.new"][1] == 6 + 12
    assert overlapped["_seeks"] == inline["_seeks"] == {"share": 1.0, "reprefill": 1.0}
    # The slowed codec made the scheduler wait for it (bounded queue) only when overlapped; inline never waits. It
    # waited outside its rounds: a full bulk lane parked a hand-over and held the next steps back (codec_flow), and
    # the audio is still the inline audio, chunk for chunk.
    assert overlapped["_waits"] > 0 and inline["_waits"] == 0
    assert overlapped["_held"] > 0 and inline["_held"] == 0
    for result in (inline, overlapped):  # every take's codec state went back
        free, total = result["_free"]
        assert free == total


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlapped"])
def test_a_codec_failure_fails_only_the_takes_of_that_call(tiny_data_dir, codec_watch, overlap) -> None:
    # "a" sends 2-frame chunks after its ramp, "b" 1-frame then 5-frame ones: the first call made of 2-frame
    # chunks only holds "a" alone; it fails.
    failed: list[int] = []

    def fail_when(chunks: list[np.ndarray]) -> bool:
        if not failed and chunks and all(c.shape[0] == 2 for c in chunks):
            failed.append(len(chunks))
            return True
        return False

    codec_watch.fail_when = fail_when
    codec_watch.delay_s = 0.002
    with loaded_engine(engine_settings(tiny_data_dir, overlap=overlap)) as engine:
        driven = drive(engine, [spec("a", 1, 16, 2), spec("b", 2, 20, 5)])
        a, b = driven.channels["a"], driven.channels["b"]
        assert failed == [1]
        assert a.end.reason is EndReason.ERROR and "codec decode failed" in (a.end.error or "")
        assert a.chunks and sum(c.n_frames for c in a.chunks) < 16  # what was decoded before the failure
        assert b.end.reason is EndReason.MAX_FRAMES and b.end.n_frames == 20
        assert sum(c.n_frames for c in b.chunks) == 20 and not a.problems and not b.problems
        # The engine itself goes on: a later take streams normally.
        after = drive(engine, [spec("later", 3, 10, 2)])
        assert after.channels["later"].end.reason is EndReason.MAX_FRAMES
        assert sum(c.n_frames for c in after.channels["later"].chunks) == 10
        assert engine._decoder.free_slots == engine._decoder.max_streams  # type: ignore[attr-defined]
    assert not codec_watch.violations


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlapped"])
def test_cancel_while_its_chunk_is_decoded_ends_after_that_chunk(tiny_data_dir, codec_watch, overlap) -> None:
    codec_watch.delay_s = 0.02
    cancelled_in_flight: list[bool] = []

    def each_round(sched: Any, _round: int) -> None:
        for take in sched.running:
            if take.take_id == "x" and take.frames >= 6 and not cancelled_in_flight:
                cancelled_in_flight.append(not sched.worker.done(take.codec_seq))
                take.channel.cancel()

    with loaded_engine(engine_settings(tiny_data_dir, overlap=overlap)) as engine:
        driven = drive(engine, [spec("x", 7, 200, 1), spec("y", 8, 24, 4)], each_round=each_round)
        x, y = driven.channels["x"], driven.channels["y"]
        assert x.end.reason is EndReason.CANCELLED and x.end.n_frames < 200
        # Every frame made before the cancel reached the channel, in order, before the end.
        assert sum(c.n_frames for c in x.chunks) == x.end.n_frames and not x.problems
        assert y.end.reason is EndReason.MAX_FRAMES and sum(c.n_frames for c in y.chunks) == 24
        assert engine._decoder.free_slots == engine._decoder.max_streams  # type: ignore[attr-defined]
        # The take's cache was kept: a retake of it from a frame it made shares it, with the same continuation.
        n = 4
        retake = drive(engine, [spec("x.2", 7, 8, 2, text=spec("x", 7, 1, 1).text, prefix_codes=x.codes[:n],
                                      parent_take="x")]).channels["x.2"]
        assert retake.end.n_frames == n + 8
        made = min(x.end.n_frames, n + 8)
        np.testing.assert_array_equal(retake.codes[: made - n], x.codes[n:made])
    assert cancelled_in_flight == [overlap]  # overlapped, the cancel came while x's last chunk was decoding
    assert not codec_watch.violations


# ----------------------------------------------------------------------------- through a server


def test_seek_while_a_chunk_is_decoded_retakes_from_the_heard_frames(moss_server, codec_watch) -> None:
    codec_watch.delay_s = 0.03
    srv = moss_server(codec_overlap=True)
    n = 4

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            await client.start("Keep talking, I will stop you.", seed=21, max_new_tokens=80, chunk_frames=1, **LONG)
            first_pcm = bytearray()
            take_id = None
            while len(first_pcm) < 6 * FRAME_SAMPLES * 2:
                item = await client.receive()
                if isinstance(item, bytes):
                    first_pcm += item
                elif item.type == "start":
                    take_id = item["take"]
            assert take_id is not None
            await client.seek(take_id, n, seed=21)  # same seed: the retake continues exactly as the first went
            first_end = None
            while True:
                item = await client.receive()
                if isinstance(item, bytes):
                    first_pcm += item  # the first take's frames made before the seek still arrive
                elif item.type == "end":
                    first_end = item
                elif item.type == "seek":
                    ack = item
                    break
            assert first_end is not None and first_end["reason"] == "replaced"
            assert first_end["n_frames"] * FRAME_SAMPLES * 2 == len(first_pcm)
            second = await client.collect()
            assert second.take_id == ack["take"] and second.start["first_frame"] == n
            assert second.end["n_frames"] == n + 80
            a_codes, b_codes = take_codes(srv, take_id), take_codes(srv, second.take_id)
            made = first_end["n_frames"]
            np.testing.assert_array_equal(b_codes[:made], a_codes[:made])
            # Same frames decoded from a state rebuilt from the kept codes: equal up to chunk-shape rounding.
            a = np.frombuffer(bytes(first_pcm), "<i2")[n * FRAME_SAMPLES : made * FRAME_SAMPLES].astype(np.int32)
            b = np.frombuffer(bytes(second.pcm), "<i2")[: (made - n) * FRAME_SAMPLES].astype(np.int32)
            assert len(a) == len(b) > 0 and np.abs(a - b).max() <= 2
        await wait_until(lambda: srv.engine.active_count == 0, 5.0)

    run(scenario())
    assert CODEC_THREAD in codec_watch.threads and not codec_watch.violations


def test_disconnect_while_a_chunk_is_decoded_frees_the_slot(moss_server, codec_watch) -> None:
    codec_watch.delay_s = 0.03
    srv = moss_server(codec_overlap=True)

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            await client.start("Talk until I leave.", max_new_tokens=1000, chunk_frames=1, **LONG)
            while not isinstance(await client.receive(), bytes):
                pass
        await wait_until(lambda: srv.engine.active_count == 0, 5.0)
        frames = (await metrics(srv))["moss_rt_frames_total"]
        await asyncio.sleep(0.3)
        m = await metrics(srv)
        assert m["moss_rt_frames_total"] == frames  # nothing generates any more
        assert m['moss_rt_takes_total{reason="cancelled"}'] >= 1
        assert m["moss_rt_codec_overlap"] == 1.0 and m["moss_rt_codec_pending_calls"] == 0.0
        engine = srv.engine
        assert engine._decoder.free_slots == engine._decoder.max_streams

    run(scenario())
    assert not codec_watch.violations


def test_shutdown_with_decodes_in_flight_ends_every_take_and_leaves_no_thread(tiny_data_dir, codec_watch) -> None:
    codec_watch.delay_s = 0.03

    def alive(name: str) -> int:
        return sum(1 for t in threading.enumerate() if t.name == name)

    before = alive(CODEC_THREAD), alive("moss-rt-engine")

    async def scenario() -> None:
        engine = MossEngine(engine_settings(tiny_data_dir, overlap=True, max_seq_len=1024))
        await engine.start()
        worker = engine._codec_worker
        assert worker is not None and worker.alive and alive(CODEC_THREAD) == before[0] + 1
        channels = [await engine.submit(spec(f"s{i}", i, 600, 1)) for i in range(3)]
        events: list[list[Any]] = [[] for _ in channels]

        async def consume(i: int) -> None:
            async for event in channels[i]:
                events[i].append(event)

        tasks = [asyncio.create_task(consume(i)) for i in range(len(channels))]
        await wait_until(lambda: all(any(isinstance(e, AudioChunk) for e in ev) for ev in events), 30.0)
        await wait_until(lambda: worker.pending > 0, 5.0)  # a decode in flight right now
        await engine.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 10.0)
        for ev in events:
            end = ev[-1]
            assert isinstance(end, TakeFinished) and end.reason is EndReason.SHUTDOWN
            chunks = [e for e in ev if isinstance(e, AudioChunk)]
            assert [c.first_frame for c in chunks] == list(np.cumsum([0] + [c.n_frames for c in chunks[:-1]]))
            assert sum(c.n_frames for c in chunks) <= end.n_frames
        assert not worker.alive and engine._thread is not None and not engine._thread.is_alive()

    run(scenario())
    assert (alive(CODEC_THREAD), alive("moss-rt-engine")) == before
    assert not codec_watch.violations
