"""The codec worker: every use of the streaming decoder runs here, in order, overlapped with the model steps.

The scheduler hands it work as plain callables and goes on stepping:

- ``submit(fn)`` queues a decode of due chunks (or a batched rebuild of retakes' codec states) and returns its
  sequence number at once; a decode pushes its PCM to the takes' channels itself, so audio goes out as soon as it
  is ready, not a model step later;
- ``call(fn)`` queues ``fn`` and waits for its result (renders, encodes, graph captures): the decoder's forwards
  are not thread-safe, so nothing but this worker ever runs them (its block bookkeeping is under a lock: the
  scheduler opens, shares and closes streams from its own thread);
- ``done(seq)`` / ``wait(seq)`` / ``drain()``: work is done strictly in order, so "call ``seq`` is done" means
  every earlier one is done too. A take ends (its codec state is closed, its end event pushed) only once the
  last call holding its frames is done, so chunks of a take always precede its end and no state is ever
  closed, rebuilt or reused while a decode on it runs.

At most ``max_pending`` calls are queued or running: one more ``submit`` blocks the scheduler until the
oldest is done (the codec's lead over the model is bounded, so are memory and audio latency). Time the
scheduler spends blocked is reported through ``on_wait``.

Threaded (``codec_overlap``, the default), the worker owns a thread and, on CUDA, a stream of its own: decodes
run while the scheduler's thread runs the next model steps on the default stream. The codes reach the codec
through the host (the model step copies them to numpy before the scheduler sees them), so no device tensor
is shared between the two streams and no event is needed to order them; each codec call ends with a copy of
its audio to the host, so the stream is idle whenever the worker is. Inline (``threaded=False``) the same
calls run at once on the caller's thread: the same code path, without the overlap.

CUDA graph captures: a capture in progress forbids other threads' unsafe CUDA calls (cudaMalloc, synchronous
copies...), so a capture only ever runs while the other thread is not touching the device: the scheduler
drains the worker before a model step that captures, and codec captures run through ``call`` while the
scheduler waits for them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_PENDING = 2  # calls queued or running: one decoding while the next waits its turn
JOIN_TIMEOUT_S = 60.0


class CodecWorkerClosed(RuntimeError):
    """Work given to a worker that has stopped (the engine is shutting down)."""


@dataclass
class _Item:
    seq: int
    fn: Callable[[], object]
    dropped: Callable[[], None] | None = None  # called instead of fn when the worker closes first


class CodecWorker:
    def __init__(
        self,
        *,
        threaded: bool,
        device: Any = None,
        max_pending: int = DEFAULT_MAX_PENDING,
        on_done: Callable[[], None] = lambda: None,
        on_wait: Callable[[float], None] = lambda seconds: None,
        name: str = "moss-rt-codec",
    ) -> None:
        self.threaded = threaded
        self.max_pending = max(1, int(max_pending))
        if device is not None and getattr(device, "type", None) == "cuda" and device.index is None:
            import torch

            device = torch.device("cuda", torch.cuda.current_device())  # the creating thread's device
        self._device = device
        self._on_done = on_done
        self._on_wait = on_wait
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[_Item] = deque()
        self._running = False
        self._issued = 0  # sequence number of the latest work given
        self._done = 0  # every sequence number up to this one is done (work runs in order)
        self._closed = False
        self._discard = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.threaded and self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def close(self, *, discard: bool = True) -> None:
        """Stop: work not started yet is dropped (``discard``) or done, the running one finishes, the thread
        ends. Afterwards every sequence number counts as done and new work is refused."""
        with self._cond:
            if self._closed and self._thread is None:
                return
            self._closed = True
            self._discard = discard
            self._cond.notify_all()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_TIMEOUT_S)
            if thread.is_alive():  # pragma: no cover - a wedged device
                log.error("codec worker did not stop within %.0f s", JOIN_TIMEOUT_S)
        with self._cond:
            for item in self._queue:  # inline workers and a thread that never started
                self._drop(item)
            self._queue.clear()
            self._done = self._issued
            self._cond.notify_all()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def pending(self) -> int:
        """Calls queued or running."""
        return len(self._queue) + int(self._running)

    # ------------------------------------------------------------------ producer side (the scheduler)
    def submit(self, fn: Callable[[], object]) -> int:
        """Queue ``fn`` (it handles its own errors) and return its sequence number; blocks while
        ``max_pending`` calls are queued or running. Inline, ``fn`` runs now."""
        return self._enqueue(fn, None)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` after every earlier call and return its result (or raise its exception)."""
        if not self._threaded_now():
            self._check_open()
            return fn()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        started: list[float] = []

        def run() -> None:
            started.append(time.perf_counter())
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the waiting caller
                future.set_exception(exc)

        def dropped() -> None:
            future.set_exception(CodecWorkerClosed("the codec worker stopped"))

        t0 = time.perf_counter()
        behind = self.pending > 0
        self._enqueue(run, dropped, observe=False)
        with contextlib.suppress(BaseException):
            future.exception()  # waits for it
        if behind:  # what the caller lost to the overlap: the wait for earlier calls, not the work it asked for
            self._on_wait((started[0] if started else time.perf_counter()) - t0)
        return future.result()

    def done(self, seq: int) -> bool:
        return seq <= self._done

    def wait(self, seq: int) -> None:
        """Block until call ``seq`` (and every earlier one) is done."""
        if seq <= self._done:
            return
        t0 = time.perf_counter()
        with self._cond:
            while self._done < seq:
                self._cond.wait()
        self._on_wait(time.perf_counter() - t0)

    def drain(self) -> None:
        """Block until every call given so far is done (the device is then idle on the codec's side)."""
        self.wait(self._issued)

    # ------------------------------------------------------------------ internals
    def _threaded_now(self) -> bool:
        # Work given from the worker's own thread runs at once (waiting for itself would never end).
        return self._thread is not None and threading.current_thread() is not self._thread

    def _check_open(self) -> None:
        if self._closed:
            raise CodecWorkerClosed("the codec worker stopped")

    def _enqueue(self, fn: Callable[[], object], dropped: Callable[[], None] | None, observe: bool = True) -> int:
        if not self._threaded_now():
            self._check_open()
            with self._cond:
                self._issued += 1
                seq = self._issued
            try:
                fn()
            except Exception:
                log.exception("codec work failed")
            finally:
                with self._cond:
                    self._done = max(self._done, seq)
            return seq
        t0: float | None = None
        with self._cond:
            while self.pending >= self.max_pending and not self._closed:
                if t0 is None:
                    t0 = time.perf_counter()
                self._cond.wait()
            self._check_open()
            self._issued += 1
            seq = self._issued
            self._queue.append(_Item(seq, fn, dropped))
            self._cond.notify_all()
        if t0 is not None and observe:
            self._on_wait(time.perf_counter() - t0)
        return seq

    @staticmethod
    def _drop(item: _Item) -> None:
        if item.dropped is not None:
            try:
                item.dropped()
            except Exception:  # pragma: no cover - a future already resolved
                log.exception("dropping codec work failed")

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            # Normally after close(); if the thread died, nothing may wait on it forever: what it never ran is
            # dropped, every sequence number counts as done and new work is refused (the scheduler then fails
            # its takes through its error path).
            with self._cond:
                if not self._closed:
                    log.error("codec worker thread ended unexpectedly")
                self._closed = True
                for item in self._queue:
                    self._drop(item)
                self._queue.clear()
                self._running = False
                self._done = self._issued
                self._cond.notify_all()

    def _serve(self) -> None:
        with self._device_context():
            while True:
                with self._cond:
                    while not self._queue and not self._closed:
                        self._cond.wait()
                    if not self._queue:
                        break  # closed and nothing left
                    item = self._queue.popleft()
                    skip = self._closed and self._discard
                    self._running = not skip
                if skip:
                    self._drop(item)
                else:
                    try:
                        item.fn()
                    except Exception:  # the scheduler's functions handle their own errors; keep serving
                        log.exception("codec work failed")
                with self._cond:
                    self._running = False
                    self._done = item.seq
                    self._cond.notify_all()
                try:
                    self._on_done()
                except Exception:  # pragma: no cover - a wake-up callback
                    log.exception("codec worker callback failed")

    @contextlib.contextmanager
    def _device_context(self) -> Iterator[None]:
        """On CUDA: the engine's device and a stream of the worker's own for everything it runs."""
        device = self._device
        if device is None or getattr(device, "type", None) != "cuda":
            yield
            return
        import torch

        try:
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device=device)
        except Exception:  # pragma: no cover - the engine's device works, or loading failed before
            log.exception("codec worker: no CUDA stream of its own; decoding on the default stream")
            yield
            return
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            stream.synchronize()
