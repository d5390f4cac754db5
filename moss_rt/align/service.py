"""Every alignment goes through here: a bounded queue, the aligner's worker threads, results back on the loop.

The event loop never aligns: :meth:`AlignService.align` queues a job and awaits its future. The workers (as many as
the aligner allows at once: PocketSphinx one per decoder, a GPU model one feeding the device) take a job and every
job queued behind it up to ``max_batch`` (waiting for more to arrive: :func:`gather_time`), so concurrent takes
share one batch on the device. At most ``max_pending`` jobs wait; a streaming take skips a tick
when the queue is full (``wait=False``), a take that ends waits for room. The first worker loads the aligner (its
weights) before anything else.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from moss_rt.align.base import Aligner, AlignJob, AlignResult
from moss_rt.align.track import MIN_WINDOW_SEC, STREAM_WINDOW_SEC

log = logging.getLogger(__name__)

# A device aligner's gather grows with the load: the rate jobs arrived at over the last RATE_WINDOW_SEC, up to
# BUSY_JOBS_PER_SEC (about 20 takes streaming, one job per 0.64 s chunk each) where it reaches the aligner's
# max_gather_sec.
RATE_WINDOW_SEC = 2.0
BUSY_JOBS_PER_SEC = 32.0


def gather_time(base: float, most: float, rate: float) -> float:
    """How long after it was queued a job waits for others to join its batch: ``base`` (seconds) for a lone
    take, growing linearly with ``rate`` (jobs a second arriving) to ``most`` at BUSY_JOBS_PER_SEC and beyond.
    A device model's call costs nearly the same for one job or dozens: under load, fewer fuller calls; a lone take
    gets its words at once. Measured from the job's arrival, so time it spent queued behind a running batch counts."""
    base = max(0.0, base)
    if most <= base:
        return base
    return base + (most - base) * min(1.0, max(0.0, rate) / BUSY_JOBS_PER_SEC)


class AlignerBusy(Exception):
    """The aligner's queue is full (a streaming tick is skipped; words follow with the next one)."""


class AlignerUnavailable(Exception):
    """The aligner failed to load; words are then placed by estimate (flagged interpolated)."""


@dataclass
class _Queued:
    job: AlignJob
    future: asyncio.Future[AlignResult]
    loop: asyncio.AbstractEventLoop
    queued_at: float = field(default_factory=time.monotonic)


_STOP = object()


class AlignService:
    def __init__(self, aligner: Aligner, *, max_pending: int = 256, window_sec: float = STREAM_WINDOW_SEC) -> None:
        self.aligner = aligner
        self.max_pending = max_pending
        # A streaming take's job reads at most this much audio (its WordTrack's window; Settings.aligner_window_sec).
        self.window_sec = max(MIN_WINDOW_SEC, window_sec)
        self._queue: queue.Queue[object] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._loaded = threading.Event()
        self._load_lock = threading.Lock()
        self.failure: str | None = None
        self._slots: asyncio.Semaphore | None = None
        self.jobs_done = 0

    @property
    def name(self) -> str:
        return self.aligner.name

    @property
    def ready(self) -> bool:
        return self._loaded.is_set() and self.failure is None

    def start(self) -> None:
        for i in range(max(1, self.aligner.workers)):
            thread = threading.Thread(target=self._work, name=f"aligner-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    async def wait_loaded(self) -> None:
        """Until the aligner is loaded (raises AlignerUnavailable if it failed)."""
        await asyncio.to_thread(self._loaded.wait)
        if self.failure is not None:
            raise AlignerUnavailable(self.failure)

    async def align(self, job: AlignJob, *, wait: bool = True) -> AlignResult:
        """Run one job on a worker. ``wait=False``: raise AlignerBusy instead of waiting for room in the queue."""
        if self.failure is not None:
            raise AlignerUnavailable(self.failure)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_pending)
        if not wait and self._slots.locked():
            raise AlignerBusy()
        async with self._slots:
            loop = asyncio.get_running_loop()
            future: asyncio.Future[AlignResult] = loop.create_future()
            self._queue.put(_Queued(job, future, loop))
            return await future

    def close(self) -> None:
        """Stop the workers after the jobs queued (non-blocking; they are daemon threads) and the aligner's
        own workers (processes)."""
        for _ in self._threads:
            self._queue.put(_STOP)
        close = getattr(self.aligner, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # shutting down: nothing to do about it but say so
                log.exception("aligner %s did not close cleanly", self.aligner.name)

    # ------------------------------------------------------------------ worker threads

    def _load(self) -> None:
        with self._load_lock:
            if self._loaded.is_set():
                return
            try:
                self.aligner.load()
            except Exception as exc:  # any failure: the words of takes are estimated instead
                self.failure = f"{type(exc).__name__}: {exc}"
                log.exception("aligner %s failed to load", self.aligner.name)
            finally:
                self._loaded.set()

    def _work(self) -> None:
        self._load()
        base = max(0.0, getattr(self.aligner, "gather_sec", 0.0))
        most = max(base, getattr(self.aligner, "max_gather_sec", base))
        # When the jobs this worker took were queued, over the last RATE_WINDOW_SEC: the load.
        arrivals: deque[float] = deque(maxlen=4096)
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch = [first]
            # Wait for more jobs (a device model's call costs about the same for one job or many), up to the gather
            # time after the first one was queued; what is queued already joins at once.
            deadline = time.monotonic()
            if most > 0 and isinstance(first, _Queued):
                now = deadline
                while arrivals and arrivals[0] < now - RATE_WINDOW_SEC:
                    arrivals.popleft()
                deadline = first.queued_at + gather_time(base, most, len(arrivals) / RATE_WINDOW_SEC)
            while len(batch) < max(1, self.aligner.max_batch):
                try:
                    left = deadline - time.monotonic()
                    more = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    self._queue.put(_STOP)  # for this worker's next round: finish the batch first
                    break
                batch.append(more)
            jobs = [item for item in batch if isinstance(item, _Queued)]
            if most > 0:
                arrivals.extend(item.queued_at for item in jobs)
            self._run(jobs)

    def _run(self, batch: list[_Queued]) -> None:
        live = [item for item in batch if not item.future.cancelled()]
        if not live:
            return
        try:
            if self.failure is not None:
                raise AlignerUnavailable(self.failure)
            results = self.aligner.align_batch([item.job for item in live])
        except Exception as exc:  # an aligner must not raise; if one does, its takes fall back to estimates
            if not isinstance(exc, AlignerUnavailable):
                log.exception("aligner %s failed on a batch of %d", self.aligner.name, len(live))
            for item in live:
                item.loop.call_soon_threadsafe(_settle_error, item.future, AlignerUnavailable(str(exc)))
            return
        self.jobs_done += len(live)
        for item, result in zip(live, results, strict=True):
            item.loop.call_soon_threadsafe(_settle, item.future, result)


def _settle(future: asyncio.Future[AlignResult], result: AlignResult) -> None:
    if not future.done():
        future.set_result(result)


def _settle_error(future: asyncio.Future[AlignResult], exc: Exception) -> None:
    if not future.done():
        future.set_exception(exc)
