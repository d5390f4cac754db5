"""Prometheus metrics of the real engine, in a registry of its own (one per engine instance).

A private registry (not prometheus_client's global one) lets several engines live in one
process, as they do in tests; ``/metrics`` renders whichever registry the served engine owns.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary

from moss_rt.engine.memory_plan import MemoryPlan

# Latency buckets (seconds) sized for 80 ms frames: first audio is expected in 0.05-0.5 s.
TTFA_BUCKETS = (0.02, 0.05, 0.08, 0.12, 0.16, 0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0)
STEP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.2, 0.4, 0.8, 1.6)
# Parts of one admission: tens of microseconds to a few milliseconds.
ADMIT_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05)
# The garbage collector's runs: a young generation's in microseconds, a full one over a large heap in 100s of ms.
GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.active_slots = Gauge("moss_rt_active_slots", "Takes holding a slot (prefilling or generating)", registry=r)
        self.queued = Gauge("moss_rt_queued_takes", "Admitted takes waiting for a slot", registry=r)
        self.paused_slots = Gauge("moss_rt_paused_slots", "Slots paused because their client is behind", registry=r)
        self.ttfa = Histogram(
            "moss_rt_gpu_first_seconds", "Take admitted -> first PCM ready (server-side TTFA)",
            buckets=TTFA_BUCKETS, registry=r,
        )
        self.step_time = Histogram(
            "moss_rt_step_seconds", "One batched model step (all runnable slots, one frame each)",
            buckets=STEP_BUCKETS, registry=r,
        )
        self.codec_time = Histogram(
            "moss_rt_codec_seconds",
            "One batched streaming codec decode (slots whose chunk is due), timed on the thread that runs it",
            buckets=STEP_BUCKETS, registry=r,
        )
        # Which codec calls the time goes to: a call's chunk length (frames per stream) and whether a CUDA graph ran it
        # (a large batch of an odd length runs eagerly). Where the codec's share of a step goes at large batch: the
        # steady eight-frame calls, the one-frame ramp calls, or the odd-length chunks that bring a take in phase and
        # end it.
        self.codec_shape_time = Summary(
            "moss_rt_codec_call_shape_seconds",
            "Codec decode calls by chunk length in frames and by whether a CUDA graph ran them (1) or they ran eagerly",
            ["frames", "graphed"], registry=r,
        )
        self.codec_wait = Histogram(
            "moss_rt_codec_wait_seconds",
            "Times the scheduler waited for the codec worker (a graph capture or a job behind queued decodes, a "
            "priority hand-over with its lane full) or held its model step back for room in the codec's bulk lane "
            "(first held round to the step that ran); with the codec overlapped, the rest of codec time ran "
            "alongside model steps",
            buckets=STEP_BUCKETS, registry=r,
        )
        self.steps_held = Counter(
            "moss_rt_steps_held_total",
            "Rounds whose model step was held back because the codec's bulk lane was full and a hand-over already "
            "waited behind it (the round went on with cancels, admissions and prefill instead of blocking)",
            registry=r,
        )
        # The engine thread's own CPU time beside the wall times above: a part whose wall time is far above its CPU
        # time waited, for the interpreter lock (another thread's Python: the codec worker's, the loop's) or a
        # blocking call, not for its own work.
        self.admit_part_cpu = Counter(
            "moss_rt_admit_part_cpu_seconds", "Engine-thread CPU time of each admission part (see "
            "moss_rt_admit_part_seconds: the gap between them is time the thread waited)", ["part"], registry=r,
        )
        self.round_phase_cpu = Counter(
            "moss_rt_round_phase_cpu_seconds", "Engine-thread CPU time of each part of a scheduling round (see "
            "moss_rt_round_phase_seconds: the gap between them is time the thread waited)", ["phase"], registry=r,
        )
        self.admit_part_time = Histogram(
            "moss_rt_admit_part_seconds",
            "Engine-thread time of each part of admitting a take (match: prompt rows and kept caches looked up; "
            "room: KV blocks promised, kept caches evicted; kv: its slot and cache blocks; sampling: its sampling "
            "state set; codec: its codec stream opened; apply: once a round, the device writes of that round's "
            "admissions, batched)",
            ["part"], buckets=ADMIT_BUCKETS, registry=r,
        )
        self.codec_pending = Gauge("moss_rt_codec_pending_calls", "Codec calls queued or running on the codec worker",
                                   registry=r)
        self.codec_overlap = Gauge(
            "moss_rt_codec_overlap", "1 when codec calls run on their own thread (and CUDA stream) next to model steps",
            registry=r,
        )
        self.prefill_time = Histogram(
            "moss_rt_prefill_seconds", "Prompt prefill of one take (all chunks)", buckets=TTFA_BUCKETS, registry=r
        )
        self.prefill_batch = Histogram(
            "moss_rt_prefill_batch_size",
            "Takes whose prompt chunks shared one prefill pass (one backbone call on CUDA, slot by slot on the CPU)",
            buckets=(1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128), registry=r,
        )
        self.prefill_call_time = Histogram(
            "moss_rt_prefill_call_seconds", "One batched prefill pass (every take in it, padded to the longest chunk)",
            buckets=STEP_BUCKETS, registry=r,
        )
        self.prefill_stream_rows = Gauge(
            "moss_rt_prefill_stream_rows",
            "Padded prompt rows a prefill pass may hold while takes stream (sized at warm-up to prefill_budget_ms)",
            registry=r,
        )
        # Where the engine thread's time goes, round by round: a take arriving waits for the round in progress (its
        # queue time), so long rounds are what a director's first audio sees first.
        self.round_time = Histogram(
            "moss_rt_round_seconds", "One scheduling round on the engine's thread (cancels, the step, chunks to the "
            "codec, admissions, preparation, captures)", buckets=STEP_BUCKETS, registry=r,
        )
        self.round_phase_time = Histogram(
            "moss_rt_round_phase_seconds", "Engine-thread time of each part of a scheduling round that did work "
            "(control, step, flush, admit, prepare, capture; jobs: renders and encodes between rounds)",
            ["phase"], buckets=STEP_BUCKETS, registry=r,
        )
        self.step_interval = Histogram(
            "moss_rt_step_interval_seconds",
            "Start of one batched step to the next while takes keep running: a frame's wall time as running streams "
            "see it (the step, prefill passes, codec waits and host work between steps); above 0.08 the streams fall "
            "behind real time",
            buckets=STEP_BUCKETS, registry=r,
        )
        self.step_batch = Histogram(
            "moss_rt_step_batch_size", "Slots advanced per step", buckets=(1, 2, 4, 8, 16, 32, 48, 64, 96, 128),
            registry=r,
        )
        self.frames = Counter("moss_rt_frames_total", "80 ms frames generated", registry=r)
        self.frames_per_sec = Gauge("moss_rt_frames_per_second", "Frames generated per second (recent)", registry=r)
        self.takes = Counter("moss_rt_takes_total", "Finished takes by end reason", ["reason"], registry=r)
        self.cancels = Counter("moss_rt_cancels_total", "Takes stopped by cancel, barge-in or disconnect", registry=r)
        self.seeks = Counter("moss_rt_seeks_total", "Retakes started from a frame of an earlier take", ["path"],
                             registry=r)
        self.pauses = Counter("moss_rt_pauses_total", "Times a slot was paused for a slow client", registry=r)
        self.busy = Counter("moss_rt_busy_rejections_total", "Takes refused because slots and queue were full",
                            registry=r)
        self.kv_blocks_free = Gauge("moss_rt_kv_blocks_free", "Blocks of the paged KV cache not held by any take",
                                    registry=r)
        self.kv_blocks_total = Gauge("moss_rt_kv_blocks_total", "Blocks of the paged KV cache (scratch excluded)",
                                     registry=r)
        self.kv_blocks_promised = Gauge(
            "moss_rt_kv_blocks_promised", "Free KV blocks promised to running takes (their remaining budget)",
            registry=r,
        )
        self.prompt_cache_blocks = Gauge(
            "moss_rt_prompt_cache_blocks",
            "KV blocks kept for later takes whose prompts open with the same rows (given back when room is needed)",
            registry=r,
        )
        self.prompt_rows = Counter(
            "moss_rt_prompt_rows_total",
            "Prompt rows that entered takes' caches, by source: prefill (computed) or cache (shared from kept blocks)",
            ["source"], registry=r,
        )
        self.retained_caches = Gauge("moss_rt_retained_caches", "Finished takes whose cache is kept for retakes",
                                     registry=r)
        self.codec_states = Counter(
            "moss_rt_codec_states_total",
            "How takes' codec streaming states began: fresh, shared (a retake continuing from its parent's kept "
            "blocks, nothing decoded) or rebuilt (the kept frames decoded again)",
            ["source"], registry=r,
        )
        self.codec_rebuild_calls = Counter(
            "moss_rt_codec_rebuild_calls_total",
            "Batched codec calls that rebuilt retakes' streaming states (preparing takes' next frames, batched)",
            registry=r,
        )
        self.codec_rebuild_frames = Counter(
            "moss_rt_codec_rebuild_frames_total", "Kept frames decoded again to rebuild codec states", registry=r
        )
        self.gc_pause = Histogram(
            "moss_rt_gc_pause_seconds",
            "Runs of the garbage collector, by generation (2: a full collection), on whichever thread triggered it: "
            "that thread stood still meanwhile (engine/gc_pauses.py)",
            ["generation"], buckets=GC_BUCKETS, registry=r,
        )
        self.codec_queued = Histogram(
            "moss_rt_codec_queued_seconds",
            "A codec call's wait from its hand-over to its start, by lane (a bulk call that waited its patience, "
            "codec_bulk_patience_ms or codec_batch_patience_ms, goes before priority calls)",
            ["lane"], buckets=STEP_BUCKETS, registry=r,
        )
        self.codec_calls = Counter(
            "moss_rt_codec_calls_total",
            "Codec decode calls started, by lane: priority (interactive takes' first chunks, their rebuilds) or bulk "
            "(steady chunks and batch work, at most codec_call_streams streams a call)",
            ["lane"], registry=r,
        )
        self.cancel_dropped_frames = Counter(
            "moss_rt_cancel_dropped_frames_total",
            "Frames cancelled takes had made but not sent: dropped, not decoded (their end goes out at once)",
            registry=r,
        )
        self.codec_kept_states = Gauge(
            "moss_rt_codec_kept_states",
            "Finished takes whose codec state blocks are kept for retakes (given back when room is needed)",
            registry=r,
        )
        self.codec_blocks_free = Gauge(
            "moss_rt_codec_blocks_free", "Blocks of the codec state pools held by no stream or kept state",
            registry=r,
        )
        self.plan_bytes = Gauge(
            "moss_rt_memory_plan_bytes",
            "The start-up memory plan by part (total, in_use, budget, backbone_cache, codec_state, work, margin)",
            ["part"], registry=r,
        )
        self.plan_slots = Gauge("moss_rt_memory_plan_slots", "Concurrent takes the memory plan holds", registry=r)
        self.plan_seq_len = Gauge("moss_rt_memory_plan_max_seq_len", "Cache positions per take in the plan",
                                  registry=r)
        self.graphs_pending = Gauge(
            "moss_rt_graphs_pending",
            "CUDA graphs (model step and codec shapes) not captured yet: captured while the engine is idle; until "
            "then their shapes run eagerly or are captured on use, so speed settles once this reaches 0",
            registry=r,
        )
        self.startup = Gauge(
            "moss_rt_startup_seconds",
            "Seconds each phase of the engine's start took (engine/startup.py): process = process start to engine "
            "start, ready = process start to ready; the 'compile: ...' phases ran on threads beside the others",
            ["phase"], registry=r,
        )
        self._window_start = time.monotonic()
        self._window_frames = 0

    def set_plan(self, plan: MemoryPlan) -> None:
        for part, value in (
            ("total", plan.total_bytes),
            ("in_use", plan.in_use_bytes),
            ("budget", plan.budget_bytes),
            ("backbone_cache", plan.backbone_cache_bytes),
            ("codec_state", plan.codec_state_bytes),
            ("work", plan.work_bytes),
            ("margin", plan.margin_bytes),
        ):
            self.plan_bytes.labels(part).set(value)
        self.plan_slots.set(plan.max_slots)
        self.plan_seq_len.set(plan.max_seq_len)

    def add_frames(self, n: int) -> None:
        """Count frames and refresh the frames/s gauge about once a second."""
        self.frames.inc(n)
        self._window_frames += n
        now = time.monotonic()
        if now - self._window_start >= 1.0:
            self.frames_per_sec.set(self._window_frames / (now - self._window_start))
            self._window_start, self._window_frames = now, 0

    def idle(self) -> None:
        now = time.monotonic()
        if now - self._window_start >= 1.0:
            self.frames_per_sec.set(self._window_frames / (now - self._window_start))
            self._window_start, self._window_frames = now, 0


class PartClock:
    """Times the parts of one piece of engine-thread work into a histogram labelled by part: ``lap(part)`` once each
    part is done (the time since the previous lap, or since the clock was made); with ``cpu``, the thread's own CPU
    time of each part too (a counter by the same label)."""

    # The labelled children of each (metric, part), looked up once: prometheus_client's ``labels()`` validates and
    # locks on every call, and an admission laps five parts (64 retakes in a burst: 640 lookups on the engine's thread).
    _children: weakref.WeakKeyDictionary[Histogram | Counter, dict[str, Any]] = weakref.WeakKeyDictionary()

    def __init__(self, histogram: Histogram, cpu: Counter | None = None) -> None:
        self.histogram = histogram
        self.cpu = cpu
        self.last = time.perf_counter()
        self.last_cpu = time.thread_time()

    def lap(self, part: str) -> None:
        now, now_cpu = time.perf_counter(), time.thread_time()
        self._child(self.histogram, part).observe(now - self.last)
        if self.cpu is not None:
            self._child(self.cpu, part).inc(max(0.0, now_cpu - self.last_cpu))
        self.last, self.last_cpu = now, now_cpu

    @classmethod
    def _child(cls, metric: Histogram | Counter, part: str) -> Any:
        children = cls._children.setdefault(metric, {})
        child = children.get(part)
        if child is None:
            child = children[part] = metric.labels(part)
        return child
