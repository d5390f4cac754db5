"""The real engine: MOSS-TTS-Local v1.5 + MOSS-Audio-Tokenizer-v2 behind the engine seam.

One worker thread owns the device: it loads the model and codec, warms them up, and then runs the
:class:`~moss_rt.engine.scheduler.Scheduler` round after round. Its codec worker
(:mod:`~moss_rt.engine.codec_worker`, started and stopped by it) runs every codec call on a thread and CUDA
stream of its own, overlapped with the next model steps (``codec_overlap``; off: the same calls inline).
The event loop only enqueues (takes into a bounded inbox, renders and reference encodes into a bounded job
queue) and awaits events through each take's :class:`~moss_rt.engine.channel.TakeChannel`; it never touches
a tensor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import inspect
import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moss_rt import __version__ as moss_rt_version
from moss_rt.config import Settings
from moss_rt.engine import gpu_streams
from moss_rt.engine.arrivals import SubmitsInFlight, gather_burst
from moss_rt.engine.base import (
    EngineBusy,
    EngineInfo,
    EngineLifecycle,
    EngineLoading,
    EngineStatus,
    TakeSpec,
    checked_codes,
)
from moss_rt.engine.codec_batch import READY_MAX_BUCKET, CodecBatcher
from moss_rt.engine.codec_worker import DEFAULT_MAX_PENDING, CodecWorker
from moss_rt.engine.compile_workers import CompileWorkers, KernelJob, current_target, why_unsupported
from moss_rt.engine.gc_pauses import GcPauses, freeze_start_objects, unfreeze
from moss_rt.engine.jobs import EncodeJob, Job, RenderJob
from moss_rt.engine.kept_digests import KeptDigests
from moss_rt.engine.kernel_manifest import MANIFEST_NAME, load_jobs, manifest_paths, save_jobs
from moss_rt.engine.kernel_preload import KernelPreload, PreloadCounts
from moss_rt.engine.memory_plan import DEFAULT_CPU_SLOTS, GIB, MemoryPlan, plan_memory
from moss_rt.engine.metrics import EngineMetrics
from moss_rt.engine.prefill_cost_record import FILE_NAME as COST_FILE
from moss_rt.engine.prefill_cost_record import record_cost, recorded_cost
from moss_rt.engine.prefill_cost_record import setup_key as cost_setup_key
from moss_rt.engine.prefill_pace import PrefillCost, measure_prefill_cost
from moss_rt.engine.prompt_names import PromptRecipe
from moss_rt.engine.prompts import (
    PromptRowsCache,
    PromptTooLong,
    cheap_to_build,
    frames_room,
    prompt_key,
    prompt_rows,
)
from moss_rt.engine.resolve import (
    Choice,
    choose_codec,
    choose_model,
    demo_banner,
    has_random_weights,
    placement,
    tiny_model_dir,
)
from moss_rt.engine.round_trace import RoundTrace
from moss_rt.engine.scheduler import Scheduler, SchedulerConfig
from moss_rt.engine.slots import EngineChannel, Take
from moss_rt.engine.startup import StartupTimeline, process_age, warm_cuda
from moss_rt.engine.warm_compile import (
    AheadCompiles,
    TritonCompileLog,
    ahead_marker,
    codec_chains,
    compile_threads,
    earlier_ahead_compiles,
    model_chains,
)
from moss_rt.generation import FRAME_RATE, N_CODEBOOKS, SamplingParams
from moss_rt.protocol import DEFAULT_MODEL_ALIAS, ErrorCode, ProtocolError

if TYPE_CHECKING:
    from moss_rt.codec.model import CodecModel
    from moss_rt.model.config import MossTTSConfig
    from moss_rt.model.runner import ModelRunner

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1  # nothing to do: sleep until woken (submit, cancel, job) or this long
# A graph capture while idle holds a take that arrives meanwhile for its length (0.1-0.3 s at full size): one starts
# only once the engine has had nothing to do for this long, so a director taking take after take (a gap of a few
# hundred ms between them) is not met by one each time. Measured on an H200 right after ready: first audio 182 ms p50
# over three takes in a row while the idle captures ran, against 26 ms once they were done.
IDLE_CAPTURE_QUIET_S = 1.0
# A lone take's step graphs are captured before ready for key windows up to this many positions (a 400-row line and
# 150 frames reach 550): on a freshly started H200 the first take after ready met its window's graph uncaptured and
# waited ~100 ms for the capture (and a take reaching the next window waits for it in the middle of its stream).
# Each costs the start ~0.1 s; longer windows are captured while idle.
LONE_TAKE_KEYS = 1024
# The compile workers stay after ready while the idle-time captures run, until every graph is captured or for at most
# this long: on a freshly started H200 a step capture at a new batch size met a kernel no warm-up pass had (953 ms
# compiling in this process, the GIL taken from the event loop's thread meanwhile), and since the manifest was written
# at ready, every fresh machine met it again. In the workers it compiles beside this process, and is written down.
COMPILE_WORKERS_AFTER_READY_S = 180.0
PAUSED_POLL_S = 0.005  # only paused slots: poll their channels this often
SMALL_MODEL_PARAMS = 50_000_000  # below this, CPU inference runs single-threaded
# Largest chunk the streaming decoder runs in one forward (longer ones are split). It sets each stream's
# ring headroom: 8 (the default chunk) instead of 25 cuts the codec state per stream by about 11 %.
CODEC_CHUNK_FRAMES = 8
CODEC_EXTRA_STREAMS = 2  # codec decoder slots beyond one per take: a render and the warm-up stream
# Codec calls queued or running before the scheduler waits for the codec: the codec's lead over the model
# (and the audio it holds back) stays within this many calls.
CODEC_MAX_PENDING = DEFAULT_MAX_PENDING


def lone_take_keys(buckets: Sequence[int]) -> list[int]:
    """The key buckets whose one-take step graph is captured before ready: each one up to the first that holds
    LONE_TAKE_KEYS positions (or all, when none does)."""
    out = []
    for bucket in buckets:
        out.append(bucket)
        if bucket >= LONE_TAKE_KEYS:
            break
    return out


class MossEngine(EngineLifecycle):
    """The production engine (see module docstring). Construct, then ``await start()``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        spec = settings.model.strip()
        likely_demo = (
            spec == "tiny" or (spec == "auto" and not torch.cuda.is_available()) or has_random_weights(spec)
        )
        self._info = EngineInfo(
            name="moss",
            models=(DEFAULT_MODEL_ALIAS,),
            default_model=DEFAULT_MODEL_ALIAS,
            demo=likely_demo,
            device=settings.device,
            details={"model": spec, "codec": settings.codec.strip()},
        )
        self.metrics = EngineMetrics()
        lead_sec = settings.max_lead_sec if settings.max_lead_sec > 0 else 20.0
        self._lead_frames = max(1, int(lead_sec * FRAME_RATE))
        self.memory_plan: MemoryPlan | None = None  # made at start, once the weights are loaded
        # Until the plan is made, capacity is what the settings say (nothing is admitted before then).
        self._capacity = (settings.max_slots or DEFAULT_CPU_SLOTS) + settings.max_queue
        # A take cutting in on a socket's streaming take is submitted while that one stops (web/ws: early
        # admission): for a moment both count. It may go past capacity by up to this much (the slots: one take
        # replaced by one new take each), so a director at a full server is not refused a retake it was given
        # before, when the replaced take had ended first.
        self._barge_in_room = settings.max_slots or DEFAULT_CPU_SLOTS
        # Admission is counted here, so the inbox can never be full when put_nowait runs.
        self._inbox: queue.Queue[Take] = queue.Queue(maxsize=self._capacity + self._barge_in_room)
        self._jobs_in: queue.Queue[Job] = queue.Queue(maxsize=max(4, settings.max_queue))
        self._jobs: deque[Job] = deque()
        self._admit_lock = threading.Lock()
        self._prompts_built = PromptRowsCache()  # retakes with a new seed are not tokenized again (event loop only)
        self._in_system = 0
        self._submits = SubmitsInFlight()  # accepted, not in the inbox yet (an idle engine waits for a burst's)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._loaded: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Written by the worker thread (and close), read anywhere: one enum attribute, replaced whole.
        self._status = EngineStatus.LOADING
        self._scheduler: Scheduler | None = None
        self._codec: object | None = None
        self._decoder: object | None = None
        self._batcher: CodecBatcher | None = None
        self._codec_worker: CodecWorker | None = None
        self._runner: ModelRunner | None = None
        self._device = torch.device("cpu")
        self._graphs_done = False  # every CUDA graph captured (or nothing left to try)
        # The prompt blocks kept for later takes, by key: a cluster replica reports them to its routers.
        self.kept_prompts = KeptDigests()
        self.startup = StartupTimeline(self.metrics.startup)  # the seconds of each phase of the start
        self._gc_pauses = GcPauses(self.metrics.gc_pause)  # installed while the engine's thread runs
        self._busy_at = 0.0  # when the engine last had work (idle captures wait IDLE_CAPTURE_QUIET_S after it)
        self._ahead_marker: Path | None = None  # the Triton cache's "every kernel compiled" file, to write once warm
        self._compiles: AheadCompiles | None = None  # kernels compiling ahead of the warm-up's captures
        self._compile_log: TritonCompileLog | None = None
        self._compile_workers: CompileWorkers | None = None  # processes compiling the kernels the chains meet
        self._workers_deferred = False  # not started with the load: an earlier start compiled into this cache
        self._kernel_preload: KernelPreload | None = None  # an earlier start's kernels, loaded beside the load
        self.kernel_preload_counts: PreloadCounts | None = None  # what it loaded (tests, the log)
        # The Triton kernels the warm-up's captures compiled or loaded themselves (none when all were ahead); CUDA only.
        self.kernels_met_in_warm_up: list[str] | None = None
        self.prefill_cost_measured: bool | None = None  # timed at this start (False: an earlier start's record)
        # What the workers did by ready (and again once they ended): (compiled there, compiled here instead, seconds).
        self.compile_workers_counts: tuple[int, int, float] | None = None
        self._workers_retire_at: float | None = None  # kept after ready (idle captures) until every graph or this

    # ------------------------------------------------------------------ the seam
    @property
    def info(self) -> EngineInfo:
        return dataclasses.replace(
            self._info, status=self._status, metrics=self.metrics.registry, memory_plan=self.memory_plan
        )

    @property
    def _ready(self) -> bool:
        return self._status is EngineStatus.READY

    @property
    def active_count(self) -> int:
        """Takes holding a slot (read by tests and /api/info; written by the worker)."""
        s = self._scheduler
        return 0 if s is None else s.active_count

    @property
    def queued_count(self) -> int:
        s = self._scheduler
        return 0 if s is None else len(s.waiting) + self._inbox.qsize()

    def begin_loading(self) -> None:
        """Start loading now, on the engine's thread, before the event loop runs (``serve`` calls this as soon as the
        engine is built, so the model loads while the web app is imported and built and the session store opens);
        ``start`` then only waits. Idempotent; ``start`` calls it where nobody did."""
        if self._thread is not None:
            return
        age = process_age()
        if age is not None:
            self.startup.record("process", age)  # Python, the imports: until the engine starts
        self._use_kernel_cache()
        warm_cuda(self.settings)  # the CUDA context comes up while the engine's thread imports the model's code
        self._thread = threading.Thread(target=self._run, name="moss-rt-engine", daemon=True)
        self._thread.start()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.begin_loading()
        await asyncio.wrap_future(self._loaded)

    async def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 30.0)
        self._status = EngineStatus.STOPPED
        if self._thread is None or not self._thread.is_alive():
            await asyncio.to_thread(self._release_device_memory)

    def _use_kernel_cache(self) -> None:
        """Triton's compiled kernels go to ``<data dir>/triton-cache`` unless TRITON_CACHE_DIR says otherwise: a
        container restarted with its data volume then loads them instead of compiling them again (most of a start on
        a cold cache). Set before the engine's thread compiles anything; on CUDA only (nothing compiles elsewhere)."""
        if "TRITON_CACHE_DIR" in os.environ:
            log.info("Triton kernel cache: %s (TRITON_CACHE_DIR)", os.environ["TRITON_CACHE_DIR"])
            return
        try:
            if placement(self.settings).device.type != "cuda":
                return
        except RuntimeError:  # a device or dtype that cannot be used: _load says so, as the start's failure
            return
        folder = (self.settings.data_dir / "triton-cache").resolve()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("Triton kernel cache: cannot create %s (%s); using Triton's default", folder, exc)
            return
        os.environ["TRITON_CACHE_DIR"] = str(folder)
        log.info("Triton kernel cache: %s (in the data dir; TRITON_CACHE_DIR overrides)", folder)

    def _release_device_memory(self) -> None:
        """Drop the model, codec and their caches once the worker has stopped, so another engine in this
        process (tests, a restart) can plan with that memory: the app may keep this object alive."""
        self._scheduler = None
        self._runner = None
        self._batcher = None
        self._decoder = None
        self._codec = None
        self._gc_pauses.uninstall()
        unfreeze()  # this engine's objects (frozen at its start) can be collected again
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    async def submit(self, spec: TakeSpec) -> EngineChannel:
        submitted = time.monotonic()
        if self._stop.is_set():
            raise EngineBusy(retry_after_sec=5.0)  # shutting down: come back later
        if self._loop is None or not self._ready:
            raise EngineLoading(retry_after_sec=5.0)
        with self._submits.one():  # on its way: an idle engine that has a take waits for this one too
            prompt = await self._checked_prompt(spec)
            # One turn of the event loop before it lands: the messages that came with this one are read and their
            # submits counted in flight first (a prompt built on the spot never awaited).
            await asyncio.sleep(0)
            if not self._ready or self._stop.is_set():
                # close() ran during the check: the stopped worker would never read the inbox again.
                raise EngineBusy(retry_after_sec=5.0)
            with self._admit_lock:
                if self._in_system >= self._capacity + (self._barge_in_room if spec.barge_in else 0):
                    self.metrics.busy.inc()
                    raise EngineBusy(retry_after_sec=1.0)
                self._in_system += 1
            channel = EngineChannel(self._loop, spec.take_id, self._lead_frames, wake=self._wake)
            self._inbox.put_nowait(Take(spec, channel, prompt=prompt, submitted=submitted))
        self._wake.set()  # after the count dropped: an idle engine gathering a burst sees this take landed
        return channel

    async def _checked_prompt(self, spec: TakeSpec) -> np.ndarray:
        """The take's prompt rows, tokenized on a helper thread, or here when only a short piece of it is new
        (engine/prompts.cheap_to_build; the worker reuses them); a prompt the KV cache can never hold is refused as
        bad input before it takes a queue place."""
        runner = self._runner
        assert runner is not None, "ready implies loaded"
        key = prompt_key(spec)
        rows = self._prompts_built.get(key)
        if rows is None:
            if cheap_to_build(runner, spec):  # a retake with a new direction: its line's tokens are remembered
                built = prompt_rows(runner, spec)
            else:
                built = await asyncio.to_thread(prompt_rows, runner, spec)
            rows = self._prompts_built.put(key, built)
        max_seq = int(runner.max_seq_len)
        try:
            frames_room(len(rows), spec.start_frame, max_seq)
        except PromptTooLong as exc:
            # The prompt alone too long: the text (or instruction, reference) is at fault;
            # otherwise the retake point is too late for the cache.
            blame = "text" if len(rows) >= max_seq else "frame"
            raise ProtocolError(ErrorCode.INVALID_FIELD, str(exc), field=blame) from None
        return rows

    def prompt_recipe(self) -> PromptRecipe | None:
        """What a front end without the model needs to name takes' prompt blocks as this engine keeps them
        (cluster routing); None before the model is loaded or with the prompt cache off."""
        runner, scheduler = self._runner, self._scheduler
        if runner is None or scheduler is None or not scheduler.prompts.enabled:
            return None
        return PromptRecipe.of(runner.tokenizer, runner.config, runner.blocks.block_size)

    async def render(self, codes: np.ndarray, channels: int) -> bytes:
        codes = checked_codes(codes, self._info.codebook_size)  # damaged codes never reach the codec
        if codes.shape[0] == 0:
            return b""
        job = RenderJob(codes, channels, self._require_batcher())
        return await self._run_job(job)  # type: ignore[return-value]

    async def encode_reference(self, audio: bytes) -> np.ndarray:
        if self._codec is None:
            raise EngineLoading(retry_after_sec=5.0)
        job = EncodeJob(audio, self._codec, self.settings.limits.max_upload_seconds)  # type: ignore[arg-type]
        return await self._run_job(job)  # type: ignore[return-value]

    def _require_batcher(self) -> CodecBatcher:
        if self._batcher is None:
            raise EngineLoading(retry_after_sec=5.0)
        return self._batcher

    async def _run_job(self, job: Job) -> object:
        try:
            self._jobs_in.put_nowait(job)
        except queue.Full:
            raise EngineBusy(retry_after_sec=1.0) from None
        self._wake.set()
        return await asyncio.wrap_future(job.future)

    # ------------------------------------------------------------------ worker thread
    def _run(self) -> None:
        t0 = time.perf_counter()
        self._gc_pauses.install()
        switch_before = sys.getswitchinterval()
        if self.settings.gil_switch_ms > 0:  # process-wide: the engine's thread waits less for the GIL (config)
            sys.setswitchinterval(self.settings.gil_switch_ms / 1000.0)
            log.info("Python's GIL switch interval: %.2f ms", 1000.0 * sys.getswitchinterval())
        try:
            self._load()
            self._warm_up()
            with self.startup.phase("start's objects out of the collector's way (gc.freeze)"):
                frozen = freeze_start_objects()
            log.info("start-up: %d objects frozen: the garbage collector no longer walks them", frozen)
        except BaseException as exc:
            log.exception("engine failed to load")
            self._end_compiles()
            self._stop_codec_worker()
            self._status = EngineStatus.FAILED
            if not self._loaded.done():
                self._loaded.set_exception(exc)
            sys.setswitchinterval(switch_before)
            return
        self.metrics.graphs_pending.set(self._graphs_pending())
        self.startup.record("engine", time.perf_counter() - t0)
        age = process_age()
        if age is not None:
            self.startup.record("ready", age)
        log.info("ready: %s", self.startup.summary())
        # The warm-up was work: the first idle capture waits its quiet time after ready too, so a client that waited
        # for ready and starts at once is not met by a capture in progress (on a freshly started H200 the first take
        # met one: 128 ms in the engine's queue, the next takes 4 ms).
        self._busy_at = time.monotonic()
        self._status = EngineStatus.READY
        if not self._loaded.done():
            self._loaded.set_result(None)
        try:
            with gpu_streams.high_priority(self._device, self.settings.stream_priorities):
                self._serve()
        finally:
            self._status = EngineStatus.STOPPED
            self._shutdown()
            sys.setswitchinterval(switch_before)  # the process's own again (an engine closed, another may start)

    def _serve(self) -> None:
        sched = self._scheduler
        assert sched is not None
        while not self._stop.is_set():
            self._wake.clear()
            was_idle = sched.idle
            landed = self._drain_inbox(sched)
            if landed and was_idle:
                self._gather_burst(sched, landed)
            try:
                worked = sched.iterate()
            except Exception:  # a scheduler bug must not leave every client hanging on a dead thread
                log.exception("scheduling round failed; ending every take with an error")
                sched.fail_all("internal engine error")
                worked = True
            t_jobs = time.perf_counter()
            if self._run_jobs(streaming=bool(sched.running)):
                worked = True
                self.metrics.round_phase_time.labels("jobs").observe(time.perf_counter() - t_jobs)
            now = time.monotonic()
            if self._workers_retire_at is not None and now >= self._workers_retire_at:
                self._retire_compile_workers()  # the idle captures did not finish in their time: compile here
            if self._idle_capture_due(worked, sched.idle, now) and self._capture_idle():
                continue
            if not worked:
                self.metrics.idle()
                self._wake.wait(PAUSED_POLL_S if sched.has_paused or sched.preparing else IDLE_WAIT_S)

    def _idle_capture_due(self, worked: bool, idle: bool, now: float) -> bool:
        """Whether an idle-time capture may start now: nothing to do, for IDLE_CAPTURE_QUIET_S at least."""
        if worked or not idle:
            self._busy_at = now
            return False
        return now - self._busy_at >= IDLE_CAPTURE_QUIET_S

    def _capture_idle(self) -> bool:
        """Capture one missing CUDA graph while nothing runs (a take arriving now waits for it, 0.1-0.3 s).

        The step graphs (with the model's prefill graphs of longer key windows among them, runner.capture_next), then
        the codec's odd chunk lengths. The codec's first- and full-chunk shapes are captured
        before ready (_warm_up) up to its READY_MAX_BUCKET; the larger ones, and one still missing (a capture there
        failed), come first: a burst meeting one uncaptured decodes eagerly (about 55 ms a call) and then has it
        captured under load, stalling every stream."""
        runner, batcher, worker = self._runner, self._batcher, self._codec_worker
        if self._graphs_done or worker is None:
            return False
        try:
            worker.drain()  # nothing runs on the codec's side while the model captures (idle: nothing to wait for)
            captured = (
                (batcher is not None and bool(worker.call(lambda: batcher.capture_next(main_only=True))))
                or (runner is not None and runner.capture_next())
                or (batcher is not None and bool(worker.call(batcher.capture_next)))
            )
        except Exception:  # a failed capture must not stop serving: the eager path remains
            log.exception("graph capture while idle failed; leaving the remaining shapes eager/lazy")
            self._graphs_done = True
            self.metrics.graphs_pending.set(0)
            self._retire_compile_workers()
            return False
        self.metrics.graphs_pending.set(self._graphs_pending())
        if captured:
            return True
        self._graphs_done = True
        self._report_memory("every CUDA graph captured")
        self._retire_compile_workers()  # and the kernels the captures met go to the manifest
        return False

    def _graphs_pending(self) -> int:
        runner, batcher = self._runner, self._batcher
        model = len(runner.pending_graphs()) + len(runner.pending_prefill_graphs()) if runner is not None else 0
        return model + (len(batcher.pending()) if batcher is not None else 0)

    def _report_memory(self, when: str) -> None:
        """Log (and show in /api/info) what the device really holds next to the plan."""
        if self._device.type != "cuda" or self.memory_plan is None:
            return
        reserved = torch.cuda.max_memory_reserved(self._device)
        details = {**self._info.details, "peak_reserved_gib": f"{reserved / GIB:.2f}"}
        self._info = dataclasses.replace(self._info, details=details)
        log.info("%s: peak memory reserved by this process %.2f GiB (plan: %.2f GiB in use before + %.2f GiB planned)",
                 when, reserved / GIB, self.memory_plan.in_use_bytes / GIB, self.memory_plan.planned_bytes / GIB)

    def _drain_inbox(self, sched: Scheduler) -> int:
        n = 0
        while True:
            try:
                sched.add(self._inbox.get_nowait())
                n += 1
            except queue.Empty:
                return n

    def _gather_burst(self, sched: Scheduler, landed: int) -> None:
        """An idle engine that just got ``landed`` takes moves in the rest of their burst (engine/arrivals: a lone
        take starts at once, a burst shares one batched prefill pass)."""
        gather_burst(self._submits, lambda: self._drain_inbox(sched), self._wake, landed=landed)

    def _run_jobs(self, *, streaming: bool) -> bool:
        """Renders and encodes: one piece per round while takes stream, everything when idle."""
        while True:
            try:
                self._jobs.append(self._jobs_in.get_nowait())
            except queue.Empty:
                break
        worked = False
        worker = self._codec_worker
        assert worker is not None, "serving implies loaded"
        while self._jobs:
            job = self._jobs[0]
            if not job.begin():
                self._jobs.popleft()
                continue
            if isinstance(job, RenderJob) and not job.started and self._scheduler is not None:
                # Its codec stream reserves a window: kept codec states of finished takes make room first.
                self._scheduler.make_codec_room()
            try:
                done = worker.call(job.advance)  # renders and encodes use the codec: on its worker
            except Exception as exc:
                done = True
                job.fail(exc)
                if isinstance(job, RenderJob):
                    job.close()
            worked = True
            if done:
                self._jobs.popleft()
            if streaming:
                break
        return worked

    def _count_codec_call(self, priority: bool, queued_s: float) -> None:
        lane = "priority" if priority else "bulk"
        self.metrics.codec_calls.labels(lane).inc()
        self.metrics.codec_queued.labels(lane).observe(queued_s)

    def _take_done(self, take: Take) -> None:
        with self._admit_lock:
            self._in_system -= 1

    def _stop_codec_worker(self) -> None:
        """Codec calls not started are dropped, the running one finishes, its thread ends."""
        if self._codec_worker is not None:
            self._codec_worker.close(discard=True)

    def _start_compile_workers(self, device: torch.device, *, after_plan: bool = False) -> None:
        """On CUDA, with kernels to compile ahead in processes (``compile_processes``), start the worker processes now:
        they import Triton and the kernels' modules while the model and codec load (compile_workers.py). Kernels any
        thread of this process compiles from now until the warm-up ends are compiled in them.

        Where an earlier start compiled its kernels into this Triton cache (its marker is there), the workers are
        likely not needed: whether they are is known once the memory plan is made (the marker names the plan), so
        they start then, ``after_plan``, if at all. Spawned for nothing they would import Triton and torch in as many
        processes while this one loads (on an H200 host, one start with 16 of them loaded ~2 s slower than one with
        8)."""
        s = self.settings
        threads = compile_threads(s.compile_threads, device)
        if device.type != "cuda" or threads <= 1 or not s.compile_processes:
            return
        self._workers_deferred = False
        if not after_plan and s.compile_threads == 0 and earlier_ahead_compiles():
            self._workers_deferred = True
            return
        unsupported = why_unsupported()
        if unsupported is not None:  # said once, before any process is spawned
            log.warning("start-up: kernels compile on threads, not in worker processes: %s", unsupported)
            return
        try:
            self._compile_workers = CompileWorkers(threads).start().install()
        except Exception:  # noqa: BLE001 - no processes here (a sandbox, a limit): the threads compile, as before
            log.warning("cannot start compile worker processes; kernels compile on threads", exc_info=True)
            self._compile_workers = None
            return
        log.info("start-up: %d worker processes compile the Triton kernels met before ready", threads)
        # Every kernel an earlier start met goes to them at once (kernel_manifest): they compile while the model and
        # codec load, not only from the memory plan on (the plan's chains then find them compiled or compiling).
        self._prefetch_kernels()

    def _end_compiles(self, keep_log: bool = False, keep_workers: bool = False) -> None:
        """The ahead compiles' threads end (after waiting for them; a start that failed; a harness never warmed up),
        and unless ``keep_log`` the Triton compile log stops counting. The compile workers end too (they compile what
        the warm-up's captures meet until then), unless ``keep_workers``: at ready, they stay for the idle-time
        captures (COMPILE_WORKERS_AFTER_READY_S), and what they compiled so far is written to the manifest now."""
        if self._compiles is not None:
            self._compiles.close()
            self._compiles = None
        self._join_kernel_preload()
        if keep_log:
            return
        if self._compile_log is not None:
            self._compile_log.remove()
            self._compile_log = None
        workers = self._compile_workers
        if workers is None:
            return
        if keep_workers and workers.active:
            self._account_workers(workers, "; they stay while the idle-time graph captures run")
            self._workers_retire_at = time.monotonic() + COMPILE_WORKERS_AFTER_READY_S
            return
        self._retire_compile_workers()

    def _retire_compile_workers(self) -> None:
        """The compile workers end; every kernel a pass of this process had them compile goes to the manifest."""
        workers, self._compile_workers = self._compile_workers, None
        self._workers_retire_at = None
        if workers is not None:
            self._account_workers(workers, "; they end")
            workers.close()

    def _account_workers(self, workers: CompileWorkers, then: str) -> None:
        """What the workers did so far: logged, counted, and their kernels written to the manifest."""
        log.info("compile workers: %s%s", workers.summary(), then)
        self.compile_workers_counts = workers.counts()
        self._record_kernels(workers.met())

    def _start_kernel_preload(self, device: torch.device) -> None:
        """Where an earlier start compiled its kernels into this Triton cache (its marker is there), load the kernels
        this machine's manifest names on a thread now, while the model and codec load (kernel_preload.py); joined
        before the first capture."""
        if device.type != "cuda" or not earlier_ahead_compiles():
            return
        try:
            import triton

            jobs = load_jobs([self.settings.data_dir / MANIFEST_NAME], str(triton.__version__), current_target())
        except Exception:  # noqa: BLE001 - no preload: the captures load the kernels, as before
            log.warning("kernel preload: the manifest cannot be read", exc_info=True)
            return
        if jobs:
            self._kernel_preload = KernelPreload(jobs, device).start()

    def _join_kernel_preload(self) -> PreloadCounts | None:
        """Wait for the kernel preload, if one runs (seconds at most); its counts, logged once."""
        preload, self._kernel_preload = self._kernel_preload, None
        if preload is None:
            return None
        counts = self.kernel_preload_counts = preload.wait()
        log.info("start-up: %d Triton kernels preloaded from the cache in %.2f s on a thread beside the load "
                 "(%d failed: they load when met)", counts.loaded, counts.seconds, counts.failed)
        return counts

    def _prefetch_kernels(self) -> None:
        """With compile workers at work, hand them every kernel the manifests name for this Triton and GPU: the chains'
        passes then find them compiled or compiling instead of meeting them one after another (kernel_manifest)."""
        workers = self._compile_workers
        if workers is None or not workers.active:
            return
        import triton

        jobs = load_jobs(manifest_paths(self.settings.data_dir), str(triton.__version__), current_target())
        if jobs:
            handed = workers.prefetch(jobs)
            log.info("start-up: %d Triton kernels from the kernel manifests handed to the compile workers", handed)

    def _record_kernels(self, jobs: list[KernelJob]) -> None:
        """The kernels this start compiled in its workers, added to the data dir's manifest for the next start."""
        if not jobs:
            return
        try:
            import triton

            path = self.settings.data_dir / MANIFEST_NAME
            held = save_jobs(path, jobs, str(triton.__version__))
            log.info("kernel manifest: %d Triton kernels met written to %s (%d in all)", len(jobs), path, held)
        except Exception:  # noqa: BLE001 - only the next start's head start is lost
            log.warning("cannot write the kernel manifest", exc_info=True)

    def _shutdown(self) -> None:
        self._end_compiles()
        self._stop_codec_worker()  # first: the takes' codec states are closed below
        if self._scheduler is not None:
            self._drain_inbox(self._scheduler)  # takes admitted at the last moment end too
            self._scheduler.shutdown()
        for job in list(self._jobs):
            job.fail(RuntimeError("the engine is shutting down"))
        self._jobs.clear()
        while True:
            try:
                self._jobs_in.get_nowait().fail(RuntimeError("the engine is shutting down"))
            except queue.Empty:
                break

    # ------------------------------------------------------------------ loading
    def _load(self) -> None:
        from moss_rt.codec import CodecLoadError, load_codec
        from moss_rt.codec.kv_quant import FP8
        from moss_rt.codec.streaming import StreamingDecoder
        from moss_rt.model.loader import ModelUnavailable, open_model, random_weights_label
        from moss_rt.model.runner import ModelRunner

        s = self.settings
        where = placement(s)
        t0 = time.perf_counter()
        timeline = self.startup
        if where.device.type == "cuda":
            # What is left of bringing the device up (the context warm_cuda started beside the imports, the first
            # kernel's module), timed on its own: the phase that first touched the device used to carry it, and the
            # H200's "codec loaded" took 4.4 s in session 14 (1.4 s in session 13) without anyone knowing why.
            with timeline.phase("CUDA context"):
                torch.zeros(1, device=where.device)
                torch.cuda.synchronize(where.device)
        if where.device.type == "cuda" and s.gpu_memory_limit_gib > 0:
            index = where.device.index if where.device.index is not None else torch.cuda.current_device()
            total = torch.cuda.get_device_properties(index).total_memory
            fraction = min(1.0, s.gpu_memory_limit_gib * GIB / total)
            torch.cuda.set_per_process_memory_fraction(fraction, index)
            log.info("GPU memory limited to %.1f GiB (%.3f of the device) for this process",
                     s.gpu_memory_limit_gib, fraction)
        # Before the workers: with the default --compile-threads a start that preloads defers them (an earlier start's
        # marker), so its loads go to no worker; workers started anyway (a set thread count, another plan) take the
        # loads still running through their hook, which costs a worker's load and nothing else.
        self._start_kernel_preload(where.device)
        self._start_compile_workers(where.device)
        model_choice = choose_model(s, where.device)
        # The start's order (issue 24): the model is opened (its memory taken, its weights not read yet), the codec
        # loaded while the model's weights are read, the memory plan made, and the kernels start compiling
        # (warm_compile) while the codec's and the model's graphs are set up.
        with timeline.phase("model opened (source, config, tokenizer, memory)"):
            try:
                opened = open_model(model_choice.source, device=where.device, dtype=where.dtype)
            except ModelUnavailable as exc:
                # Only weights that cannot be obtained (offline, download failed) fall back; a checkpoint
                # that is there but does not load (out of memory, config or tensor mismatch, no tokenizer)
                # is an error naming the problem: a silent demo would hide it.
                if s.model.strip() != "auto" or model_choice.demo:
                    raise
                log.warning("--model auto: cannot obtain %s (%s); falling back to the tiny demo model",
                            model_choice.source, exc)
                model_choice = Choice(str(tiny_model_dir(s)), True, "tiny", tiny=True)
                opened = open_model(model_choice.source, device=where.device, dtype=where.dtype)
        params = opened.parameters
        if opened.source.demo and not model_choice.demo:  # a random-weight checkpoint given by path
            model_choice = dataclasses.replace(model_choice, demo=True)
        codec_choice = choose_codec(s, model_choice)
        if where.device.type == "cpu" and params < SMALL_MODEL_PARAMS:
            # A small model's ops are microseconds long: intra-op threads only add contention
            # (measured 10 ms/frame on one thread vs 250 ms on two of a busy 2-core machine).
            torch.set_num_threads(1)
        # The weights are read on a thread of their own while the codec loads: both wait mostly on the disk and the
        # copies (the GIL is let go), and one after the other they took 0.6 + 1.1 s of an H200's second start (session
        # 15). Joined before the memory plan, which measures what the device has free: nothing of the read (its
        # staging tensors, its host buffers) may be in flight then. A codec that fails to load still waits for the
        # read, so nothing of the start outlives it.
        reading = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moss-rt-weights")
        weights = reading.submit(opened.read_weights)
        try:
            voice_cloning = True
            with timeline.phase("codec loaded"):
                try:
                    codec = load_codec(codec_choice.source, device=where.device, compute_dtype=where.dtype)
                except CodecLoadError as exc:
                    # A decode-only codec checkpoint (no encoder weights) still serves speech; uploads cannot be
                    # encoded.
                    log.warning("codec %s cannot be loaded with its encoder (%s); loading it decode-only: "
                                "reference voices cannot be encoded", codec_choice.source, exc)
                    codec = load_codec(
                        codec_choice.source, device=where.device, compute_dtype=where.dtype, decode_only=True
                    )
                    voice_cloning = False
            with timeline.phase("model weights read"):  # what is left of the read once the codec is in
                loaded = weights.result()
        finally:
            reading.shutdown(wait=True)
        with timeline.phase("memory plan"):
            plan = self._plan_memory(opened.config, codec, where.device, where.dtype)
        slots, seq_len = plan.max_slots, plan.max_seq_len
        graphs = where.device.type == "cuda" and "cuda_graphs" in inspect.signature(StreamingDecoder).parameters
        extra: dict[str, Any] = {"cuda_graphs": True} if graphs else {}
        decoder = StreamingDecoder(
            codec,
            device=where.device,
            dtype=where.dtype,
            max_streams=slots + CODEC_EXTRA_STREAMS,  # every slot, a render and the warm-up
            max_chunk_frames=CODEC_CHUNK_FRAMES,
            state_dtype=FP8 if plan.codec_state_dtype == "fp8" else None,  # the plan's choice (memory_plan.py)
            **extra,
        )
        # Captures under load are deferred to the scheduler's rounds (see codec_batch), whether or not the
        # codec overlaps: the same calls then get graphs at the same points either way.
        batcher = CodecBatcher(decoder, slots, defer_captures=True)
        worker = CodecWorker(
            threaded=s.codec_overlap,
            device=where.device,
            stream_priorities=s.stream_priorities,
            max_pending=CODEC_MAX_PENDING,
            bulk_patience_s=max(0.0, s.codec_bulk_patience_ms) / 1000.0,
            bulk_longest_wait_s=max(0.0, s.codec_bulk_longest_wait_ms) / 1000.0,
            on_done=self._wake.set,  # a take waiting for its last chunk ends on the next round
            on_wait=self.metrics.codec_wait.observe,
            on_call=self._count_codec_call,
        )
        worker.start()
        self._codec_worker = worker
        self.metrics.codec_overlap.set(1 if worker.threaded else 0)
        if where.device.type == "cuda":
            self._compile_log = TritonCompileLog().install()  # what the start spends compiling, for its log
        threads = compile_threads(s.compile_threads, where.device)
        marker = ahead_marker({
            "device": torch.cuda.get_device_name(where.device) if where.device.type == "cuda" else "cpu",
            "dtype": str(where.dtype), "model": repr(opened.config), "codec": repr(codec.config),
            "slots": slots, "seq_len": seq_len,
        }) if threads > 1 else None  # fmt: skip
        if marker is not None and marker.exists() and s.compile_threads == 0:
            log.info("start-up: an earlier start compiled every kernel into this Triton cache (%s): none ahead, the "
                     "captures load them", marker.name)
            threads, marker = 1, None
        if threads <= 1 and self._compile_workers is not None:  # nothing compiles ahead: the workers are not needed
            self._compile_workers.close()
            self._compile_workers = None
        if threads > 1 and self._workers_deferred:  # an earlier start's cache, but not for this plan: start them now
            self._start_compile_workers(where.device, after_plan=True)
        self._ahead_marker = marker  # written once this start's warm-up is done
        self._compiles = AheadCompiles(where.device, threads)
        self._compiles.add(codec_chains(batcher))  # nothing decodes before ready: the scratch row is theirs
        with timeline.phase("model runner (slot state, KV pool)"):
            runner = ModelRunner(
                loaded.model,
                loaded.tokenizer,
                loaded.config,
                max_slots=slots,
                max_seq_len=seq_len,
                device=where.device,
                dtype=where.dtype,
                prefill_max_rows=s.prefill_max_rows,
                prefill_graph_rows=max(0, s.prefill_graph_rows),
                num_blocks=plan.kv_blocks,
                block_size=plan.block_size,
            )
        self._codec, self._decoder, self._batcher = codec, decoder, batcher
        self._runner = runner
        self._device = where.device
        self._scheduler = Scheduler(
            runner,
            batcher,
            self.metrics,
            SchedulerConfig(
                max_slots=slots,
                prefill_chunk=s.prefill_chunk,
                retain_slots=slots,
                prefill_max_rows=s.prefill_max_rows,
                prompt_cache=s.prompt_cache,
                batch_share=min(1.0, max(0.0, s.batch_share)),
                batch_yield_share=min(1.0, max(0.0, s.batch_yield_share)),
                codec_call_streams=max(1, s.codec_call_streams),
                codec_batch_patience_s=max(0.0, s.codec_batch_patience_ms) / 1000.0,
                batch_pass_share=min(1.0, max(0.0, s.batch_pass_share)),
                prefill_round_passes=max(1, s.prefill_round_passes),
            ),
            on_take_done=self._take_done,
            sync=self._sync,
            worker=worker,
            arrivals=lambda: not self._inbox.empty(),
            trace=RoundTrace(s.round_trace, gc_seconds=lambda: self._gc_pauses.total_s) if s.round_trace else None,
        )
        self._scheduler.prompts.journal = self.kept_prompts
        demo = model_choice.demo or codec_choice.demo
        self._status = EngineStatus.WARMING_UP
        details = {
            "model": model_choice.label,
            "model_source": model_choice.source,
            "codec": codec_choice.label,
            "codec_source": codec_choice.source,
            "dtype": str(where.dtype).replace("torch.", ""),
            "max_slots": str(slots),
            "max_seq_len": str(seq_len),
            "codec_state_dtype": f"{plan.codec_state_dtype} ({plan.codec_state_reason})",
            "cuda_graphs": str(bool(runner.use_cuda_graphs)).lower(),
            "codec_cuda_graphs": str(batcher.graphs).lower(),
            "codec_overlap": "on" if worker.threaded else "off",
            "voice_cloning": "on" if voice_cloning else "off (codec loaded without its encoder)",
            "load_sec": f"{time.perf_counter() - t0:.1f}",
        }
        if demo:
            banner = demo_banner(random_weights_label(params) if model_choice.demo else "random codec")
            details["banner"] = banner
            details["weights"] = random_weights_label(params) if model_choice.demo else "random codec weights"
            for _ in range(3):  # loud on purpose: nobody should mistake this for the real model
                log.warning("*** %s ***", banner)
        self._info = EngineInfo(
            name="moss",
            models=(DEFAULT_MODEL_ALIAS,),
            default_model=DEFAULT_MODEL_ALIAS,
            demo=demo,
            device=str(where.device),
            details=details,
            # A code is an index into both the model's audio vocabulary and the codec's codebooks.
            codebook_size=min(loaded.config.audio_vocab_size, codec.config.quantizer.codebook_size),
        )
        log.info("engine loaded in %.1f s: model %s, codec %s on %s/%s",
                 time.perf_counter() - t0, model_choice.source, codec_choice.source, where.device, where.dtype)

    def _plan_memory(
        self, config: MossTTSConfig, codec: CodecModel, device: torch.device, dtype: torch.dtype
    ) -> MemoryPlan:
        """The memory plan from what the device has free now that the weights are loaded (see memory_plan)."""
        from moss_rt.engine.memory_costs import memory_costs
        from moss_rt.model.runner import DEFAULT_BLOCK_SIZE

        s = self.settings
        # Before measuring: an aligner that loads in between is counted twice (in use and reserved), never missed.
        aligner = self._aligner_reserve(device)
        costs = memory_costs(
            config,
            codec,
            dtype,
            prefill_max_rows=s.prefill_max_rows,
            codec_chunk_frames=CODEC_CHUNK_FRAMES,
            codec_extra_streams=CODEC_EXTRA_STREAMS,
            aligner_bytes=aligner,
        )
        total = free = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            # Memory this process freed (an earlier engine closed in the same process, load-time temporaries)
            # is still cached by the allocator and counts as used by the driver: hand it back first, and
            # count whatever the allocator still caches without a live tensor as free.
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            if s.gpu_memory_limit_gib > 0:
                # A smaller card, emulated: this process's allocator may hold only the limit, so the plan
                # budgets the limit minus what this process already holds (weights and their rounding).
                total = min(total, int(s.gpu_memory_limit_gib * GIB))
                free = total - torch.cuda.memory_reserved(device)
        plan = plan_memory(
            costs,
            device=str(device),
            total_bytes=total,
            free_bytes=free,
            utilization=s.gpu_memory_utilization,
            max_slots=s.max_slots,
            max_seq_len=s.max_seq_len,
            block_size=DEFAULT_BLOCK_SIZE,
            codec_state_dtype=s.codec_state_dtype,
        )
        log.info("%s", plan.table())
        self.memory_plan = plan
        self.metrics.set_plan(plan)
        # Admission counts against the plan: slots plus the wait queue, never more.
        with self._admit_lock:
            self._capacity = plan.max_slots + s.max_queue
            self._barge_in_room = plan.max_slots
        self._inbox = queue.Queue(maxsize=self._capacity + self._barge_in_room)
        return plan

    def _aligner_reserve(self, device: torch.device) -> int:
        """Bytes the plan reserves for the word aligner on this GPU (0: none runs here), docs/words.md."""
        if device.type != "cuda":
            return 0
        from moss_rt.align.select import planned_reserve_bytes

        s = self.settings
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            return planned_reserve_bytes(
                s.aligner, device=s.device, engine_index=index, graph_memory_bytes=s.aligner_graph_mb * 2**20
            )
        except Exception:  # an unreadable aligner checkpoint fails the aligner's own load, not the engine's plan
            log.exception("cannot size the word aligner's memory; reserving its graph budget and an MMS-300m's weights")
            from moss_rt.align.memory import MMS_300M_PARAMS, reserve_bytes, weights_bytes

            return reserve_bytes(weights_bytes(MMS_300M_PARAMS), 0, s.aligner_graph_mb * 2**20)

    def _sync(self) -> None:
        """Wait for this thread's queued device work (host timings mean something); the codec's stream is not
        waited for, so a prefill never stalls on a decode running next to it."""
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

    def _size_stream_passes(self) -> None:
        """How many padded rows a prefill pass may hold while takes stream (prefill_pace): the setting, or on a GPU
        what fits ``prefill_budget_ms`` by timed passes of 4 and 16 fresh 512-row chunks; on the CPU passes run slot by
        slot anyway (a take's chunk bounds the stall), so prefill_max_rows."""
        s, runner, scheduler = self.settings, self._runner, self._scheduler
        assert runner is not None and scheduler is not None
        rows = s.prefill_stream_rows or s.prefill_max_rows
        chunk = min(s.prefill_chunk, 512, runner.max_seq_len - 1)
        # Passes of 4 and 16 chunks: past the sizes where a pass costs about the same whatever its rows; only as
        # many as the KV pool holds at once (a small card's pool may not hold 16 prompts).
        fits = runner.blocks.available // max(1, runner.blocks_needed(chunk))
        large = min(16, runner.max_slots, s.prefill_max_rows // max(1, chunk), fits)
        if not s.prefill_stream_rows and self._device.type == "cuda" and large >= 2:  # else: the setting or max
            small, gpu = max(1, large // 4), torch.cuda.get_device_name(self._device)
            # What the passes' cost depends on; an earlier start with the same setup measured it (prefill_cost_record).
            record, key = s.data_dir / COST_FILE, cost_setup_key({
                "device": gpu, "torch": torch.__version__,
                "moss_rt": moss_rt_version, "model": repr(runner.config), "dtype": str(runner.dtype),
                "slots": runner.max_slots, "seq_len": runner.max_seq_len, "chunk": chunk, "passes": (small, large),
                "graph_rows": s.prefill_graph_rows, "max_rows": s.prefill_max_rows,
            })  # fmt: skip
            cost = recorded_cost(record, key)
            measured = cost is None
            if cost is None:
                cost = self._time_prefill_passes(chunk, small, large)
                if cost is not None:
                    record_cost(record, key, cost, f"{gpu}, {chunk}-row chunks")
            if cost is not None:
                rows = cost.rows_within(s.prefill_budget_ms / 1000.0, s.prefill_max_rows)
                log.info(
                    "prefill passes while takes stream: at most %d padded rows (a pass: %.1f ms + %.1f us a row, %s; "
                    "budget %.0f ms)", rows, cost.fixed_s * 1e3, cost.per_row_s * 1e6,
                    "timed now" if measured else "as an earlier start timed them", s.prefill_budget_ms,
                )
            self.prefill_cost_measured = measured
        scheduler.stream_rows = min(rows, s.prefill_max_rows)
        self.metrics.prefill_stream_rows.set(scheduler.stream_rows)

    def _time_prefill_passes(self, chunk: int, small: int, large: int) -> PrefillCost | None:
        """Time batched prefill passes of ``small`` and ``large`` fresh ``chunk``-row chunks (prefill_pace); None where
        that failed (sizing must never keep the service from starting: passes while takes stream stay unbounded)."""
        from moss_rt.model.runner import PrefillRequest

        runner = self._runner
        assert runner is not None
        prompt = runner.build_prompt(text="Warm-up.", instruction="")
        rows_in = np.resize(prompt, (chunk, prompt.shape[1]))  # the prompt's rows repeated: valid rows
        slots = [runner.alloc_slot() for _ in range(large)]

        def one_pass(n: int) -> None:
            runner.prefill_batch([PrefillRequest(slot, rows_in) for slot in slots[:n]])
            self._sync()

        try:
            return measure_prefill_cost(one_pass, small, large, chunk)
        except Exception:
            log.exception("could not time prefill passes; passes while takes stream stay unbounded")
            return None
        finally:
            for slot in slots:
                runner.free_slot(slot)

    def _warm_up(self) -> None:
        """Capture step graphs and run one short take through model and codec before ``ready``."""
        t0 = time.perf_counter()
        timeline = self.startup
        runner, batcher, worker = self._runner, self._batcher, self._codec_worker
        assert runner is not None and batcher is not None and worker is not None
        # Before ready: the step graph a first take needs, the prefill graphs of a lone line (from position 0 and
        # after a cached opening, prefill_graphs.common_shapes), and the codec's first-chunk and full-chunk graphs of
        # every batch bucket. Those codec captures are the slow ones (each shape compiles Triton kernels of its
        # own: 1-4 s each on a machine whose Triton cache is cold, 0.3 s warm), and a take arriving while one
        # ran at idle time waited for it (first audio 0.7-2.2 s in the first rounds after ready). The other
        # graphs are captured while the engine is idle, likeliest first (_capture_idle); a step shape met
        # before its turn is captured on first use (0.1-0.3 s), a codec shape runs eagerly until then.
        # Their kernels compile first, several at once (warm_compile: the codec's have been compiling since the
        # memory plan); every compile thread has ended before the first capture.
        compiles = self._compiles
        if compiles is not None and compiles.enabled:
            compiles.add(model_chains(runner))
            with timeline.phase("compile: waited for the ahead compiles"):
                chains = compiles.wait()
            for name, seconds in chains.items():
                timeline.record(f"compile: {name}", seconds)
            if compiles.started is not None:
                timeline.record("compile: all, from the plan on", time.perf_counter() - compiles.started)
        if self._kernel_preload is not None:
            with timeline.phase("compile: waited for the kernel preload"):
                counts = self._join_kernel_preload()
            if counts is not None:
                timeline.record("compile: kernels preloaded from the cache (beside the load)", counts.seconds)
        self._end_compiles(keep_log=True)
        ahead = self._compile_log.mark() if self._compile_log is not None else 0
        with timeline.phase("model graphs captured (prefill, step)"):
            runner.warmup(batch_sizes=[1], key_lengths=lone_take_keys(runner.key_buckets()))
        with timeline.phase("warm-up take (prefill, 3 steps)"):
            slot = runner.alloc_slot()
            try:
                runner.prefill(slot, runner.build_prompt(text="Warm-up.", instruction=""))
                runner.set_sampling(slot, SamplingParams(), 0)
                for _ in range(3):
                    runner.step([slot])
            finally:
                runner.free_slot(slot)
            self._sync()
        with timeline.phase("codec graphs captured"):
            # The codec only ever runs on its worker. Buckets past READY_MAX_BUCKET come first in the idle captures.
            worker.call(lambda: batcher.warm_up(main_only=True, max_bucket=READY_MAX_BUCKET))

        def first_chunks() -> None:
            # The calls a take's first chunks make, to the int16 PCM the scheduler sends (codec/pcm): mono alone,
            # then mono and stereo in one call (rows picked out of the batch). Their CUDA kernels load on first
            # launch: on a freshly started H200 the first take after ready paid for them in its first chunk's decode
            # (47 ms, the next takes' 8 ms), and its steps beside it.
            decoder = batcher.decoder
            states = [decoder.new_state()]
            try:
                if decoder.can_open():  # a one-stream decoder: mono and stereo one after the other instead
                    states.append(decoder.new_state())
                codes = np.zeros((1 + 8, N_CODEBOOKS), dtype=np.int64)
                batcher.decode_pcm(states[:1], [codes[:1]], [1])
                channels = [1, 2] if len(states) == 2 else [2]
                batcher.decode_pcm(states, [codes[1:]] * len(states), channels)
                with batcher.eager():
                    batcher.decoder.decode(states[:1], [codes[1:]])
            finally:
                for state in states:
                    state.close()

        with timeline.phase("codec first chunks"):
            worker.call(first_chunks)
        with timeline.phase("prefill passes sized"):
            self._size_stream_passes()
        log.info("engine warm-up done in %.1f s", time.perf_counter() - t0)
        if self._compile_log is not None:
            log.info("start-up: %s", self._compile_log.summary(ahead))
            self.kernels_met_in_warm_up = [name for name, _ in self._compile_log.compiles[ahead:]]
        self._end_compiles(keep_workers=True)  # the idle-time captures still meet kernels (_capture_idle)
        if self._ahead_marker is not None:
            try:
                self._ahead_marker.touch()
            except OSError as exc:  # a read-only cache: the next start compiles ahead again, nothing worse
                log.warning("could not mark the Triton cache as complete (%s)", exc)
        self._report_memory("after warm-up")
