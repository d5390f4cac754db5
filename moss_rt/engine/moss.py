"""The real engine: MOSS-TTS-Local v1.5 + MOSS-Audio-Tokenizer-v2 behind the engine seam.

One worker thread owns the device: it loads the model and codec, warms them up, and then runs the
:class:`~moss_rt.engine.scheduler.Scheduler` round after round. The event loop only enqueues (takes
into a bounded inbox, renders and reference encodes into a bounded job queue) and awaits events
through each take's :class:`~moss_rt.engine.channel.TakeChannel`; it never touches a tensor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import logging
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import torch

from moss_rt.config import Settings
from moss_rt.engine.base import EngineBusy, EngineInfo, EngineLifecycle, TakeSpec
from moss_rt.engine.codec_batch import CodecBatcher
from moss_rt.engine.jobs import EncodeJob, Job, RenderJob
from moss_rt.engine.metrics import EngineMetrics
from moss_rt.engine.prompts import PromptTooLong, frames_room, prompt_rows
from moss_rt.engine.resolve import DEMO_BANNER, Choice, choose_codec, choose_model, placement, tiny_model_dir
from moss_rt.engine.scheduler import Scheduler, SchedulerConfig
from moss_rt.engine.slots import EngineChannel, Take
from moss_rt.generation import FRAME_RATE, N_CODEBOOKS, SamplingParams
from moss_rt.protocol import DEFAULT_MODEL_ALIAS, ErrorCode, ProtocolError

if TYPE_CHECKING:
    from moss_rt.model.runner import ModelRunner

log = logging.getLogger(__name__)

BURST_WINDOW_S = 0.003  # an idle engine collects takes arriving within this of each other...
BURST_MAX_S = 0.05  # ...for at most this long
IDLE_WAIT_S = 0.1  # nothing to do: sleep until woken (submit, cancel, job) or this long
PAUSED_POLL_S = 0.005  # only paused slots: poll their channels this often
SMALL_MODEL_PARAMS = 50_000_000  # below this, CPU inference runs single-threaded
CODEC_CHUNK_FRAMES = 25  # largest chunk the streaming decoder runs in one forward (longer ones are split)


class MossEngine(EngineLifecycle):
    """The production engine (see module docstring). Construct, then ``await start()``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        spec = settings.model.strip()
        likely_demo = spec == "tiny" or (spec == "auto" and not torch.cuda.is_available())
        self._info = EngineInfo(
            name="moss",
            models=(DEFAULT_MODEL_ALIAS,),
            default_model=DEFAULT_MODEL_ALIAS,
            demo=likely_demo,
            device=settings.device,
            details={"status": "loading", "model": spec, "codec": settings.codec.strip()},
        )
        self.metrics = EngineMetrics()
        lead_sec = settings.max_lead_sec if settings.max_lead_sec > 0 else 20.0
        self._lead_frames = max(1, int(lead_sec * FRAME_RATE))
        self._capacity = settings.max_slots + settings.max_queue
        # Admission is counted here, so the inbox can never be full when put_nowait runs.
        self._inbox: queue.Queue[Take] = queue.Queue(maxsize=self._capacity)
        self._jobs_in: queue.Queue[Job] = queue.Queue(maxsize=max(4, settings.max_queue))
        self._jobs: deque[Job] = deque()
        self._admit_lock = threading.Lock()
        self._in_system = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._loaded: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = False
        self._scheduler: Scheduler | None = None
        self._codec: object | None = None
        self._decoder: object | None = None
        self._batcher: CodecBatcher | None = None
        self._runner: ModelRunner | None = None
        self._device = torch.device("cpu")

    # ------------------------------------------------------------------ the seam
    @property
    def info(self) -> EngineInfo:
        return dataclasses.replace(self._info, ready=self._ready, metrics=self.metrics.registry)

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def active_count(self) -> int:
        """Takes holding a slot (read by tests and /api/info; written by the worker)."""
        s = self._scheduler
        return 0 if s is None else s.active_count

    @property
    def queued_count(self) -> int:
        s = self._scheduler
        return 0 if s is None else len(s.waiting) + self._inbox.qsize()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="moss-rt-engine", daemon=True)
        self._thread.start()
        await asyncio.wrap_future(self._loaded)

    async def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 30.0)
        self._ready = False

    async def submit(self, spec: TakeSpec) -> EngineChannel:
        if self._loop is None or not self._ready or self._stop.is_set():
            raise EngineBusy(retry_after_sec=5.0)  # loading (or shutting down): come back later
        prompt = await self._checked_prompt(spec)
        if not self._ready or self._stop.is_set():
            # close() ran during the check: the stopped worker would never read the inbox again.
            raise EngineBusy(retry_after_sec=5.0)
        with self._admit_lock:
            if self._in_system >= self._capacity:
                self.metrics.busy.inc()
                raise EngineBusy(retry_after_sec=1.0)
            self._in_system += 1
        channel = EngineChannel(self._loop, spec.take_id, self._lead_frames, wake=self._wake)
        self._inbox.put_nowait(Take(spec, channel, prompt=prompt))
        self._wake.set()
        return channel

    async def _checked_prompt(self, spec: TakeSpec) -> np.ndarray:
        """The take's prompt rows, tokenized on a helper thread (the worker reuses them); a prompt the
        KV cache can never hold is refused as bad input before it takes a queue place."""
        runner = self._runner
        assert runner is not None, "ready implies loaded"
        rows = await asyncio.to_thread(prompt_rows, runner, spec)
        max_seq = int(runner.max_seq_len)
        try:
            frames_room(len(rows), spec.start_frame, max_seq)
        except PromptTooLong as exc:
            # The prompt alone too long: the text (or instruction, reference) is at fault;
            # otherwise the retake point is too late for the cache.
            blame = "text" if len(rows) >= max_seq else "frame"
            raise ProtocolError(ErrorCode.INVALID_FIELD, str(exc), field=blame) from None
        return rows

    async def render(self, codes: np.ndarray, channels: int) -> bytes:
        codes = np.asarray(codes, dtype=np.int64).reshape(-1, N_CODEBOOKS)
        if codes.shape[0] == 0:
            return b""
        job = RenderJob(codes, channels, self._require_batcher())
        return await self._run_job(job)  # type: ignore[return-value]

    async def encode_reference(self, audio: bytes) -> np.ndarray:
        if self._codec is None:
            raise EngineBusy(retry_after_sec=5.0)
        job = EncodeJob(audio, self._codec, self.settings.limits.max_upload_seconds)  # type: ignore[arg-type]
        return await self._run_job(job)  # type: ignore[return-value]

    def _require_batcher(self) -> CodecBatcher:
        if self._batcher is None:
            raise EngineBusy(retry_after_sec=5.0)
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
        try:
            self._load()
            self._warm_up()
        except BaseException as exc:
            log.exception("engine failed to load")
            self._set_status("failed")
            if not self._loaded.done():
                self._loaded.set_exception(exc)
            return
        self._ready = True
        self._set_status("ready")
        if not self._loaded.done():
            self._loaded.set_result(None)
        try:
            self._serve()
        finally:
            self._ready = False
            self._shutdown()

    def _set_status(self, status: str) -> None:
        self._info = dataclasses.replace(self._info, details={**self._info.details, "status": status})

    def _serve(self) -> None:
        sched = self._scheduler
        assert sched is not None
        while not self._stop.is_set():
            self._wake.clear()
            was_idle = sched.idle
            if self._drain_inbox(sched) and was_idle:
                self._gather_burst(sched)
            try:
                worked = sched.iterate()
            except Exception:  # a scheduler bug must not leave every client hanging on a dead thread
                log.exception("scheduling round failed; ending every take with an error")
                sched.fail_all("internal engine error")
                worked = True
            worked |= self._run_jobs(streaming=bool(sched.running))
            if not worked:
                self.metrics.idle()
                self._wake.wait(PAUSED_POLL_S if sched.has_paused or sched.preparing else IDLE_WAIT_S)

    def _drain_inbox(self, sched: Scheduler) -> int:
        n = 0
        while True:
            try:
                sched.add(self._inbox.get_nowait())
                n += 1
            except queue.Empty:
                return n

    def _gather_burst(self, sched: Scheduler) -> None:
        """An idle engine that just got a take waits a moment for the rest of a burst.

        Takes that arrive together share one batched prefill pass and then step together (one
        batch, one codec call per chunk); a take arriving a round later would need a pass of its
        own, under the streaming budget. The wait ends as soon as a short window brings nothing
        new, so a lone take pays one window.
        """
        deadline = time.monotonic() + BURST_MAX_S
        while time.monotonic() < deadline:
            time.sleep(BURST_WINDOW_S)
            if self._drain_inbox(sched) == 0:
                return

    def _run_jobs(self, *, streaming: bool) -> bool:
        """Renders and encodes: one piece per round while takes stream, everything when idle."""
        while True:
            try:
                self._jobs.append(self._jobs_in.get_nowait())
            except queue.Empty:
                break
        worked = False
        while self._jobs:
            job = self._jobs[0]
            if not job.begin():
                self._jobs.popleft()
                continue
            try:
                done = job.advance()
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

    def _take_done(self, take: Take) -> None:
        with self._admit_lock:
            self._in_system -= 1

    def _shutdown(self) -> None:
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
        from moss_rt.codec.streaming import StreamingDecoder
        from moss_rt.model.loader import load_model
        from moss_rt.model.runner import ModelRunner

        s = self.settings
        where = placement(s)
        t0 = time.perf_counter()
        model_choice = choose_model(s, where.device)
        try:
            loaded = load_model(model_choice.source, device=where.device, dtype=where.dtype)
        except Exception as exc:
            if s.model.strip() != "auto" or model_choice.demo:
                raise
            log.warning("--model auto: cannot load %s (%s); falling back to the tiny demo model",
                        model_choice.source, exc)
            model_choice = Choice(str(tiny_model_dir(s)), True, "tiny")
            loaded = load_model(model_choice.source, device=where.device, dtype=where.dtype)
        codec_choice = choose_codec(s, model_choice)
        params = sum(p.numel() for p in loaded.model.parameters())
        if where.device.type == "cpu" and params < SMALL_MODEL_PARAMS:
            # A small model's ops are microseconds long: intra-op threads only add contention
            # (measured 10 ms/frame on one thread vs 250 ms on two of a busy 2-core machine).
            torch.set_num_threads(1)
        voice_cloning = True
        try:
            codec = load_codec(codec_choice.source, device=where.device, compute_dtype=where.dtype)
        except CodecLoadError as exc:
            # A decode-only codec checkpoint (no encoder weights) still serves speech; uploads cannot be encoded.
            log.warning("codec %s cannot be loaded with its encoder (%s); loading it decode-only: "
                        "reference voices cannot be encoded", codec_choice.source, exc)
            codec = load_codec(codec_choice.source, device=where.device, compute_dtype=where.dtype, decode_only=True)
            voice_cloning = False
        graphs = where.device.type == "cuda" and "cuda_graphs" in inspect.signature(StreamingDecoder).parameters
        decoder = StreamingDecoder(
            codec,
            device=where.device,
            dtype=where.dtype,
            # every slot, renders, and the padding streams of graphed calls
            max_streams=s.max_slots + 2 + CodecBatcher.pad_streams(s.max_slots),
            max_chunk_frames=CODEC_CHUNK_FRAMES,
            **({"cuda_graphs": True} if graphs else {}),
        )
        # Created before any other decoder state: its padding streams must take the lowest slots.
        batcher = CodecBatcher(decoder, s.max_slots)
        runner = ModelRunner(
            loaded.model,
            loaded.tokenizer,
            loaded.config,
            max_slots=s.max_slots,
            max_seq_len=s.max_seq_len,
            device=where.device,
            dtype=where.dtype,
            prefill_max_rows=s.prefill_max_rows,
        )
        self._codec, self._decoder, self._batcher = codec, decoder, batcher
        self._runner = runner
        self._device = where.device
        self._scheduler = Scheduler(
            runner,
            batcher,
            self.metrics,
            SchedulerConfig(
                max_slots=s.max_slots,
                prefill_chunk=s.prefill_chunk,
                prep_budget_s=s.prefill_budget_ms / 1000.0,
                retain_slots=s.max_slots,
                prefill_max_rows=s.prefill_max_rows,
            ),
            on_take_done=self._take_done,
            sync=self._sync,
        )
        demo = model_choice.demo or codec_choice.demo
        details = {
            "status": "warming up",
            "model": model_choice.label,
            "model_source": model_choice.source,
            "codec": codec_choice.label,
            "codec_source": codec_choice.source,
            "dtype": str(where.dtype).replace("torch.", ""),
            "max_slots": str(s.max_slots),
            "max_seq_len": str(s.max_seq_len),
            "cuda_graphs": str(bool(runner.use_cuda_graphs)).lower(),
            "codec_cuda_graphs": str(batcher.graphs).lower(),
            "voice_cloning": "on" if voice_cloning else "off (codec loaded without its encoder)",
            "load_sec": f"{time.perf_counter() - t0:.1f}",
        }
        if demo:
            details["banner"] = DEMO_BANNER
            for _ in range(3):  # loud on purpose: nobody should mistake this for the real model
                log.warning("*** %s ***", DEMO_BANNER)
        self._info = EngineInfo(
            name="moss",
            models=(DEFAULT_MODEL_ALIAS,),
            default_model=DEFAULT_MODEL_ALIAS,
            demo=demo,
            device=str(where.device),
            details=details,
        )
        log.info("engine loaded in %.1f s: model %s, codec %s on %s/%s",
                 time.perf_counter() - t0, model_choice.source, codec_choice.source, where.device, where.dtype)

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _warm_up(self) -> None:
        """Capture step graphs and run one short take through model and codec before ``ready``."""
        t0 = time.perf_counter()
        runner = self._runner
        assert runner is not None
        runner.warmup()
        slot = runner.alloc_slot()
        try:
            runner.prefill(slot, runner.build_prompt(text="Warm-up.", instruction=""))
            runner.set_sampling(slot, SamplingParams(), 0)
            for _ in range(3):
                runner.step([slot])
        finally:
            runner.free_slot(slot)
        batcher = self._batcher
        assert batcher is not None
        t1 = time.perf_counter()
        batcher.warm_up()
        if batcher.graphs:
            log.info("codec graphs captured in %.1f s", time.perf_counter() - t1)
        state = batcher.decoder.new_state()
        try:
            codes = np.zeros((1 + 8, N_CODEBOOKS), dtype=np.int64)
            batcher.decode([state], [codes[:1]])
            batcher.decode([state], [codes[1:]])
            with batcher.eager():
                batcher.decoder.decode([state], [codes[1:]])
        finally:
            state.close()
        self._sync()
        log.info("engine warm-up done in %.1f s", time.perf_counter() - t0)
