"""The real engine's parts (tiny model and codec) driven round by round from the test's thread, no server.

``loaded_engine`` runs MossEngine's own load and warm-up (so its codec worker is the one served), then
``drive`` feeds takes straight into its scheduler and calls ``iterate`` until they all ended. Everything
that decides chunks and batches is then deterministic: takes are added together, none is ever paused, and
rounds do not depend on wall time. That makes "the same with the codec overlapped or inline" checkable bit
for bit, which a server (takes arriving whenever their sockets do) cannot give.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moss_rt.audio import to_int16_pcm
from moss_rt.config import Settings
from moss_rt.engine.base import AudioChunk, EndReason, TakeEvent, TakeFinished, TakeFirstAudio, TakeSpec
from moss_rt.engine.moss import MossEngine
from moss_rt.engine.prompts import prompt_rows
from moss_rt.engine.scheduler import Scheduler
from moss_rt.engine.slots import Take
from moss_rt.generation import SamplingParams

GREEDY_STOP = SamplingParams(text_temperature=0.0)  # the tiny model then runs every take to its frame budget


class RecordingChannel:
    """Stands in for a take's channel: keeps its events (from whichever thread pushes them) and checks their
    order as they come: first audio once before any chunk, chunks in frame order, nothing after the end."""

    def __init__(self, take_id: str, start_frame: int = 0) -> None:
        self.take_id = take_id
        self.events: list[TakeEvent] = []
        self.problems: list[str] = []
        self.cancel_reason: EndReason | None = None
        self.paused = False
        self._next = start_frame
        self._lock = threading.Lock()
        self._ended = threading.Event()

    @property
    def finished(self) -> bool:
        return self._ended.is_set()

    def cancel(self, reason: EndReason = EndReason.CANCELLED) -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason

    def push(self, event: TakeEvent) -> None:
        with self._lock:
            if self._ended.is_set():
                self.problems.append(f"{event!r} after the end")
            if isinstance(event, TakeFirstAudio) and any(isinstance(e, (TakeFirstAudio, AudioChunk))
                                                         for e in self.events):
                self.problems.append("first audio after audio")
            if isinstance(event, AudioChunk):
                if not any(isinstance(e, TakeFirstAudio) for e in self.events):
                    self.problems.append("a chunk before first audio")
                if event.first_frame != self._next:
                    self.problems.append(f"chunk at frame {event.first_frame}, expected {self._next}")
                self._next = event.first_frame + event.n_frames
            self.events.append(event)
            if isinstance(event, TakeFinished):
                self._ended.set()

    # -- what the take produced
    @property
    def chunks(self) -> list[AudioChunk]:
        return [e for e in self.events if isinstance(e, AudioChunk)]

    @property
    def end(self) -> TakeFinished:
        last = self.events[-1]
        assert isinstance(last, TakeFinished), self.events[-3:]
        return last

    @property
    def pcm(self) -> bytes:
        return b"".join(c.pcm for c in self.chunks)

    @property
    def codes(self) -> np.ndarray:
        parts = [c.codes for c in self.chunks]
        return np.concatenate(parts) if parts else np.zeros((0, 12), dtype=np.int64)


@dataclass
class Driven:
    """What ``drive`` saw: every take's channel and the scheduler rounds it took."""

    channels: dict[str, RecordingChannel]
    rounds: int = 0
    most_pending: int = 0
    notes: list[str] = field(default_factory=list)


def engine_settings(data_dir: Path, *, overlap: bool, device: str = "cpu", **overrides: Any) -> Settings:
    base: dict[str, Any] = {
        "engine": "moss", "model": "tiny", "codec": "tiny", "device": device, "data_dir": data_dir,
        "max_slots": 8, "max_queue": 8, "max_seq_len": 256, "max_lead_sec": 0.0, "codec_overlap": overlap,
        # The tests that order the codec's lanes hold calls on its worker for as long as the test takes: a bulk call
        # never runs out of patience here (the patience is tested on the worker alone, test_codec_worker.py).
        "codec_bulk_patience_ms": 60_000.0, "codec_batch_patience_ms": 60_000.0,
        "codec_bulk_longest_wait_ms": 60_000.0,
    }
    base.update(overrides)
    return Settings(**base)


@contextlib.contextmanager
def loaded_engine(settings: Settings, *, all_graphs: bool = False) -> Iterator[MossEngine]:
    """MossEngine loaded and warmed up on this thread (its codec worker started), shut down after."""
    engine = MossEngine(settings)
    try:
        engine._load()
        engine._warm_up()
        if all_graphs:  # every CUDA graph now: no shape runs eagerly first in one run and graphed in another
            while engine._capture_idle():
                pass
        yield engine
    finally:
        engine._shutdown()
        engine._release_device_memory()


def new_take(engine: MossEngine, spec: TakeSpec) -> Take:
    runner = engine._runner
    assert runner is not None
    return Take(spec, RecordingChannel(spec.take_id, spec.start_frame), prompt=prompt_rows(runner, spec))  # type: ignore[arg-type]


