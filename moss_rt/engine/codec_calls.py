"""A scheduling round's audio work as codec calls: which chunks share a call, in which lane, and what the call does.

The scheduler decides *when* a take's frames go to the codec (a chunk is due, a rebuilding take has kept frames
left); this module decides *how*: the due chunks of a round cut into batched calls and handed to the codec worker
(engine/codec_worker) without waiting for them, and what those calls run on the worker's thread.

- **Lanes.** Interactive takes' chunks of their ramp (first audio and the one-frame chunks after it) go in the
  worker's priority lane, as few calls as the codec's graphs allow; everything else goes in bulk calls of equal chunk
  lengths and at most ``call_streams`` streams (STARTING_CALL_STREAMS while a director's take is starting), so a
  director's first chunk waits for at most one short bulk call.
- **Renders apart.** A render's chunks (batch takes: nobody hears them as they come) never share a call with a
  listened stream's, and their calls wait longer behind directors' first chunks (``batch_patience_s``).
- **Withdrawal.** A call that has not started can give up a cancelled take's stream: a padding row decodes in its
  place (the call's batch, and so its graph, stays the same) and the stream's state is not touched.
- **On the worker.** A decode call converts and pushes each take's PCM to its channel (first audio first, timed for
  ``moss_rt_ttfa_seconds``); a rebuild call advances states through kept frames, audio thrown away. A failure fails
  the call's takes through ``codec_error``, which the scheduler turns into their ends.

Nothing here reads the clock to decide anything (the times it writes are measurements), so which chunks share a call
and which lane it takes are the same with the codec overlapped or inline (engine/scheduler.py's last paragraph).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from moss_rt.engine.base import AudioChunk, TakeFirstAudio
from moss_rt.engine.codec_worker import CodecCall, CodecWorker
from moss_rt.engine.metrics import EngineMetrics
from moss_rt.engine.slots import Take

if TYPE_CHECKING:
    from moss_rt.codec.streaming import DecoderState
    from moss_rt.engine.codec_batch import CodecBatcher

log = logging.getLogger(__name__)

# Kept frames a rebuilding take hands to its codec state per round: the codec's full chunk, whose graph every batch
# bucket has, so one batched call decodes every rebuilding take's next chunk.
REBUILD_CHUNK_FRAMES = 8
# Streams in one bulk codec call (steady chunks, batch work): a director's first chunk, in the priority lane, waits
# for at most the call running when it came. Measured on an H200 (bench/RESULTS.md, "Directing at scale"): 31-stream
# calls (the 32-row graph bucket) took the aggregate at 128 streams from 369x to 318x (codec 16.9 -> 24.8 ms a step)
# and gave the directors nothing measurable (64 in a burst: retakes 594 / 762 ms with 31, 543 / 772 with no split).
# So by default a round's chunks of one length go in one call, as before; lower it (Settings.codec_call_streams) to
# trade render throughput for a shorter wait behind a running call.
DEFAULT_CODEC_CALL_STREAMS = 255
# While a director's take is starting (waiting, preparing, or in its ramp), bulk calls hold at most this many streams:
# its first chunks (priority lane) wait for the bulk call running when they come, and during a script render those
# are the render's 66-stream calls (~21 ms each on an H200: the director's first chunk waited 53 ms at p95 in the
# codec's queue). Shorter calls cost the render a little codec throughput, only while someone is waiting to hear.
STARTING_CALL_STREAMS = 16
# A render's bulk calls hold at most this many streams, fewer than a listened stream's (codec_batch.MAX_CALL_STREAMS,
# 128): a director's first chunk that comes while one runs waits for all of it (~40 ms for 64 streams of 8 frames on an
# H200, ~70 ms for 128), and one call of 128 was not measured next to directors (issue 26's bench) yet.
RENDER_CALL_STREAMS = 64
# A render's codec calls wait this long behind directors' first chunks before they go first, whether or not the bulk
# lane is backed up: longer than a listened stream's (codec_worker.DEFAULT_BULK_PATIENCE_S and, while nothing is
# parked, DEFAULT_BULK_LONGEST_WAIT_S), nobody hears a render as it comes.
DEFAULT_BATCH_PATIENCE_S = 0.25


@dataclass(eq=False)
class Chunk:
    """Frames of one take handed to the codec: its state, where they start, the codes; ``priority``: an interactive
    take's ramp chunk; ``withdrawn``: its take was cancelled before the call started (a padding row in its place)."""

    take: Take
    state: DecoderState
    first_frame: int
    codes: np.ndarray
    priority: bool = False
    withdrawn: bool = False


