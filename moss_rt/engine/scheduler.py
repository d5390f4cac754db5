"""The frame scheduler: admits takes into slots, prefills them, steps all runnable slots together.

Runs only on the engine's worker thread (it owns the model runner and the streaming decoder).
One :meth:`Scheduler.iterate` is one scheduling round. It serves, in this order (DESIGN.md, wave 3):

1. **interactive control**: takes whose channel was cancelled (a cancel, a seek or a new ``start`` on a streaming
   socket: the session cancels the running take first) end now: a running one stops stepping, the frames it made
   but did not send yet are dropped (its codes and heard audio end at the last frame that reached its channel, and
   nothing of it goes out after its end), its calls queued on the codec worker give its stream up, and its ``end``
   goes out in this round; its codec state is given back (or kept for retakes) once the codec call running on it, if
   any, is done. Then waiting interactive takes are admitted (retakes, continuations and barge-in starts first), and
   those that need no preparation (a retake sharing its parent's cache and codec state, a take whose whole prompt is
   kept) run in this round's step. The ends go out after those admissions, before the step (the web server's work
   for them would otherwise slow the admissions down: _push_held_ends);
2. **running streams' next frames**: every runnable slot (running, not paused) advances by one frame in ONE batched
   model step; slots whose chunk is due (first audio after one frame, then every ``chunk_frames``) go to the codec
   worker (decoded, converted to int16 and pushed to their channels on the worker's thread, overlapped with the next
   model steps; see codec_worker; codec_calls cuts them into calls): interactive takes' first chunks (their ramp) in
   the worker's priority lane, the rest in bulk calls of at most ``codec_call_streams`` streams, so a director's first
   chunk waits for at most one short call. A round never waits for the bulk lane: a hand-over that finds it full is
   parked behind it, and while one is parked the next step that would add one is held back (codec_flow; the round goes
   on with the rest; a director's take in its ramp steps on alone). While a director's take waits for a slot that is
   free, is prefilled or has no frame yet, batch work stands aside from the step, within a share of the rounds
   (batch_yield);
3. **interactive admissions and their preparation**: waiting takes get slots while slots are free (retakes,
   continuations and barge-in starts first, then new takes, then batch work); preparing takes advance their prompt
   prefill and codec state. Prompt rows kept from earlier takes (prompt_cache) are shared, not prefilled, and a take
   waits for rows another take is computing; the next prompt chunks of all the others go through the backbone in ONE
   batched prefill pass (at most ``prefill_max_rows`` padded rows; while takes stream, one pass per round of at most
   ``stream_rows``, sized to the budget at warm-up (prefill_pace), so a burst of arrivals goes in as chunks
   interleaved with frames and never holds a running stream for more than about one frame; while interactive takes
   are about, cut further to what one prefill graph holds, and up to ``prefill_round_passes`` such passes a round
   within ``stream_rows`` in all, one while a director is mid-session). A retake's codec state
   continues from its parent's kept blocks (nothing decoded) where they still hold what its branch frame needs;
   otherwise the kept frames are decoded again, every rebuilding take's next chunk in batched codec calls each round
   (an interactive take's in the priority lane), handed to the codec worker without waiting for them (the take's
   later decodes queue behind them);
4. **batch work** (``TakePriority.BATCH``, script renders) last: admitted only while no interactive take waits and
   within ``batch_share`` of the slots and KV cache; its prompt rows never share a pass with an interactive take's
   (the director's pass stays short), and while interactive takes are about its passes hold at most
   ``BATCH_PASS_SHARE`` of ``stream_rows`` (a director arriving during one waits for less); its chunks go in bulk
   calls only.

Takes that drew the stop head or reached their frame budget end once the codec call holding their last frames is
done (their end always follows their audio). Takes that end while a codec call still runs on their state (cancelled)
wait in ``draining`` for it: their end is out, but their codec state is never closed or kept under a running decode.
A finished take's KV blocks and codec state blocks are kept for retakes
(:class:`~moss_rt.engine.slots.RetainedCaches`) until the room is needed.

The scheduler's decisions (which takes step, which chunks are due, which takes share a codec call, which lane a call
takes) never depend on when the codec finishes, so a take's codes and PCM are the same with the codec overlapped or
inline. Only what a cancelled take still sends depends on timing, as a cancel does.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from moss_rt.engine.base import EndReason, TakeFinished
from moss_rt.engine.batch_yield import BATCH_YIELD_SHARE, BatchYield
from moss_rt.engine.codec_batch import CodecBatcher
from moss_rt.engine.codec_calls import DEFAULT_BATCH_PATIENCE_S, DEFAULT_CODEC_CALL_STREAMS, CodecCalls
from moss_rt.engine.codec_flow import HoldClock, ramp_while_held, step_held
from moss_rt.engine.codec_worker import CodecWorker
from moss_rt.engine.metrics import EngineMetrics, PartClock
from moss_rt.engine.prefill_pace import MIN_ROWS_PER_PASS, largest_graphed_piece
from moss_rt.engine.prompt_cache import Match, PromptCache
from moss_rt.engine.prompts import frames_room
from moss_rt.engine.slots import CacheReuse, CodecSource, Phase, Retained, RetainedCaches, Take
from moss_rt.generation import N_CODEBOOKS

if TYPE_CHECKING:
    from moss_rt.codec.streaming import DecoderState, StreamingDecoder
    from moss_rt.engine.round_trace import RoundTrace
    from moss_rt.model.runner import ModelRunner

log = logging.getLogger(__name__)

DEFAULT_BATCH_SHARE = 0.5  # slots and KV blocks batch work may hold at most (interactive takes keep the rest)
# Batch takes (script lines) admitted in one round at most: admitting one costs the engine's thread its prompt-cache
# match, block reservation, sampler and codec state (a render posting 200 lines admitted ~100 in one round, and a
# director arriving meanwhile waited for all of them); 16 also fill one batched prefill graph (prefill_graphs).
BATCH_ADMITS_PER_ROUND = 16
# While interactive takes are about (waiting, preparing, streaming), a prefill pass holding only batch work's rows
# has at most this share of stream_rows: a director arriving during one waits for less (renders prefill a little
# slower). A pass with an interactive take's rows holds no batch rows at all. A quarter: on one H200 a 200-line render
# with 16 directors took their first audio p95 from 112 ms (half) to 97 ms (62-70 ms with no render) and rendered no
# slower (7.2-7.6 s against 7.7-8.4 s); on two more machines 101-114 ms (bench/RESULTS.md, session 15).
BATCH_PASS_SHARE = 0.25
# Attention scores of a pass grow with its padded rows x its longest key window (x heads), not with
# rows alone: a re-prefill deep into a long take next to fresh prompts would give every one of them
# its window. A pass keeps rows x keys within prefill_max_rows x this many keys (8192 x 1024 x 32
# heads of fp32 scores: 1 GiB at the defaults); one chunk of one take always fits on its own.
PREFILL_KEYS_PER_ROW = 1024
# On CUDA a pass whose chunks do not all start at position 0 runs SDPA's masked kernel, which takes the keys and
# values repeated to the query heads: 4 bytes x query heads x head_dim per key of each member, as much as head_dim
# (128) rows of the plain path's fp32 scores. In that bound a pass's rows count as at least this many, so short
# chunks over long windows (prompt-cache tails, retake frames) stay within the same memory either way.
SCORE_BOUND_MIN_ROWS = 128
# While takes stream and interactive takes are about, prefill passes are cut to one prefill graph's size (~1,024 padded
# rows, ~19 ms on an H200), far below stream_rows (~3,480 rows, the 50 ms budget). One such pass a round put a step
# between every ~4 new lines of a burst (64 lines: 17 passes, 16 steps between them). So a round runs up to this many
# back to back while their padded rows stay within stream_rows: the running streams' stall is bounded by rows as with
# one budget-sized pass, never by the clock (which rows share a pass, and so every take's codes, must not follow
# timings; the passes are the same whatever this is), and arrivals and cancels still come between passes. Not while a
# director is mid-session (a retake, continuation or barge-in waiting or streaming: Take.admission_class 0): a burst
# of retakes keeps one pass a round, its streams' pace first; nor for a render's rows (batch_pass_share's passes).
# Measured on one H200 (bench/RESULTS.md, session 30), same machine, 4 against 1: 64 new lines' first audio p95
# 491 -> 387 ms, slowest stream 5.03 -> 5.31x; 128 lines' p95 627 -> 428 ms, aggregate 429 -> 467x; 64 directors'
# first takes p95 544-576 -> 454-459 ms, their retakes within run-to-run noise. Without the director rule, 4 slowed
# the streams running through a burst of retakes to ~1.25x.
PREFILL_ROUND_PASSES = 4


@dataclass(frozen=True)
class SchedulerConfig:
    max_slots: int
    prefill_chunk: int  # prompt rows per take per prefill pass
    retain_slots: int  # finished takes whose cache blocks are kept for retakes (they hold no slot)
    prefill_max_rows: int = 8192  # padded rows per batched prefill pass (takes x longest chunk)
    prefill_keys_per_row: int = PREFILL_KEYS_PER_ROW  # with it, bounds padded rows x longest key window
    prompt_cache: bool = True  # keep prompt blocks for later takes that open with the same rows
    batch_share: float = DEFAULT_BATCH_SHARE  # share of slots and KV blocks batch takes may hold at once
    codec_call_streams: int = DEFAULT_CODEC_CALL_STREAMS  # streams per bulk codec call (priority calls: any)
    batch_yield_share: float = BATCH_YIELD_SHARE  # share of step rounds batch work may stand aside for directors
    # A codec call holding only batch takes' chunks (a render's lines: nobody listens as they come) waits this long
    # behind directors' first chunks before it goes first; calls with a listened stream have the worker's patience.
    codec_batch_patience_s: float = DEFAULT_BATCH_PATIENCE_S
    batch_pass_share: float = BATCH_PASS_SHARE  # of stream_rows, a batch-only prefill pass while directors are about
    # Graph-sized prefill passes a round may run back to back while takes stream, within stream_rows padded rows in
    # all (the round's stall stays what one budget-sized pass was): PREFILL_ROUND_PASSES.
    prefill_round_passes: int = PREFILL_ROUND_PASSES

    @property
    def batch_slots(self) -> int:
        """Slots batch takes may hold at once (at least one, so batch work always advances)."""
        return max(1, int(self.max_slots * self.batch_share))


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        codec: CodecBatcher,
        metrics: EngineMetrics,
        config: SchedulerConfig,
        *,
        on_take_done: Callable[[Take], None] = lambda take: None,
        sync: Callable[[], None] = lambda: None,
        worker: CodecWorker | None = None,
        arrivals: Callable[[], bool] = lambda: False,
        trace: RoundTrace | None = None,
    ) -> None:
        self.runner = runner
        self.codec = codec
        self.decoder: StreamingDecoder = codec.decoder
        # Every use of the decoder goes through the worker (the decoder is not thread-safe); its owner (the
        # engine) starts and stops it. Without one, codec calls run inline.
        self.worker = worker or CodecWorker(threaded=False)
        self.metrics = metrics
        self.config = config
        # Due chunks and kept frames cut into codec calls, in the worker's lanes (engine/codec_calls).
        self.calls = CodecCalls(codec, self.worker, metrics, starting=self._interactive_starting,
                                call_streams=config.codec_call_streams, batch_patience_s=config.codec_batch_patience_s)
        self._on_done = on_take_done
        self._sync = sync  # waits for queued device work, so host timings mean something
        # True when new takes wait to be added (the engine's inbox): a preparation loop with nothing streaming stops
        # there, so they join the next pass instead of waiting for every pass of the takes before them.
        self._arrivals = arrivals
        self.waiting: deque[Take] = deque()
        self.preparing: list[Take] = []  # interactive takes first, then batch work (each in admission order)
        self.running: list[Take] = []
        # Takes that ended (cancelled, failed while preparing) with a codec call on their state still running: their
        # end is out; their codec state is given back, or kept for retakes, once that call is done (it is never
        # closed under a running decode). They hold no model slot, but count as active (their codec slot).
        self.draining: list[Take] = []
        self.retained = RetainedCaches(config.retain_slots)
        pool = getattr(runner, "blocks", None)  # test stand-ins without a pool keep no prompts
        self.prompts = PromptCache(pool, enabled=config.prompt_cache and pool is not None)
        self.steps = 0
        # Padded rows of a pass while takes stream (at most prefill_max_rows); the engine sets it once at warm-up
        # (prefill_pace) and it stays fixed: pass composition must not follow timings, or codes would.
        self.stream_rows = config.prefill_max_rows
        self._last_step_at: float | None = None  # start of the previous step while takes ran
        # Batch work stands aside for directors' first frames, within a share of the rounds.
        self._batch_yield = BatchYield(config.batch_yield_share)
        self._hold = HoldClock(metrics)  # steps held back for room in the codec's bulk lane (codec_flow)
        # A line per working round (--round-trace) and what this round did, for it (engine/round_trace.py).
        self.trace = trace if trace is not None and trace.active else None
        self._did: dict[str, Any] = {}
        # Ends of takes stopped in a round's control, held until its interactive admissions are done (iterate): None
        # outside that part of the round (an end then goes out at once).
        self._held_ends: list[tuple[Take, TakeFinished]] | None = None

    # ------------------------------------------------------------------ bookkeeping
    @property
    def active_count(self) -> int:
        return len(self.preparing) + len(self.running) + len(self.draining)

    @property
    def has_paused(self) -> bool:
        return any(t.paused for t in self.running)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.preparing or self.running or self.draining)

    def add(self, take: Take) -> None:
        self.waiting.append(take)
        self._update_gauges()

    def _update_gauges(self) -> None:
        m = self.metrics
        m.active_slots.set(self.active_count)
        m.queued.set(len(self.waiting))
        m.paused_slots.set(sum(1 for t in self.running if t.paused))
        blocks = getattr(self.runner, "blocks", None)  # test stand-ins have no pool
        if blocks is not None:
            m.kv_blocks_free.set(blocks.free_blocks)
            m.kv_blocks_total.set(blocks.num_blocks - 1)
            m.kv_blocks_promised.set(blocks.promised)
        m.retained_caches.set(len(self.retained))
        m.codec_kept_states.set(len(self.retained.codec_states()))
        if self.decoder is not None and hasattr(self.decoder, "free_blocks"):
            m.codec_blocks_free.set(sum(self.decoder.free_blocks))
        m.prompt_cache_blocks.set(len(self.prompts))
        m.codec_pending.set(self.worker.pending)

    # ------------------------------------------------------------------ one round
    def iterate(self) -> bool:
        """One scheduling round; False when there was nothing to do (the caller may sleep)."""
        clock = _PhaseClock(self.metrics)
        if self.trace is not None:
            self._did = {"steps": 0, "batch": 0, "admitted": 0, "passes": 0, "rows": 0, "held": False}
        self._held_ends = []
        try:
            worked = clock.lap("control", self._control())  # 1. interactive control...
            worked |= clock.lap("admit", self._admit_interactive_first())  # ...and directors' takes, before the step
        finally:
            self._push_held_ends()
        clock.lap("control", False)  # the ends held until now went out
        worked |= clock.lap("step", self._step())  # 2. running streams' next frames...
        worked |= clock.lap("flush", self._flush_and_finish())  # ...to the codec; ends whose last frames are decoded
        worked |= clock.lap("admit", self._admit())  # 3. admissions (interactive first; 4. batch work after)
        worked |= clock.lap("prepare", self._prepare())  # ...and preparation (interactive first, batch work after)
        worked |= clock.lap("capture", self.calls.capture_wanted())
        self._update_gauges()
        if worked:
            clock.done()
            if self.trace is not None:
                self.trace.record({
                    "t": round(clock.start, 6), "ms": round(1000.0 * (clock.last - clock.start), 3),
                    "parts": {ph: [round(1000.0 * wall, 3), round(1000.0 * cpu, 3)]
                              for ph, (wall, cpu) in clock.laps.items()},
                    "waiting": len(self.waiting), "preparing": len(self.preparing), "running": len(self.running),
                    **self._did, "parked": self.worker.parked(False),
                })
        return worked

    def _control(self) -> bool:
        """Cancels first: every cancelled take ends now (a running one with what it sent so far; see _end_now).
        Then every take whose last codec call is done ends (its end goes out before this round's preparation work),
        and takes draining a codec call give their codec state back."""
        found = self._reap_cancelled()
        found |= self._finish_ended()
        return found

    def _reap_cancelled(self) -> bool:
        found = False
        for take in [t for t in self.waiting if t.channel.cancel_reason is not None]:
            self.waiting.remove(take)
            self._finish(take, take.channel.cancel_reason or EndReason.CANCELLED)
            found = True
        for take in [t for t in self.preparing if t.channel.cancel_reason is not None]:
            self.preparing.remove(take)
            self._stop_preparing(take, take.channel.cancel_reason or EndReason.CANCELLED)
            found = True
        for take in [t for t in self.running if t.channel.cancel_reason is not None and t.ending is None]:
            self._end_now(take, take.channel.cancel_reason or EndReason.CANCELLED)
            found = True
        return found

    def _end_now(self, take: Take, reason: EndReason) -> None:
        """A running take is cancelled: it ends in this round with the frames that reached its channel. Frames it
        made but did not send are dropped, not decoded (their codes too: a retake branches only from frames its
        director heard); its calls queued on the codec worker give its stream up (padding rows in its place), so only
        a call already running on its state may still be in flight: its codec state waits in ``draining`` for that
        one, and its KV blocks are kept for retakes at once."""
        self.running.remove(take)
        with take.out_lock:
            take.muted = True  # the codec worker pushes nothing of it from now on
            sent = take.sent
        dropped = take.frames - sent
        if dropped > 0:
            del take.codes[sent:]
            take.frames = sent
            self.metrics.cancel_dropped_frames.inc(dropped)
        take.flushed = min(take.flushed, take.frames)
        take.codec_seq = self.worker.withdraw(take.decoder) if take.decoder is not None else 0
        self._finish(take, reason)

    def _stop_preparing(self, take: Take, reason: EndReason, error: str | None = None) -> None:
        """End a take taken out of ``preparing`` now; a rebuild call running on its codec state keeps the state in
        ``draining`` until it is done (queued ones give its stream up)."""
        take.codec_seq = self.worker.withdraw(take.decoder) if take.decoder is not None else 0
        self._finish(take, reason, error=error)

    def _finish_ended(self) -> bool:
        """End the running takes that stopped (stop head, frame budget, failure) once their last codec call is done;
        give back the codec states of draining takes whose call is done."""
        found = False
        for take in [t for t in self.running if t.ending]:
            if not self.worker.done(take.codec_seq):
                continue  # its last frames are still being decoded: it ends in a later round
            self._absorb_codec_error(take)  # that decode may have failed
            self.running.remove(take)
            self._finish(take, take.ending or EndReason.DONE)
            found = True
        for take in [t for t in self.draining if self.worker.done(t.codec_seq)]:
            self.draining.remove(take)
            self._release_codec(take, take.kept_item)
            found = True
        return found

    # ------------------------------------------------------------------ admission
    def _admit(self, *, interactive_only: bool = False) -> bool:
        """Waiting takes start while a slot is free and the KV pool can promise them every block they may need
        (kept caches of finished takes are evicted for room first); otherwise they wait, so a running take never
        finds the pool empty. Retakes and continuations go first, then new interactive takes (each oldest first),
        then batch work, which also waits while it holds its share of the slots (``batch_share``), at most
        BATCH_ADMITS_PER_ROUND of it a round. ``interactive_only``: no batch work (_admit_interactive_first)."""
        admitted = False
        batch_admits = 0
        stopping = self._stopping_ids()
        # A retake of a take that is being stopped waits for its end (the next round's control, usually this
        # one's): then it shares that take's kept cache and codec state instead of rebuilding them. The rest in
        # admission order, the first of the lowest class first (a stable sort, once a round: admitting one take
        # changes no other's class, and a burst of 64 retakes would otherwise look for the next one 64 times).
        ready = sorted(
            (t for t in self.waiting if t.spec.parent_take not in stopping) if stopping else self.waiting,
            key=lambda t: t.admission_class,
        )
        first_batch: int | None = None  # where the next interactive take goes in ``preparing``: before batch work
        for take in ready:
            if interactive_only and take.batch:
                break  # sorted by class: the rest are batch work
            if self.active_count >= self.config.max_slots:
                break
            if take.batch and self._batch_count() >= self.config.batch_slots:
                break  # batch work waits for its own takes to end; interactive takes never wait behind it
            if take.batch and batch_admits >= BATCH_ADMITS_PER_ROUND:
                break  # the rest in the next rounds: a round stays short for whoever arrives meanwhile
            try:
                started = self._begin(take)
            except Exception as exc:  # a bad prompt must not take other streams down
                log.warning("take %s could not start: %s", take.take_id, exc)
                self.waiting.remove(take)
                self._release(take, keep=False)
                self._finish(take, EndReason.ERROR, error=str(exc))
                continue
            if not started:
                break  # the pool is full: the queue waits for blocks to come back
            self.waiting.remove(take)
            if take.batch:
                batch_admits += 1
                self.preparing.append(take)
            else:  # interactive takes prepare before batch work
                if first_batch is None:
                    first_batch = next((i for i, t in enumerate(self.preparing) if t.batch), len(self.preparing))
                self.preparing.insert(first_batch, take)
                first_batch += 1
            admitted = True
            if self.trace is not None:
                self._did["admitted"] += 1
        if admitted:
            self._apply_admissions()
        return admitted

    def _admit_interactive_first(self) -> bool:
        """Interactive takes (a director waits) are admitted before the round's step, and those that need no
        preparation (a retake sharing its parent's cache and codec state, a take whose whole prompt is kept) run in
        it: their first frame comes from the next step, not from the step after the round they were admitted in (64
        directors retaking with a new seed at once on an H200: a round with the codec busy lasted 30-50 ms, and a
        retake waited 44-64 ms for its admission). The others prepare after the step, as before. The running streams
        lose nothing: the round does the same work, admissions only come before its step. Batch work is admitted after
        the step, as before.

        Retakes whose parent's codec call was still running when they began open their codec state here too, once
        this round's control saw that call done, and run in this step (before: opened after the step, a round
        later)."""
        admitted = any(not t.batch for t in self.waiting) and self._admit(interactive_only=True)
        if not admitted and not any(t.codec_after is not None for t in self.preparing):
            return False
        self._open_deferred()
        return self._promote_ready() or admitted

    def _push_held_ends(self) -> None:
        """The ends of the takes this round's control stopped go out, after the round's interactive admissions.

        Why after: each end wakes the web server's thread (the session's `end`, and a retake's `start` behind it), and
        that work took the interpreter lock from the admissions that followed in the same round: a burst of 64
        seed-only retakes on an H200 spent 51-56 ms admitting for 23-24 ms of the engine thread's CPU, while 64
        admissions in a round with no ends in it took 24 ms for 24 (bench/RESULTS.md, session 25). Held here, that
        work overlaps the round's step, whose device wait leaves the lock free; an end goes out at most the
        admissions' CPU time later (a cancel with no admission behind it: no later at all)."""
        held, self._held_ends = self._held_ends, None
        for take, event in held or ():
            take.channel.push(event)

    def _stopping_ids(self) -> set[str]:
        """Takes asked to stop that have not ended yet: a director's retake can arrive before the take it replaces
        has ended (the socket submits it at once, web/ws: early admission)."""
        if not self.waiting:
            return set()
        return {
            t.take_id for group in (self.waiting, self.preparing, self.running) for t in group
            if t.channel.cancel_reason is not None
        }

    def _apply_admissions(self) -> None:
        """The round's admissions reach the device together: their slots, cache blocks and sampling state were
        staged on the host (ModelRunner.apply_staged), a few batched writes whatever their number. Any pass would
        apply them first anyway; applying them here times them (admit part ``apply``, once a round)."""
        apply = getattr(self.runner, "apply_staged", None)  # test stand-ins have no device state
        if apply is None:
            return
        clock = PartClock(self.metrics.admit_part_time, self.metrics.admit_part_cpu)
        apply()
        clock.lap("apply")

    def _batch_count(self) -> int:
        return sum(1 for group in (self.preparing, self.running, self.draining) for t in group if t.batch)

    def _interactive_starting(self) -> bool:
        """A director is waiting for a take's first sound: an interactive take waiting, preparing, or in its ramp."""
        return any(not t.batch for group in (self.waiting, self.preparing) for t in group) or any(
            not t.batch and t.in_ramp for t in self.running
        )

    def _director_awaits_first_frame(self, runnable: list[Take]) -> bool:
        """Batch work is about to step next to a director's take that has no frame yet (its first step), is being
        prefilled, or waits with a slot free for it (admitted after this step): the step would delay its first audio
        (engine/batch_yield)."""
        if not any(t.batch for t in runnable):
            return False
        return (
            any(not t.batch and t.first_frame_at is None for t in runnable)
            or any(not t.batch and self._rows_left(t) > 0 for t in self.preparing)
            or (self.active_count < self.config.max_slots and any(not t.batch for t in self.waiting))
        )

    def _interactive_present(self) -> bool:
        return any(not t.batch for group in (self.waiting, self.preparing, self.running) for t in group)

    def _batch_blocks(self) -> int:
        return sum(t.blocks_promised for group in (self.preparing, self.running) for t in group if t.batch)

    def _room_for(
        self, need: int, keep: str | None, spare: frozenset[int] = frozenset(), batch: bool = False
    ) -> bool:
        """Make ``need`` blocks available: kept prompt blocks go first (least recently used, never those in
        ``spare``), then kept caches of finished takes (batch work's first, oldest first, never ``keep``; for
        ``batch`` work only batch work's: it never takes a director's kept takes away)."""
        runner = self.runner
        while runner.blocks.available < need:
            if self.prompts.evict(need, spare):
                continue  # dropping a finished take's cache may have left more prompt blocks to the cache alone
            item = self.retained.evict_oldest(keep=keep, batch_only=batch)
            if item is None:
                return False
            self._drop_retained(item)
        return True

    def _drop_retained(self, item: Retained) -> None:
        item.dropped = True  # a codec state still pending for it is closed when its call is done, not kept
        self.runner.drop(item.blocks)
        if item.codec is not None:
            self.decoder.drop(item.codec)
            item.codec = None

    def make_codec_room(self, frames: int | None = None, keep: str | None = None) -> bool:
        """Give back kept codec states (least recently used first, never ``keep``'s) until a new stream of at most
        ``frames`` frames can open (None: a whole window). False when it still cannot."""
        decoder = self.decoder
        while not decoder.can_open(frames):
            kept = self.retained.evict_codec(keep=keep)
            if kept is None:
                return False
            decoder.drop(kept)
        return True

    def _begin(self, take: Take) -> bool:
        """Give the take a slot and its cache reservation; False when the pool cannot promise it yet. Its parts are
        timed (moss_rt_admit_part_seconds: an admission costs the engine's thread, and every director arriving in
        that round waits for it)."""
        runner = self.runner
        clock = PartClock(self.metrics.admit_part_time, self.metrics.admit_part_cpu)
        spec = take.spec
        assert take.prompt is not None, "submit builds and checks the prompt rows"
        prompt = take.prompt
        n = spec.start_frame
        prefix = (
            np.asarray(spec.prefix_codes, dtype=np.int64).reshape(-1, N_CODEBOOKS)
            if n
            else np.zeros((0, N_CODEBOOKS), dtype=np.int64)
        )
        # The rule submit already checked (a PromptTooLong here is a ValueError: _admit ends the take).
        frames_left = frames_room(len(prompt), n, int(runner.max_seq_len))
        frame_cap = min(n + spec.max_frames, frames_left)
        kept = self.retained.get(spec.parent_take) if spec.parent_take else None
        share = kept is not None and self._can_truncate(kept, prompt, prefix)
        if share:
            rows, keys, shared, match = prompt, None, len(prompt) + n, None
        else:
            rows = prompt
            if n:
                # Kept frames enter the cache as the model's own assistant rows (slot token + codes).
                frame_rows = np.empty((n, N_CODEBOOKS + 1), dtype=np.int64)
                frame_rows[:, 0] = runner.config.audio_assistant_slot_token_id
                frame_rows[:, 1:] = prefix
                rows = np.concatenate([prompt, frame_rows], axis=0)
            keys = self.prompts.keys(rows)
            match = self.prompts.match(keys)
            shared = match.length
        clock.lap("match")
        take.frame_cap = frame_cap
        take.prompt_len = len(prompt)
        # Every position the take may write (prompt, kept frames, new frames): promised up front,
        # allocated block by block as it grows; a shared prefix costs nothing (its branch block one copy).
        need = runner.blocks_needed(take.positions, shared)
        spare = frozenset(match.blocks) if match is not None else frozenset()
        codec_share = kept is not None and self._can_resume_codec(kept, prefix)
        # The parent was cancelled a moment ago and a codec call still runs on its state: whether the retake can
        # share it is known once that call is done (it opens its codec state then: _open_deferred).
        codec_wait = (
            kept is not None and kept.codec_pending and n > 0 and kept.codes.shape[0] >= n
            and bool(np.array_equal(kept.codes[:n], prefix))
        )
        batch_cap = self.config.batch_share * (runner.blocks.num_blocks - 1)
        if take.batch and self._batch_count() and self._batch_blocks() + need > batch_cap:
            return False  # batch work holds its share of the cache: it waits for its own takes to end
        room = self._room_for(need, keep=spec.parent_take if share or codec_share or codec_wait else None,
                              spare=spare, batch=take.batch)
        if not room and (codec_share or codec_wait) and not share:
            # The parent's kept KV blocks are in the way: give them (and its codec state) up, rebuild instead.
            codec_share = codec_wait = False
            room = self._room_for(need, keep=None, spare=spare, batch=take.batch)
        if not room and take.batch and not self._interactive_present():
            room = self._room_for(need, keep=None, spare=spare)  # no director here: kept takes of theirs may go
        clock.lap("room")
        if not room:
            if not self.active_count:
                raise ValueError(
                    f"the take needs {need} KV cache blocks but the pool has {runner.blocks.available} "
                    "(lower max_new_tokens, or start the service with more memory for the cache)"
                )
            return False
        take.phase = Phase.PREPARING
        take.prep_started = time.monotonic()
        take.blocks_promised = need
        take.frames = take.flushed = take.sent = n
        take.codes = list(prefix)
        take.model_slot = runner.alloc_slot(default_sampling=False)  # its own sampling is set below
        take.prompt_rows = rows
        if share:
            assert kept is not None
            # The parent's cache holds prompt + its frames: share its blocks up to frame n.
            runner.attach(take.model_slot, kept.blocks, shared)
            take.prefilled = len(prompt)
            take.reuse_path = CacheReuse.SHARE
            if not runner.reserve(take.model_slot, take.positions, shared):  # pragma: no cover
                raise RuntimeError("the KV pool could not keep its promise")  # _room_for checked it
        else:
            take.reuse_path = CacheReuse.REPREFILL if n else CacheReuse.FRESH
            take.prompt_keys = keys
            assert match is not None
            # _room_for made the room this needs (PoolExhausted here would be a bookkeeping bug).
            self._share_kept(take, match)
            if take.prefilled < len(rows):
                self._claim_or_wait(take)
        take.retain_key = prompt
        clock.lap("kv")
        # Repetition penalty keeps the kept frames as history; the RNG counter continues at frame n.
        runner.set_sampling(
            take.model_slot, spec.sampling, spec.seed, frame_index=n, history=prefix if n else None
        )
        clock.lap("sampling")
        if codec_wait:
            take.codec_after = kept  # its codec state opens once the parent's running codec call is done
        else:
            take.decoder = self._open_codec_state(take, kept if codec_share else None)
            self.metrics.codec_states.labels(take.codec_source.value).inc()
        if n:
            self.metrics.seeks.labels(take.reuse_path.value).inc()
        clock.lap("codec")
        return True

    def _can_resume_codec(self, kept: Retained, prefix: np.ndarray) -> bool:
        """Whether a retake with these kept frames can continue from the parent's kept codec state exactly."""
        n = len(prefix)
        return (
            n > 0
            and kept.codec is not None
            and kept.codes.shape[0] >= n
            and bool(np.array_equal(kept.codes[:n], prefix))
            and self.decoder.can_resume(kept.codec, n)
        )

    def _open_codec_state(self, take: Take, kept: Retained | None) -> DecoderState:
        """The take's codec stream, holding what its frame cap needs: a retake continues from its parent's kept
        blocks at its branch frame (``kept``: nothing to decode), any other take with kept frames starts empty and
        has them decoded again (rebuild calls, batched in _prepare)."""
        n, cap = take.spec.start_frame, take.frame_cap
        keep = take.spec.parent_take if kept is not None else None
        if not self.make_codec_room(cap, keep=keep):  # pragma: no cover - the pools hold a window per stream
            log.warning("codec state pools full although every kept state was given back")
        if kept is not None and kept.codec is not None and self.decoder.can_resume(kept.codec, n):
            state = self.decoder.resume(kept.codec, n, max_frames=cap)
            take.rebuilt, take.codec_source = n, CodecSource.SHARED
            return state
        take.rebuilt, take.codec_source = 0, (CodecSource.REBUILT if n else CodecSource.FRESH)
        return self.decoder.new_state(max_frames=cap)

    def _open_deferred(self) -> None:
        """Retakes of a parent whose codec state was still in a running call when they began: once that call is done,
        they continue from the parent's kept codec state where it can resume them exactly (can_resume: the parent's
        stream may have decoded past the frames it sent), else they rebuild it from the codes."""
        for take in [t for t in self.preparing if t.codec_after is not None]:
            item = take.codec_after
            assert item is not None
            if item.codec_pending:
                continue
            take.codec_after = None
            prefix = take.codes_array(0, take.spec.start_frame)
            usable = not item.dropped and self._can_resume_codec(item, prefix)
            try:
                take.decoder = self._open_codec_state(take, item if usable else None)
            except Exception as exc:  # no codec slot or blocks: this take fails, the others go on
                log.warning("take %s could not open its codec state: %s", take.take_id, exc)
                self._fail_preparing(take, f"codec state unavailable: {exc}")
                continue
            self.metrics.codec_states.labels(take.codec_source.value).inc()

    @staticmethod
    def _can_truncate(kept: Retained, prompt: np.ndarray, prefix: np.ndarray) -> bool:
        n = len(prefix)
        return (
            kept.prompt_rows.shape == prompt.shape
            and bool(np.array_equal(kept.prompt_rows, prompt))
            and kept.codes.shape[0] >= n
            and bool(np.array_equal(kept.codes[:n], prefix))
        )

    # ------------------------------------------------------------------ kept prompt blocks
    def _share_kept(self, take: Take, match: Match) -> None:
        """The take (nothing prefilled beyond what it shares) continues from the kept blocks of ``match``."""
        assert take.model_slot is not None
        self.runner.share_prefix(take.model_slot, match.blocks, match.length, take.positions)
        self.metrics.prompt_rows.labels("cache").inc(match.length - take.prefilled)
        take.prefilled = match.length

    def _claim_or_wait(self, take: Take) -> None:
        """The take's next prompt block: computed by another preparing take right now (wait for it to be
        kept, then share it), or by this take (claimed, so later takes wait for it)."""
        if take.prompt_keys is None:
            return
        block = take.prefilled // self.runner.blocks.block_size
        other = self.prompts.claimant(take.prompt_keys, block)
        if other is not None and other != take.take_id:
            take.waits_for = other
        else:
            take.waits_for = None
            self.prompts.claim(take.take_id, take.prompt_keys, block)

    def _catch_up(self) -> None:
        """Waiting takes whose awaited block is no longer being computed share what is kept now and go on."""
        if not self.prompts.enabled:
            return
        bs = self.runner.blocks.block_size
        for take in self.preparing:
            if take.waits_for is None:
                continue
            if self.prompts.claimant(take.prompt_keys, take.prefilled // bs) == take.waits_for:
                continue  # still being computed
            match = self.prompts.match(take.prompt_keys)
            if match.length > take.prefilled:
                self._share_kept(take, match)  # its reservation only shrinks
            take.waits_for = None
            if self._rows_left(take):
                self._claim_or_wait(take)

    # ------------------------------------------------------------------ prefill / rebuild
    def _prepare(self) -> bool:
        # Alone on the device: prepare everything now (lowest first-audio latency). Once takes stream (that
        # includes takes this loop just made ready, so a burst larger than one pass starts streaming pass by pass
        # instead of all after the last), a round runs at most one prefill pass (stream_rows bounds its stall: sized
        # to prefill_budget_ms at warm-up) and one codec rebuild call; passes cut to one prefill graph's size
        # (interactive takes about) may run back to back up to prefill_round_passes, within stream_rows in all,
        # unless a director is mid-session (_graph_sized_passes).
        # A pass is never cut short.
        # Every round runs a pass if one is wanted: promoting a take that needed no work (a retake whose
        # parent's cache holds its whole prompt) is not one, or such takes could starve the rest.
        # No decision here reads the clock or the codec's progress, so rounds are the same with the codec
        # overlapped or inline.
        # Between units a cancel is honoured at once (interactive control before any further preparation), and
        # with nothing streaming new arrivals end the loop (they join the next pass rather than wait for all).
        if not self.preparing:
            return False
        self._fail_broken_rebuilds()
        self._open_deferred()
        self._catch_up()
        promoted = self._promote_ready()
        units = passes = 0
        # Codec rebuilds: every rebuilding take's next chunk a round (batched calls), handed to the codec worker
        # without waiting; alone on the device, every chunk now (the worker's bounded queue paces them).
        while self.calls.rebuild(self.preparing):
            units += 1
            promoted |= self._promote_ready()
            if self.running:
                break
        # Takes waiting for prompt blocks another take computes have no unit of their own (_catch_up moves them).
        round_rows = 0  # padded rows of this round's passes
        while any(t.waits_for is None and self._rows_left(t) for t in self.preparing):
            if self.running and passes and not self._graph_sized_passes():
                break  # the next unit would be a second prefill pass
            if units and (self._reap_cancelled() or self._arrivals()):
                break  # control first: a cancelled take ends, new takes are admitted, before the next pass
            batch = self._prefill_batch()
            rows = len(batch) * max((n for _, n in batch), default=0)
            if self.running and passes and (passes >= self.config.prefill_round_passes
                                            or round_rows + rows > self.stream_rows
                                            or any(take.batch for take, _ in batch)):
                # Another pass would hold the running streams past one budget-sized pass, or it is a render's:
                # those stay one a round while directors are about (batch_pass_share: they wait for less).
                break
            self._prefill(batch)
            round_rows += rows
            passes += 1
            self._catch_up()
            self._promote_ready()
            units += 1
        return promoted or units > 0

    @staticmethod
    def _rows_left(take: Take) -> int:
        assert take.prompt_rows is not None
        return len(take.prompt_rows) - take.prefilled

    def _graph_sized_passes(self) -> bool:
        """Whether several passes may run this round (PREFILL_ROUND_PASSES): they are cut to what one prefill graph
        holds (takes stream, interactive takes are about, the runner has prefill graphs) and no director is
        mid-session."""
        if self.config.prefill_round_passes <= 1:
            return False
        if any(t.admission_class == 0 for group in (self.waiting, self.preparing, self.running) for t in group):
            return False  # a director is mid-session (a retake, continuation or barge-in): short rounds, as ever
        return self._graph_rule() is not None

    def _graph_rule(self) -> Callable[[Sequence[int], Sequence[int]], bool] | None:
        """What a pass must fit for a prefill graph to replay it, while passes are cut to one graph's size (takes
        stream and interactive takes are about); None otherwise, and where no graph ever replays a pass (the CPU, test
        stand-ins)."""
        rule = getattr(self.runner, "prefill_graph_rule", None)
        return rule() if rule is not None and self.running and self._interactive_present() else None

    def _prefill_batch(self) -> list[tuple[Take, int]]:
        """(take, rows) for one pass: the next chunk of every take with rows left, oldest first,
        while the pass stays within prefill_max_rows padded rows (takes x longest chunk) and its
        padded rows x longest key window within prefill_max_rows x prefill_keys_per_row. While takes
        stream, the pass holds at most stream_rows padded rows (longer prompts go in as chunks).

        Interactive takes' rows never share a pass with batch work's (a batch take whose rows an interactive take
        waits for counts as interactive): a director's pass is as short as its own rows. A pass of batch rows alone
        holds at most ``batch_pass_share`` of stream_rows while interactive takes are about. While takes stream and
        interactive takes are about, a pass also holds only what one prefill graph does (prefill_pace: graph-sized
        passes), its pieces cut to fit."""
        score_cap = self.config.prefill_max_rows * self.config.prefill_keys_per_row
        cap = self.stream_rows if self.running else self.config.prefill_max_rows
        fits = self._graph_rule()
        ready = [t for t in self.preparing if self._rows_left(t) > 0 and t.waits_for is None]
        awaited = {t.waits_for for t in self.preparing if not t.batch and t.waits_for is not None}
        urgent = [t for t in ready if not t.batch or t.take_id in awaited]
        if urgent:
            ready = urgent
        elif self.running and self._interactive_present():
            cap = min(cap, max(MIN_ROWS_PER_PASS, int(cap * self.config.batch_pass_share)))
        chosen: list[tuple[Take, int]] = []
        widest = keys = 0
        for take in ready:
            left = self._rows_left(take)
            count = min(left, self.config.prefill_chunk, cap)
            members = len(chosen) + 1
            if chosen and max(widest, count) * members > cap:
                # A shorter chunk of it may still fill the pass (its next piece goes in a later pass), unless
                # the pass's widest chunk is already too wide, or the piece would be a sliver.
                fit = cap // members
                if widest > fit or fit < min(left, MIN_ROWS_PER_PASS):
                    continue
                count = fit
            if fits is not None:
                cut = largest_graphed_piece(fits, [n for _, n in chosen], [t.prefilled for t, _ in chosen],
                                            take.prefilled, count)
                if chosen and cut < min(left, MIN_ROWS_PER_PASS):
                    continue  # no graph holds it next to these (or only a sliver): a later pass
                count = cut or count  # a lone piece no graph holds runs eagerly, as before
            wider = max(widest, count)
            more_keys = max(keys, take.prefilled + count)  # its chunk's last position (prompt rows start at 0)
            if chosen and max(wider, SCORE_BOUND_MIN_ROWS) * members * more_keys > score_cap:
                continue  # a shorter window further on may still fit
            chosen.append((take, count))
            widest, keys = wider, more_keys
        return chosen

    def _prefill(self, batch: list[tuple[Take, int]]) -> None:
        """One batched prefill pass; if it fails, each take is retried alone so only a bad one ends."""
        from moss_rt.model.runner import PrefillRequest  # here: importing the scheduler needs no torch

        requests = []
        for take, count in batch:
            assert take.prompt_rows is not None and take.model_slot is not None
            rows = take.prompt_rows[take.prefilled : take.prefilled + count]
            requests.append(PrefillRequest(take.model_slot, rows, take.prefilled))
        t0 = time.perf_counter()
        error: str | None = None
        try:
            self.runner.prefill_batch(requests)
            self._sync()
        except Exception as exc:
            error = str(exc)  # only the text: the exception's traceback holds the failed pass's tensors
            if len(batch) == 1:
                log.exception("take %s failed while preparing", batch[0][0].take_id)
        if error is not None:
            # Handled out here, once the traceback is gone: after running out of memory, the takes
            # retried one by one need the memory the failed pass still held inside the except clause.
            if len(batch) > 1:
                log.warning("batched prefill of %d takes failed (%s); prefilling them one by one", len(batch), error)
                for item in batch:
                    self._prefill([item])
            else:
                self._fail_preparing(batch[0][0], f"prefill failed: {error}")
            return
        self.metrics.prefill_call_time.observe(time.perf_counter() - t0)
        self.metrics.prefill_batch.observe(len(batch))
        if self.trace is not None:
            self._did["passes"] += 1
            self._did["rows"] += sum(count for _, count in batch)
        for take, count in batch:
            take.prefilled += count
            self.metrics.prompt_rows.labels("prefill").inc(count)
            self._keep_prompt(take)

    def _keep_prompt(self, take: Take) -> None:
        """Keep the blocks of the take's prompt rows computed so far for later takes. The block holding a
        whole prompt's last rows is kept only if the take can be promised the copy its first frame's write
        into that (then shared) block needs."""
        keys, slot = take.prompt_keys, take.model_slot
        if keys is None or slot is None:
            return
        with_whole = self.prompts.wants_whole(keys, take.prefilled) and self.runner.blocks.reserve(slot, 1)
        self.prompts.keep(keys, self.runner.blocks.slot_blocks(slot), take.prefilled, with_whole=with_whole)

    def _fail_broken_rebuilds(self) -> None:
        """Preparing takes whose rebuild call failed end with its error."""
        for take in [t for t in self.preparing if t.codec_error is not None]:
            self._fail_preparing(take, take.codec_error or "codec rebuild failed")

    def _fail_preparing(self, take: Take, error: str) -> None:
        self.preparing.remove(take)
        self._stop_preparing(take, EndReason.ERROR, error=error)

    def _promote_ready(self) -> bool:
        """Takes with their prompt in the cache, their codec state open and every kept frame handed to it start running
        (a rebuild call still in flight runs before their first chunk: the codec worker keeps the order)."""
        ready = [t for t in self.preparing
                 if not self._rows_left(t) and t.rebuild_left <= 0 and t.codec_error is None and t.codec_after is None]
        for take in ready:
            self.preparing.remove(take)
            self.prompts.unclaim(take.take_id)
            take.phase = Phase.RUNNING
            take.running_at = time.monotonic()
            take.prep_ms = (time.monotonic() - (take.prep_started or take.admitted)) * 1000.0
            self.metrics.prefill_time.observe(take.prep_ms / 1000.0)
            self.running.append(take)
        return bool(ready)

    # ------------------------------------------------------------------ stepping
    def _step(self) -> bool:
        runnable = []
        for take in self.running:
            self._absorb_codec_error(take)
            paused = take.channel.paused
            if paused and not take.paused:
                self.metrics.pauses.inc()
            take.paused = paused
            if not paused and take.frames < take.frame_cap and not take.ending:
                runnable.append(take)
        if not runnable:
            self._last_step_at = None
            self._hold.released()
            return False
        aside = self._batch_yield.decide(self._director_awaits_first_frame(runnable))
        if aside:  # batch work stands aside while a director waits for its first frame (engine/batch_yield)
            runnable = [t for t in runnable if not t.batch]
            if not runnable:
                return False  # the director's prefill pass comes in this round's preparation, nothing before it
        parked = self.worker.parked(False)
        if parked and step_held(runnable, self.steps + 1, parked, starting=self._interactive_starting()):
            self._hold.held()  # the codec is behind: this round does the rest of its work, then waits for room
            if self.trace is not None:
                self._did["held"] = True
            # Directors' ramps step on, while their own lane has room (a full one would block this round).
            runnable = ramp_while_held(runnable) if self.worker.has_room(priority=True) else []
            if not runnable:
                return False
        elif not aside:
            self._hold.released()
            now = time.perf_counter()
            if self._last_step_at is not None:  # a frame's wall time for every stream that keeps running
                self.metrics.step_interval.observe(now - self._last_step_at)
            self._last_step_at = now
        slots = [t.model_slot for t in runnable if t.model_slot is not None]
        if step_may_capture(self.runner, slots):
            # A CUDA graph capture forbids unsafe CUDA calls on other threads: let the codec finish first.
            self.worker.drain()
        try:
            result = self.runner.step(slots)
        except Exception as exc:
            log.exception("model step failed for %d slots", len(runnable))
            for take in runnable:
                take.ending, take.error = EndReason.ERROR, f"generation failed: {exc}"
                take.flushed = take.frames  # frames not sent yet are dropped, as a failed step leaves them
            return True
        self.steps += 1
        if self.trace is not None:
            self._did["steps"], self._did["batch"] = 1, len(runnable)
        self.metrics.step_time.observe(result.total_ms / 1000.0)
        self.metrics.step_batch.observe(len(runnable))
        made = 0
        for take, codes, stop in zip(runnable, result.codes, result.stop, strict=True):
            if stop:
                take.ending = EndReason.DONE
                continue
            take.codes.append(np.array(codes, dtype=np.int64))
            take.frames += 1
            if take.first_frame_at is None:
                take.first_frame_at = time.monotonic()
            made += 1
            if take.frames >= take.frame_cap:
                take.ending = EndReason.MAX_FRAMES
        self.metrics.add_frames(made)
        return True

    # ------------------------------------------------------------------ audio out
    def _flush_and_finish(self) -> bool:
        due = [t for t in self.running if t.pending > 0 and (t.ending or t.chunk_due(self.steps))]
        worked = False
        if due:
            self.calls.send(due, self.steps)
            worked = True
        return self._finish_ended() or worked

    def _absorb_codec_error(self, take: Take) -> None:
        """A decode of the take failed on the codec worker: it ends with that error (unless it was cancelled,
        then with the cancel's reason) and sends nothing more."""
        if take.codec_error is None or take.error is not None:
            return
        take.error = take.codec_error
        cancelled = take.channel.cancel_reason
        take.ending = (take.ending or cancelled) if cancelled is not None else EndReason.ERROR
        take.flushed = take.frames

    # ------------------------------------------------------------------ ending
    def _finish(self, take: Take, reason: EndReason, error: str | None = None) -> None:
        """The take's end: its model slot is given back (its KV blocks kept for retakes when usable), its codec state
        too, or, while a codec call still runs on it, once that is done (``draining``), and its end is pushed.
        Nothing of its audio goes out after this (muted)."""
        if reason is not EndReason.ERROR:
            error = None
        else:
            error = error or take.error or "generation failed"
        with take.out_lock:
            take.muted = True
        item = self._release_model(take, keep=reason is not EndReason.ERROR)
        if self.worker.done(take.codec_seq):
            self._release_codec(take, item)
        else:
            take.kept_item = item
            if item is not None:
                item.codec_pending = True
            self.draining.append(take)
        now = time.monotonic()
        first_ms = None if take.first_audio is None else (take.first_audio - take.admitted) * 1000.0
        queue_ms = ((take.prep_started or now) - take.admitted) * 1000.0
        prompt_ms = {} if take.submitted is None else {"prompt_ms": round((take.admitted - take.submitted) * 1000.0, 2)}
        timings = {**prompt_ms, "queue_ms": round(queue_ms, 2), "prefill_ms": round(take.prep_ms, 2),
                   **first_audio_path(take)}
        # Counted before the end event goes out, so whoever saw the end also sees it in /metrics.
        self.metrics.takes.labels(reason.value).inc()
        if reason in (EndReason.CANCELLED, EndReason.REPLACED):
            self.metrics.cancels.inc()
        self._on_done(take)
        event = TakeFinished(reason, take.frames, (now - take.admitted) * 1000.0, first_ms, error, timings)
        if self._held_ends is not None:
            self._held_ends.append((take, event))  # out after this round's interactive admissions
        else:
            take.channel.push(event)

    def _release(self, take: Take, *, keep: bool) -> None:
        """Give back the slot and the codec state (no codec call on it may be in flight); keep the cache blocks
        (KV and codec state) for retakes when they are usable."""
        self._release_codec(take, self._release_model(take, keep=keep))

    def _release_model(self, take: Take, *, keep: bool) -> Retained | None:
        """Give back the take's model slot; its KV blocks are kept for retakes (returned: the kept item, whose codec
        state _release_codec adds) when usable: a take that ran, made frames, and may be kept."""
        usable = (
            keep and take.phase is Phase.RUNNING and take.frames > 0 and take.retain_key is not None
            and take.model_slot is not None and self.retained.capacity > 0
        )
        self.prompts.unclaim(take.take_id)
        slot, take.model_slot = take.model_slot, None
        if slot is None:
            return None
        if not usable or take.retain_key is None:
            self.runner.free_slot(slot)
            return None
        item = Retained(self.runner.detach(slot), take.retain_key, take.codes_array(), None, take.batch)
        for evicted in self.retained.put(take.take_id, item):
            self._drop_retained(evicted)
        return None if item.dropped else item

    def _release_codec(self, take: Take, item: Retained | None) -> None:
        """Give back the take's codec state (no codec call on it in flight any more): kept with ``item`` for retakes
        when that is still kept and the state is sound, else closed. Its stream may have decoded past the frames
        the take sent (a cancel drops those): the kept state says how far (``frames``), and a retake resumes from it
        only where every key it needs is still there (can_resume)."""
        state, take.decoder = take.decoder, None
        take.kept_item = None
        if item is not None:
            item.codec_pending = False
        if state is None:
            return
        if item is not None and not item.dropped and take.codec_error is None and state.frames > 0 and not state.closed:
            item.codec = self.decoder.detach(state)  # its blocks stay for retakes; its slot is free again
        else:
            state.close()

    def fail_all(self, error: str) -> None:
        """End every take with an error and give back whatever it held (after an unexpected failure)."""
        self.worker.drain()  # no codec state is closed under a running decode
        for take in [*self.waiting, *self.preparing, *self.running]:
            try:
                self._finish(take, EndReason.ERROR, error=error)
            except Exception:  # keep ending the others
                log.exception("could not end take %s cleanly", take.take_id)
        self.waiting.clear()
        self.preparing.clear()
        self.running.clear()
        self._release_draining()
        self.prompts.clear()  # after an unexpected failure the device's copies are not to be trusted
        self._update_gauges()

    def _release_draining(self) -> None:
        """Codec states of takes that ended while a call ran on them (the worker is drained or stopped: none runs)."""
        for take in [*self.draining]:
            try:
                self._release_codec(take, take.kept_item)
            except Exception:  # keep going
                log.exception("could not give back the codec state of take %s", take.take_id)
        self.draining.clear()

    def shutdown(self) -> None:
        """End every take (reason shutdown) and free all slots (the engine has stopped the codec worker, or
        it runs inline: no decode is in flight)."""
        self.worker.drain()
        for take in list(self.waiting):
            self._finish(take, EndReason.SHUTDOWN)
        self.waiting.clear()
        for group in (self.preparing, self.running):
            for take in list(group):
                self._finish(take, EndReason.SHUTDOWN)
            group.clear()
        self._release_draining()
        for item in self.retained.clear():
            self._drop_retained(item)
        self.prompts.clear()
        self._update_gauges()
        if self.trace is not None:
            self.trace.close()


class _PhaseClock:
    """Times one round's parts (metrics: moss_rt_round_phase_seconds, moss_rt_round_seconds): ``lap`` is called
    with the part's result, once it returned (a part that comes twice in a round, as admissions do, adds up);
    ``done`` records them (rounds that did work only)."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.last_cpu = time.thread_time()
        self.laps: dict[str, list[float]] = {}  # part -> [wall, cpu] seconds

    def lap(self, phase: str, result: bool) -> bool:
        now, now_cpu = time.perf_counter(), time.thread_time()
        spent = self.laps.setdefault(phase, [0.0, 0.0])
        spent[0] += now - self.last
        spent[1] += max(0.0, now_cpu - self.last_cpu)
        self.last, self.last_cpu = now, now_cpu
        return result

    def done(self) -> None:
        for phase, (seconds, cpu) in self.laps.items():
            self.metrics.round_phase_time.labels(phase).observe(seconds)
            self.metrics.round_phase_cpu.labels(phase).inc(cpu)
        self.metrics.round_time.observe(self.last - self.start)


def first_audio_path(take: Take) -> dict[str, float]:
    """Where a take's first audio's time went after its preparation, in ms (each step that happened): from running
    to its first frame (waiting for a round's step), from that frame to the codec worker (the round's other work), in
    the worker's queue (calls ahead of it), and its decode."""
    marks = (("to_first_frame_ms", take.running_at, take.first_frame_at),
             ("to_codec_ms", take.first_frame_at, take.first_chunk_at),
             ("codec_queue_ms", take.first_chunk_at, take.first_decode_at),
             ("decode_ms", take.first_decode_at, take.first_audio))
    return {name: round((b - a) * 1000.0, 2) for name, a, b in marks if a is not None and b is not None}


def step_may_capture(runner: object, slots: list[int]) -> bool:
    """Whether ``runner.step(slots)`` may capture a CUDA graph first (its (batch, keys) graph is missing).

    Reads the runner's bucket rules; if they are not there (another runner, or they changed), it answers
    True whenever any graph is missing: the worker is then drained before such steps, which is slower but safe.
    """
    pending_graphs = getattr(runner, "pending_graphs", None)
    pending = pending_graphs() if pending_graphs is not None else []
    if not pending or not slots:
        return False
    try:
        need = max(slots) + 1
        batch = min(b for b in runner._batch_buckets() if b >= need)  # type: ignore[attr-defined]
        lengths = runner._lengths  # type: ignore[attr-defined]
        keys = runner._key_bucket(max(int(lengths[s]) for s in slots) + 1)  # type: ignore[attr-defined]
    except Exception:
        return True
    return (batch, keys) in pending