class Rounds:
    """Runs scheduler rounds by hand (``drive`` adds takes only at the start)."""

    def __init__(self, engine: MossEngine) -> None:
        self.engine = engine
        self.sched: Scheduler = engine._scheduler  # type: ignore[assignment]

    def add(self, *specs: TakeSpec) -> list[Take]:
        takes = [new_take(self.engine, s) for s in specs]
        for take in takes:
            self.sched.add(take)
        return takes

    def until(self, done: Callable[[], bool], timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if done():
                return
            self.engine._wake.clear()
            if not self.sched.iterate():
                self.engine._wake.wait(0.05)  # the codec worker wakes us when a call is done
        sched = self.sched
        state = {name: [(t.take_id, t.phase.value, t.frames, t.prefilled, t.rebuilt, t.waits_for, t.ending)
                        for t in group]
                 for name, group in (("waiting", sched.waiting), ("preparing", sched.preparing),
                                     ("running", sched.running), ("draining", sched.draining))}
        raise AssertionError(f"the condition never came true: {state}")


def drive(
    engine: MossEngine,
    specs: list[TakeSpec],
    *,
    timeout_s: float = 120.0,
    each_round: Any = None,
) -> Driven:
    """Add every take at once and run scheduling rounds until each one has ended."""
    sched = engine._scheduler
    assert sched is not None
    takes = [new_take(engine, s) for s in specs]
    for take in takes:
        sched.add(take)
    channels = {t.take_id: t.channel for t in takes}
    out = Driven(channels)  # type: ignore[arg-type]
    deadline = time.monotonic() + timeout_s
    while not all(c.finished for c in out.channels.values()):
        assert time.monotonic() < deadline, "takes did not end in time"
        engine._wake.clear()
        worked = sched.iterate()
        out.rounds += 1
        worker = sched.worker  # hand-overs queued or running, per lane (what max_pending bounds)
        out.most_pending = max(out.most_pending, worker.handovers(False), worker.handovers(True))
        if each_round is not None:
            each_round(sched, out.rounds)
        if not worked:
            engine._wake.wait(0.05)  # the codec worker wakes us when a call is done
    return out


# ----------------------------------------------------------------------------- the overlap scenario


def spec(take_id: str, seed: int, frames: int, chunk: int, **kw: Any) -> TakeSpec:
    kw.setdefault("text", f"Line {take_id}: the rain had stopped an hour ago.")
    kw.setdefault("sampling", GREEDY_STOP)
    return TakeSpec(take_id, seed=seed, max_frames=frames, chunk_frames=chunk, **kw)


def first_round() -> list[TakeSpec]:
    """Chunk sizes: one-frame chunks throughout, shorter and longer than the 8-frame ramp; stereo and mono."""
    return [
        spec("a", 1, 14, 1),
        spec("b", 2, 20, 3, channels=2),
        spec("c", 3, 22, 8),
        spec("d", 4, 25, 10),
        spec("e", 5, 9, 4, sampling=SamplingParams()),  # a sampled stop head: it may end early (done)
        spec("f", 6, 18, 8),
    ]


def overlap_scenario(data_dir: Path, *, overlap: bool, device: str = "cpu", all_graphs: bool = False,
                     check: Any = None, **overrides: Any) -> dict[str, Any]:
    """Six takes together, then two retakes of one of them (its cache shared; a changed prompt, re-prefilled),
    each rebuilding its codec state through the worker. Returns each take's chunks and end, and some metrics.
    ``check(engine)`` runs before the engine closes; ``overrides`` are settings (e.g. ``codec_call_streams``)."""
    out: dict[str, Any] = {}
    settings = engine_settings(data_dir, overlap=overlap, device=device, **overrides)
    with loaded_engine(settings, all_graphs=all_graphs) as engine:
        worker = engine._codec_worker
        assert worker is not None and worker.threaded is overlap
        first = drive(engine, first_round())
        n, text = 6, first_round()[2].text
        prefix = first.channels["c"].codes[:n]
        retakes = drive(engine, [
            spec("c.share", 9, 12, 3, text=text, prefix_codes=prefix, parent_take="c"),
            spec("c.new", 10, 12, 2, text=text, instruction="whisper it", prefix_codes=prefix, parent_take="c"),
        ])
        for driven in (first, retakes):
            assert driven.most_pending <= worker.max_pending
            for take_id, ch in driven.channels.items():
                assert not ch.problems, (take_id, ch.problems)
                end = ch.end
                out[take_id] = {
                    "chunks": [(c.first_frame, c.codes.tobytes(), c.pcm) for c in ch.chunks],
                    "end": (end.reason, end.n_frames, end.error),
                }
        registry = engine.metrics.registry
        out["_waits"] = registry.get_sample_value("moss_rt_codec_wait_seconds_count") or 0.0
        out["_held"] = registry.get_sample_value("moss_rt_steps_held_total") or 0.0
        seeks = ("share", "reprefill")
        out["_seeks"] = {p: registry.get_sample_value("moss_rt_seeks_total", {"path": p}) for p in seeks}
        decoder: Any = engine._decoder
        out["_free"] = decoder.free_slots, decoder.max_streams
        if check is not None:
            check(engine)
    return out


def whole_clip_pcm(engine: MossEngine, codes: np.ndarray, channels: int = 1) -> np.ndarray:
    """The whole-clip decode of ``codes`` as the int16 PCM a take streams (as int32, for differences)."""
    codec: Any = engine._codec
    with torch.no_grad():
        audio = codec.decode(torch.from_numpy(np.ascontiguousarray(codes))[None])[0].float().numpy()
    return np.frombuffer(to_int16_pcm(audio, channels), "<i2").astype(np.int32)


def assert_heard_whole(engine: MossEngine, takes: list[Take]) -> None:
    """Every take's chunks came in frame order with nothing after its end, and its audio is the whole-clip decode of
    its codes (to one int16 step)."""
    for take in takes:
        ch: Any = take.channel
        assert not ch.problems, (take.take_id, ch.problems)
        got = np.frombuffer(ch.pcm, "<i2").astype(np.int32)
        assert np.abs(got - whole_clip_pcm(engine, ch.codes)).max() <= 1, take.take_id
