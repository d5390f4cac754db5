"""The codec worker: every use of the streaming decoder runs here, on a thread of its own, overlapped with the model.

The scheduler hands it work as plain callables and goes on stepping:

- ``submit_all(calls)`` (``submit(fn)`` for one) queues the decodes of one round's due chunks (or batched rebuilds of
  retakes' codec states), cut by the scheduler into short calls, and returns their sequence numbers at once; a
  decode pushes its PCM to the takes' channels itself, so audio goes out as soon as it is ready, not a model step
  later;
- ``call(fn)`` queues ``fn`` and waits for its result (renders, encodes, graph captures): the decoder's forwards
  are not thread-safe, so nothing but this worker ever runs them (its block bookkeeping is under a lock: the
  scheduler opens, shares and closes streams from its own thread);
- ``done(seq)`` / ``wait(seq)`` / ``drain()``;
- ``withdraw(key)``: a stream taken out of the calls queued for it (a cancelled take).

**Two lanes.** A hand-over is ``priority`` (what a director is waiting on: interactive takes' first chunks, the
rebuilds of interactive retakes) or bulk (steady chunks, batch work). The worker runs the oldest priority call that
may go, else the oldest call: a priority call waits for the call running when it came, never for the bulk calls queued
before it (the scheduler keeps bulk calls short: ``codec_call_streams``) -- unless the bulk lane is backed up (a bulk
hand-over is parked behind it) and a bulk call has waited its patience since it was given (``bulk_patience_s``, or the
call's own ``patience_s``: the scheduler gives a render's calls a longer one): then it goes first, but never twice in
a row while a priority call waits, so a priority call waits for at most the running call and one bulk call. Without
that bound a flow of priority calls starves the bulk lane: while hand-overs are parked behind it the scheduler holds
every running stream's step back (engine/codec_flow.py) and lets only directors' ramps step, whose chunks are priority
calls again, so with directors starting one after another the running streams stood still for a second or more
(measured on an H200, 64 directors with spread starts: 0.04x real time for the slowest stream, bulk calls queued 1.5-2
s on average; with a patience of 40 ms: 1.66x, 68 ms). While nothing is parked a bulk call holds no one's step back
(the streams' clients hold seconds of audio), and letting it go first after 40 ms only made directors' first chunks
wait (16 directors on an H200: first audio p95 62 -> 81 ms); with no bound at all, though, every running stream's
audio came later and later (64 directors starting one after another: bulk calls queued 310 ms on average, the slowest
stream 1.35x real time). So while nothing is parked a bulk call goes first only once it has waited
``bulk_longest_wait_s`` (60 ms; a render's call its own patience if longer), the lanes again taking turns. 120 ms was
not short enough in a burst: 64 directors retaking at once made a ramp's one-frame call nearly every step, bulk calls
queued 89-93 ms on average and the slowest running stream fell to 1.72-1.86x; at 60 ms, 51 ms and 2.15x (retakes' p95
still within issue 22's 400 ms: 362). Every call names the streams it touches (``keys``: the takes' codec states) and
never runs before an earlier call on one of them, so each stream's chunks are decoded in order and a take's audio is
the same whichever lane its chunks went through (calls of other streams never change a stream's numbers: a batched
call's rows are independent). ``done(seq)`` therefore means that call is done, and with it every earlier call on its
streams: a take ends (its codec state is closed or kept, its end pushed) only once the last call holding its frames is
done, so no state is ever closed, rebuilt or reused while a decode on it runs. A ``call`` is a barrier: nothing queued
after it runs before it.

**Bounds.** At most ``max_pending`` bulk hand-overs and ``max_pending`` priority hand-overs are queued or running
(a hand-over is one ``submit_all``: one round's chunks, in as many short calls as the scheduler cut them into); one
more blocks the scheduler until the oldest of its lane is done (the codec's lead over the model is bounded, so are
memory and audio latency). Time the scheduler spends blocked is reported through ``on_wait``. Priority hand-overs
have a bound of their own, so a director's first chunk never waits for room behind bulk work.

**Parking** (``submit_all(..., wait=False)``): a hand-over that finds its lane full does not block its producer; it is
*parked* behind the lane, with its sequence numbers given at once (``done``, ``withdraw`` and ``drain`` see it like
a queued call), and joins the lane, oldest first, as soon as the lane has room. The lane's bound holds for what is
queued or running; what is parked is the producer's to bound (``parked``: the scheduler holds its next model step
back instead of parking more: engine/codec_flow.py). Parked hand-overs join the lanes strictly in the order they were
given, and a blocking hand-over or a ``call`` never overtakes a parked one touching the same streams (a ``call``
waits until nothing is parked), so every stream's calls still run in the order they were given.

**Withdraw.** A call queued but not started may give a stream up: its ``withdraw`` callback puts a padding row of the
same shape in the stream's place (the call's batch, and so the other streams' numbers, stay the same) and the
stream's state is not touched. ``withdraw(key)`` does that for every queued call of the stream and returns the
running call that still touches it (0: none), so a cancelled take's codec state is free after at most that call.

Threaded (``codec_overlap``, the default), the worker owns a thread and, on CUDA, a stream of its own: decodes
run while the scheduler's thread runs the next model steps on the default stream. The codes reach the codec
through the host (the model step copies them to numpy before the scheduler sees them), so no device tensor
is shared between the two streams and no event is needed to order them; each codec call ends with a copy of
its audio to the host, so the stream is idle whenever the worker is. Inline (``threaded=False``) the same
calls run at once on the caller's thread, in the order given: the same code path, without the overlap.

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
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from moss_rt.engine import gpu_streams
from moss_rt.engine.gpu_streams import LaneStreams

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_PENDING = 2  # hand-overs per lane queued or running: one decoding while the next waits its turn
# Half a frame interval: while the bulk lane is backed up, a bulk call older than this goes before priority calls.
DEFAULT_BULK_PATIENCE_S = 0.04
# Otherwise a bulk call goes first once it has waited this long (or its own patience, if longer): nothing is held yet,
# but every running stream's audio is late by its wait (64 directors starting one after another on an H200: bulk
# calls queued 310 ms on average with no bound, the slowest stream 1.35x real time during the retakes; 64 retaking in a
# burst: 89-93 ms, 1.72-1.86x with 120 ms here, 51 ms and 2.15x with 60).
DEFAULT_BULK_LONGEST_WAIT_S = 0.06
JOIN_TIMEOUT_S = 60.0


class CodecWorkerClosed(RuntimeError):
    """Work given to a worker that has stopped (the engine is shutting down)."""


@dataclass(frozen=True)
class CodecCall:
    """One call of a hand-over: the work, the streams it touches (``keys``), and how to take one of them out while
    the call has not started (``withdraw(key)``; None: it cannot give its streams up)."""

    fn: Callable[[], object]
    keys: tuple[Hashable, ...] = ()
    withdraw: Callable[[Hashable], None] | None = None
    patience_s: float | None = None  # a bulk call's patience (None: the worker's bulk_patience_s)


@dataclass(eq=False)
class _Item:
    seq: int
    fn: Callable[[], object]
    dropped: Callable[[], None] | None = None  # called instead of fn when the worker closes first
    priority: bool = False
    keys: set[Hashable] = field(default_factory=set)
    withdraw: Callable[[Hashable], None] | None = None
    group: int = 0  # the hand-over it belongs to
    barrier: bool = False  # nothing queued after it runs before it (``call``)
    given: float = field(default_factory=time.perf_counter)  # when its producer gave it (parked time counts)
    # (bulk) how long it waits behind priority calls at most while the bulk lane is backed up; otherwise the longer of
    # this and the worker's bulk_longest_wait_s
    patience_s: float = 0.0


class CodecWorker:
    def __init__(
        self,
        *,
        threaded: bool,
        device: Any = None,
        max_pending: int = DEFAULT_MAX_PENDING,
        bulk_patience_s: float = DEFAULT_BULK_PATIENCE_S,
        bulk_longest_wait_s: float = DEFAULT_BULK_LONGEST_WAIT_S,
        on_done: Callable[[], None] = lambda: None,
        on_wait: Callable[[float], None] = lambda seconds: None,
        on_call: Callable[[bool, float], None] = lambda priority, queued_s: None,
        name: str = "moss-rt-codec",
        stream_priorities: bool = False,
    ) -> None:
        self.threaded = threaded
        # Threaded on CUDA: the priority lane's calls on a stream of the highest priority, the rest on a normal one
        # (engine/gpu_streams); off: every call on one stream of the worker's own.
        self.stream_priorities = stream_priorities
        self._lanes: LaneStreams | None = None
        self.max_pending = max(1, int(max_pending))
        self.bulk_patience_s = max(0.0, float(bulk_patience_s))
        self.bulk_longest_wait_s = max(0.0, float(bulk_longest_wait_s))
        self._aged_last = False  # the call started last was a bulk call that went first for its patience
        if device is not None and getattr(device, "type", None) == "cuda" and device.index is None:
            import torch

            device = torch.device("cuda", torch.cuda.current_device())  # the creating thread's device
        self._device = device
        self._on_done = on_done
        self._on_wait = on_wait
        self._on_call = on_call  # a hand-over's call starts: its lane (True: priority) and seconds since given
        self._name = name
        self._cond = threading.Condition()
        self._queue: list[_Item] = []
        self._current: _Item | None = None  # the call running now
        self._issued = 0  # sequence number of the latest call given
        self._groups = 0  # hand-overs given
        self._outstanding: set[int] = set()  # calls queued or running
        self._open: dict[int, list[Any]] = {}  # hand-over -> [priority, calls of it not done]
        # Hand-overs given without waiting while their lane was full (oldest first): (group, priority, calls).
        self._parked: deque[tuple[int, bool, list[_Item]]] = deque()
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
            self._forget_all()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def pending(self) -> int:
        """Calls queued or running."""
        return len(self._outstanding)

    def handovers(self, priority: bool) -> int:
        """Hand-overs of one lane with a call queued or running (what ``max_pending`` bounds; parked ones not)."""
        with self._cond:  # a reentrant lock: also called under it
            return sum(1 for lane, _ in self._open.values() if lane is priority)

    def parked(self, priority: bool = False) -> int:
        """Hand-overs of one lane parked behind it (given with ``wait=False`` while it was full)."""
        with self._cond:
            return sum(1 for _, lane, _ in self._parked if lane is priority)

    def has_room(self, priority: bool = False) -> bool:
        """Whether a hand-over given now to that lane would be queued at once (neither block nor be parked)."""
        with self._cond:
            return self.handovers(priority) < self.max_pending and not self.parked(priority)

    # ------------------------------------------------------------------ producer side (the scheduler)
    def submit(
        self,
        fn: Callable[[], object],
        *,
        priority: bool = False,
        keys: Sequence[Hashable] = (),
        withdraw: Callable[[Hashable], None] | None = None,
        patience_s: float | None = None,
    ) -> int:
        """Queue ``fn`` (it handles its own errors) as a hand-over of its own and return its sequence number; blocks
        while ``max_pending`` hand-overs of its lane are queued or running. Inline, ``fn`` runs now."""
        return self.submit_all([CodecCall(fn, tuple(keys), withdraw, patience_s)], priority=priority)[0]

    def submit_all(self, calls: Sequence[CodecCall], *, priority: bool = False, wait: bool = True) -> list[int]:
        """Queue ``calls`` as one hand-over (in this order) and return their sequence numbers; blocks while
        ``max_pending`` hand-overs of the lane are queued or running, or, with ``wait=False``, parks the hand-over
        behind the lane instead (see the module docstring) and returns at once. Inline, they run now, in order."""
        if not calls:
            return []
        if not self._threaded_now():
            self._check_open()
            return [self._run_inline(c.fn, priority) for c in calls]
        items = [
            _Item(0, c.fn, priority=priority, keys=set(c.keys), withdraw=c.withdraw,
                  patience_s=self.bulk_patience_s if c.patience_s is None else max(0.0, c.patience_s))
            for c in calls
        ]
        return self._enqueue(items, priority) if wait else self._park(items, priority)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` after every call queued before it and return its result (or raise its exception)."""
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
        self._enqueue([_Item(0, run, dropped, barrier=True)], False, observe=False)
        with contextlib.suppress(BaseException):
            future.exception()  # waits for it
        if behind:  # what the caller lost to the overlap: the wait for earlier calls, not the work it asked for
            self._on_wait((started[0] if started else time.perf_counter()) - t0)
        return future.result()

    def done(self, seq: int) -> bool:
        """Whether call ``seq`` is done (and with it every earlier call on the streams it touched)."""
        return seq not in self._outstanding

    def wait(self, seq: int) -> None:
        """Block until call ``seq`` is done."""
        if seq not in self._outstanding:
            return
        t0 = time.perf_counter()
        with self._cond:
            while seq in self._outstanding:
                self._cond.wait()
        self._on_wait(time.perf_counter() - t0)

    def drain(self) -> None:
        """Block until every call given so far is done (the device is then idle on the codec's side)."""
        with self._cond:
            targets = set(self._outstanding)
        if not targets:
            return
        t0 = time.perf_counter()
        with self._cond:
            while targets & self._outstanding:
                self._cond.wait()
        self._on_wait(time.perf_counter() - t0)

    def withdraw(self, key: Hashable) -> int:
        """Take stream ``key`` out of every queued call that can give it up (see the module docstring); returns the
        sequence number of the latest call still touching it (the running one, or a queued one that cannot give it
        up), 0 when none does."""
        with self._cond:
            last = 0
            for item in [*self._queue, *(item for _, _, items in self._parked for item in items)]:
                if key not in item.keys:
                    continue
                if item.withdraw is None:
                    last = max(last, item.seq)
                    continue
                item.withdraw(key)
                item.keys.discard(key)
            current = self._current
            if current is not None and key in current.keys:
                last = max(last, current.seq)
            return last

    # ------------------------------------------------------------------ internals
    def _threaded_now(self) -> bool:
        # Work given from the worker's own thread runs at once (waiting for itself would never end).
        return self._thread is not None and threading.current_thread() is not self._thread

    def _check_open(self) -> None:
        if self._closed:
            raise CodecWorkerClosed("the codec worker stopped")

    def _run_inline(self, fn: Callable[[], object], priority: bool) -> int:
        with self._cond:
            self._issued += 1
            seq = self._issued
            self._outstanding.add(seq)
        try:
            self._on_call(priority, 0.0)
            fn()
        except Exception:
            log.exception("codec work failed")
        finally:
            with self._cond:
                self._outstanding.discard(seq)
        return seq

    def _enqueue(self, items: list[_Item], priority: bool, observe: bool = True) -> list[int]:
        t0: float | None = None
        keys = set().union(*(item.keys for item in items))
        barrier = any(item.barrier for item in items)
        with self._cond:
            while not self._closed and (
                self.handovers(priority) >= self.max_pending
                or self._parked_ahead(keys, priority, barrier)
            ):
                if t0 is None:
                    t0 = time.perf_counter()
                self._cond.wait()
            self._check_open()
            seqs = self._number(items)
            self._admit(self._groups, priority, items)
            self._cond.notify_all()
        if t0 is not None and observe:
            self._on_wait(time.perf_counter() - t0)
        return seqs

    def _parked_ahead(self, keys: set[Hashable], priority: bool, barrier: bool) -> bool:
        """(Under the lock.) Whether a blocking hand-over must wait for parked ones to join the lanes first: a
        ``call`` (barrier) for all of them, any other for those of its own lane (their order) or touching its
        streams (theirs)."""
        if barrier:
            return bool(self._parked)
        return any(lane is priority or keys & item.keys for _, lane, items in self._parked for item in items)

    def _number(self, items: list[_Item]) -> list[int]:
        """(Under the lock.) A new hand-over's sequence numbers; outstanding from now on."""
        self._groups += 1
        seqs = []
        for item in items:
            self._issued += 1
            item.seq, item.group = self._issued, self._groups
            self._outstanding.add(item.seq)
            seqs.append(item.seq)
        return seqs

    def _admit(self, group: int, priority: bool, items: list[_Item]) -> None:
        """(Under the lock.) A numbered hand-over joins its lane's queue."""
        self._open[group] = [priority, len(items)]
        self._queue.extend(items)

    def _park(self, items: list[_Item], priority: bool) -> list[int]:
        """Queue the hand-over now if its lane has room and nothing is parked before it, else park it; never
        blocks."""
        with self._cond:
            self._check_open()
            seqs = self._number(items)
            if not self._parked and self.handovers(priority) < self.max_pending:
                self._admit(self._groups, priority, items)
                self._cond.notify_all()
            else:
                self._parked.append((self._groups, priority, items))
        return seqs

    def _unpark(self) -> None:
        """(Under the lock.) Parked hand-overs join their lanes, oldest first, while the oldest's lane has room."""
        while self._parked:
            group, priority, items = self._parked[0]
            if self.handovers(priority) >= self.max_pending:
                return
            self._parked.popleft()
            self._admit(group, priority, items)

    def _next(self) -> _Item:
        """(Under the lock.) The call to run next: the oldest priority call no earlier call shares a stream with (none
        past a barrier), else the oldest -- but first the oldest bulk call out of patience that may go (while bulk
        hand-overs are parked, its patience; else also the worker's longest wait), unless the call before was one and
        a priority call may go (the lanes then alternate)."""
        backed_up = any(not lane for _, lane, _ in self._parked)
        longest = 0.0 if backed_up else self.bulk_longest_wait_s  # a call's own patience, if longer, still holds
        now = time.perf_counter()
        seen: set[Hashable] = set()
        aged: int | None = None
        first_priority: int | None = None
        for i, item in enumerate(self._queue):
            if item.barrier:
                break
            free = not (item.keys & seen)
            if free and item.priority and first_priority is None:
                first_priority = i
            elif free and not item.priority and aged is None and now - item.given >= max(item.patience_s, longest):
                aged = i
            seen |= item.keys
        if aged is not None and not (self._aged_last and first_priority is not None):
            self._aged_last = True
            return self._queue.pop(aged)
        self._aged_last = False
        return self._queue.pop(0 if first_priority is None else first_priority)

    def _settle(self, item: _Item) -> None:
        """``item`` is done or dropped (under the lock)."""
        self._outstanding.discard(item.seq)
        group = self._open.get(item.group)
        if group is not None:
            group[1] -= 1
            if group[1] <= 0:
                del self._open[item.group]
                self._unpark()

    def _forget_all(self) -> None:
        """Closed: what never ran is dropped, every sequence number counts as done (under the lock)."""
        for item in [*self._queue, *(item for _, _, items in self._parked for item in items)]:
            self._drop(item)
        self._queue.clear()
        self._parked.clear()
        self._current = None
        self._outstanding.clear()
        self._open.clear()
        self._cond.notify_all()

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
                self._forget_all()

    def _serve(self) -> None:
        with self._device_context():
            while True:
                with self._cond:
                    while not self._queue and not self._closed:
                        self._cond.wait()
                    if not self._queue:
                        break  # closed and nothing left
                    item = self._next()
                    skip = self._closed and self._discard
                    self._current = None if skip else item
                if skip:
                    self._drop(item)
                else:
                    try:
                        if not item.barrier:
                            self._on_call(item.priority, time.perf_counter() - item.given)
                        with self._lane(item.priority and not item.barrier):
                            item.fn()
                    except Exception:  # the scheduler's functions handle their own errors; keep serving
                        log.exception("codec work failed")
                with self._cond:
                    self._current = None
                    self._settle(item)
                    self._cond.notify_all()
                try:
                    self._on_done()
                except Exception:  # pragma: no cover - a wake-up callback
                    log.exception("codec worker callback failed")

    def _lane(self, priority: bool) -> contextlib.AbstractContextManager[None]:
        """Where a call runs on the device: its lane's stream (stream priorities), else the worker's one stream."""
        lanes = self._lanes
        return lanes.lane(priority) if lanes is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _device_context(self) -> Iterator[None]:
        """On CUDA: the engine's device and a stream of the worker's own for everything it runs (with stream
        priorities, one per lane)."""
        device = self._device
        if not gpu_streams.usable(device):
            yield
            return
        import torch

        try:
            torch.cuda.set_device(device)
            if self.stream_priorities:
                self._lanes = LaneStreams(device)
            # Outside a call (a dropped call's clean-up) the worker's current stream is the bulk lane's: no third.
            stream = self._lanes.normal if self._lanes is not None else torch.cuda.Stream(device=device)
        except Exception:  # pragma: no cover - the engine's device works, or loading failed before
            log.exception("codec worker: no CUDA stream of its own; decoding on the default stream")
            self._lanes = None
            yield
            return
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            stream.synchronize()
            if self._lanes is not None:
                self._lanes.synchronize()