class CodecCalls:
    """Cuts a round's chunks into codec calls and hands them to ``worker`` (used on the engine's thread; the calls'
    bodies run on the worker's)."""

    def __init__(
        self,
        codec: CodecBatcher,
        worker: CodecWorker,
        metrics: EngineMetrics,
        *,
        starting: Callable[[], bool] = lambda: False,
        call_streams: int = DEFAULT_CODEC_CALL_STREAMS,
        batch_patience_s: float = DEFAULT_BATCH_PATIENCE_S,
    ) -> None:
        self.codec = codec
        self.worker = worker
        self.metrics = metrics
        # Whether a director's take is starting (waiting, preparing, or in its ramp): bulk calls are short meanwhile.
        # Asked once the round's chunks are handed over: a ramp's last chunk ends the ramp.
        self.starting = starting
        self.call_streams = call_streams
        self.batch_patience_s = batch_patience_s

    # ------------------------------------------------------------------ on the engine's thread
    def send(self, takes: list[Take], step: int) -> None:
        """Hand the takes' due chunks to the codec worker and return without waiting for them (a bulk hand-over never
        waits for room, a priority one only if its own lane is max_pending hand-overs behind): interactive takes'
        chunks of their ramp (first audio and the one-frame chunks after it) as one call in the priority lane, the rest
        in bulk calls of equal chunk lengths and at most ``call_streams`` streams each (one hand-over), fewer while a
        director's take is starting. ``step``: the steps made so far (a ramp's chunk on the cadence ends it)."""
        chunks = [
            Chunk(t, state, t.flushed, t.codes_array(t.flushed, t.frames), priority=not t.batch and t.in_ramp)
            for t in takes
            if t.pending > 0 and (state := t.decoder) is not None and t.codec_error is None
        ]
        if not chunks:
            return
        now = time.monotonic()
        for chunk in chunks:
            chunk.take.flushed_on(step)
            if chunk.take.first_chunk_at is None:
                chunk.take.first_chunk_at = now
        self.hand_over(self.pieces([c for c in chunks if c.priority], bulk=False), priority=True)
        self.hand_over(self.pieces([c for c in chunks if not c.priority], bulk=True, starting=self.starting()),
                       priority=False)

    def rebuild(self, takes: list[Take]) -> bool:
        """Batched codec calls rebuilding the codec states of ``takes`` (preparing) from their kept frames (audio thrown
        away): the next chunk of every rebuilding take, takes whose chunks have the same length together (one forward,
        graphed where the codec has that shape), at most ``call_streams`` a call; interactive takes' calls in the
        worker's priority lane (one hand-over), batch work's in the bulk lane while it has room (else in a later
        round: the round never waits for the bulk lane). Handed to the codec worker without waiting: the take's later
        decodes run after them, in order. False: nothing was handed over."""
        rebuilding = [t for t in takes if t.rebuild_left > 0 and t.decoder is not None and t.codec_error is None]
        if not rebuilding:
            return False
        note_call = getattr(self.codec, "note_call", None)
        max_frames = min(REBUILD_CHUNK_FRAMES, int(self.codec.decoder.max_chunk_frames))
        handed = False
        for priority in (True, False):
            if not priority and not self.worker.has_room(False):
                continue  # batch work's rebuilds wait for room in the bulk lane (the round does not)
            by_frames: dict[int, list[Take]] = {}
            for take in rebuilding:
                if take.batch is not priority:
                    by_frames.setdefault(min(max_frames, take.rebuild_left), []).append(take)
            calls: list[CodecCall] = []
            parts: list[list[Take]] = []
            for frames, group in by_frames.items():
                per_call = self.streams_per_call(frames)
                for at in range(0, len(group), per_call):
                    members = group[at : at + per_call]
                    items = [Chunk(t, state, t.rebuilt, t.codes_array(t.rebuilt, t.rebuilt + frames))
                             for t in members if (state := t.decoder) is not None]
                    if note_call is not None:
                        note_call([c.codes for c in items])  # counted on this thread, like the streamed chunks
                    calls.append(self.codec_call(self.rebuild_on_worker, items))
                    parts.append(members)
                    for take in members:
                        take.rebuilt += frames
                    self.metrics.codec_rebuild_calls.inc()
                    self.metrics.codec_rebuild_frames.inc(frames * len(members))
            seqs = self.worker.submit_all(calls, priority=priority, wait=priority)
            for members, seq in zip(parts, seqs, strict=True):
                for take in members:
                    take.codec_seq = seq
            handed |= bool(calls)
        return handed

    def capture_wanted(self) -> bool:
        """Codec graphs for shapes that keep coming under load, captured on the worker while this thread
        waits (a capture must not run next to a model step)."""
        if not getattr(self.codec, "wanted", None):
            return False
        try:
            self.worker.call(self.codec.capture_wanted)
        except Exception:  # the eager path remains
            log.exception("codec graph capture under load failed")
        return True

    def streams_per_call(self, frames: int, cap: int | None = None) -> int:
        """Streams one codec call of ``frames``-frame chunks holds at most: ``cap`` (default call_streams),
        within what the codec has graphs for at that length."""
        cap = max(1, int(self.call_streams if cap is None else cap))
        fit = getattr(self.codec, "streams_per_call", None)
        return max(1, int(fit(frames, cap))) if fit is not None else cap

    def pieces(self, chunks: list[Chunk], *, bulk: bool, starting: bool = False) -> list[list[Chunk]]:
        """Chunks cut into codec calls: equal lengths together; a bulk call holds at most ``call_streams``
        streams (a render's RENDER_CALL_STREAMS; STARTING_CALL_STREAMS while a director's take is ``starting``), a
        priority call as many as one graphed call of that length can (their calls are short anyway)."""
        by_t: dict[tuple[int, bool], list[Chunk]] = {}
        for chunk in chunks:  # a render's chunks apart from listened ones: their calls wait longer (codec_call)
            by_t.setdefault((int(chunk.codes.shape[0]), chunk.take.batch), []).append(chunk)
        pieces = []
        for (t, batch), group in by_t.items():
            cap = min(self.call_streams, RENDER_CALL_STREAMS) if batch else self.call_streams
            if not bulk:
                per_call = self.streams_per_call(t, cap=len(group))
            elif starting:
                per_call = self.streams_per_call(t, cap=min(STARTING_CALL_STREAMS, cap))
            else:
                per_call = self.streams_per_call(t, cap=cap)
            pieces += [group[at : at + per_call] for at in range(0, len(group), per_call)]
        return pieces

    def hand_over(self, pieces: list[list[Chunk]], *, priority: bool) -> None:
        """One hand-over to the codec worker: a decode call per piece. A priority hand-over goes in at once (its lane
        has a bound of its own, rarely reached); a bulk one never waits for room: with the lane full it is parked
        behind it (codec_flow), and the next step waits instead, outside the round."""
        if not pieces:
            return
        note_call = getattr(self.codec, "note_call", None)
        if note_call is not None:
            for piece in pieces:
                note_call([c.codes for c in piece])  # counted here, on this thread: see codec_batch
        calls = [self.codec_call(self.decode_and_push, piece) for piece in pieces]
        seqs = self.worker.submit_all(calls, priority=priority, wait=priority)
        for piece, seq in zip(pieces, seqs, strict=True):
            for chunk in piece:
                chunk.take.codec_seq = seq

    def codec_call(self, run: Callable[[list[Chunk]], None], chunks: list[Chunk]) -> CodecCall:
        """One codec call over ``chunks``: it touches their streams' states and can give any of them up before it
        starts (a cancelled take: a padding row takes its place, so the call's batch stays the same). A call of batch
        takes only has the longer patience (codec_worker: how long a bulk call waits behind priority calls)."""
        patience = self.batch_patience_s if all(c.take.batch for c in chunks) else None
        return CodecCall(partial(run, chunks), tuple(c.state for c in chunks), partial(self.withdraw_from, chunks),
                         patience)

    def withdraw_from(self, chunks: list[Chunk], key: Hashable) -> None:
        """(On the engine's thread, under the codec worker's lock, while the call has not started.) The stream ``key``
        leaves the call: its row decodes silence on the decoder's scratch row instead, its state is not touched."""
        for chunk in chunks:
            if chunk.state is key and not chunk.withdrawn:
                chunk.withdrawn = True
                chunk.state = self.codec.decoder.scratch_state()
                chunk.codes = np.zeros_like(chunk.codes)

    # ------------------------------------------------------------------ on the codec worker's thread
    def decode_and_push(self, chunks: list[Chunk]) -> None:
        """One batched decode, then each take's PCM to its channel (first audio first).

        A take whose earlier decode failed is left out (its state may be half advanced); a failing decode
        fails every take of the call through ``codec_error``, which the scheduler turns into its end. Withdrawn
        chunks (their take was cancelled) decode as padding rows and go nowhere; a take muted by its end gets
        nothing more (its end is out, or going out)."""
        chunks = [c for c in chunks if c.withdrawn or c.take.codec_error is None]
        if all(c.withdrawn for c in chunks):
            return
        t0 = time.perf_counter()
        began = time.monotonic()
        for c in chunks:
            if c.take.first_decode_at is None and not c.withdrawn:
                c.take.first_decode_at = began
        try:
            pcms = self.codec.decode_pcm(
                [c.state for c in chunks], [c.codes for c in chunks], [c.take.spec.channels for c in chunks]
            )
        except Exception as exc:
            log.exception("codec decode failed for %d takes", len(chunks))
            for c in chunks:
                if not c.withdrawn:
                    c.take.codec_error = f"codec decode failed: {exc}"
            return
        took = time.perf_counter() - t0
        self.metrics.codec_time.observe(took)
        frames = int(chunks[0].codes.shape[0])
        graphed = getattr(self.codec, "graphed", None)
        ran_graph = bool(graphed(len(chunks), frames)) if graphed is not None else False
        self.metrics.codec_shape_time.labels(str(frames), "1" if ran_graph else "0").observe(took)
        now = time.monotonic()
        for c, pcm in zip(chunks, pcms, strict=True):
            if c.withdrawn:
                continue
            take = c.take
            with take.out_lock:
                if take.muted:
                    continue
                if take.first_audio is None:
                    take.first_audio = now
                    first_ms = (now - take.admitted) * 1000.0
                    self.metrics.ttfa.observe(first_ms / 1000.0)
                    take.channel.push(TakeFirstAudio(first_ms))
                take.channel.push(AudioChunk(c.first_frame, c.codes, pcm))
                take.sent = c.first_frame + int(c.codes.shape[0])

    def rebuild_on_worker(self, items: list[Chunk]) -> None:
        """Advance the states through their kept frames; a failure fails those takes."""
        if all(c.withdrawn for c in items):
            return
        try:
            self.codec.advance([c.state for c in items], [c.codes for c in items])
        except Exception as exc:
            log.exception("codec rebuild failed for %d takes", len(items))
            for c in items:
                if not c.withdrawn:
                    c.take.codec_error = f"codec rebuild failed: {exc}"
