"""CodecWorker on its own: order, the bounded queue, call results and errors, close with work in flight."""

from __future__ import annotations

import threading
import time

import pytest

from moss_rt.engine.codec_worker import CodecCall, CodecWorker, CodecWorkerClosed


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


@pytest.fixture
def worker() -> CodecWorker:
    w = CodecWorker(threaded=True, max_pending=2, name="test-codec-worker")
    w.start()
    yield w
    w.close()


def test_work_runs_in_order_on_the_worker_thread(worker: CodecWorker) -> None:
    ran: list[tuple[int, str]] = []
    seqs = [worker.submit(lambda i=i: ran.append((i, threading.current_thread().name))) for i in range(20)]
    worker.drain()
    assert ran == [(i, "test-codec-worker") for i in range(20)]
    assert seqs == sorted(seqs) and all(worker.done(s) for s in seqs)
    assert worker.call(lambda: threading.current_thread().name) == "test-codec-worker"


def test_the_bounded_queue_blocks_the_producer_instead_of_growing() -> None:
    waits: list[float] = []
    w = CodecWorker(threaded=True, max_pending=2, on_wait=waits.append, name="test-codec-worker")
    w.start()
    gate = threading.Event()
    try:
        first = w.submit(gate.wait)  # runs, blocked on the gate
        second = w.submit(lambda: None)  # queued: two calls pending, the bound
        assert w.pending == 2 and not w.done(first)
        submitted = threading.Event()

        def produce() -> None:
            w.submit(lambda: None)
            submitted.set()

        producer = threading.Thread(target=produce)
        producer.start()
        assert not submitted.wait(0.3), "a third call must wait for room, not queue"
        assert w.pending == 2
        gate.set()
        assert submitted.wait(5.0)
        producer.join(5.0)
        w.drain()
        assert w.done(first) and w.done(second) and w.pending == 0
        assert waits and max(waits) >= 0.25  # the producer's wait is reported
    finally:
        gate.set()
        w.close()


def test_call_returns_results_and_raises_errors_and_a_failing_submit_does_not_stop_it(worker: CodecWorker) -> None:
    assert worker.call(lambda: 41 + 1) == 42
    worker.submit(lambda: 1 / 0)  # logged; the worker keeps serving

    def boom() -> None:
        raise ValueError("bad codes")

    with pytest.raises(ValueError, match="bad codes"):
        worker.call(boom)
    assert worker.call(lambda: "still here") == "still here"
    assert worker.alive


def test_wait_for_one_call_waits_for_every_earlier_one(worker: CodecWorker) -> None:
    order: list[int] = []
    gate = threading.Event()
    a = worker.submit(lambda: (gate.wait(), order.append(1)))
    b = worker.submit(lambda: order.append(2))
    threading.Timer(0.1, gate.set).start()
    worker.wait(b)
    assert worker.done(a) and order == [1, 2]


def test_close_finishes_the_running_call_drops_queued_ones_and_ends_the_thread() -> None:
    before = len(_threads("test-codec-close"))
    w = CodecWorker(threaded=True, max_pending=3, name="test-codec-close")
    w.start()
    assert len(_threads("test-codec-close")) == before + 1
    started, ran = threading.Event(), []

    def slow() -> None:
        started.set()
        time.sleep(0.2)
        ran.append("slow")

    seq = w.submit(slow)
    queued = w.submit(lambda: ran.append("queued"))
    assert started.wait(5.0)
    result: list[BaseException] = []
    caller = threading.Thread(target=lambda: _call_into(w, result))
    caller.start()
    time.sleep(0.05)
    w.close()  # discards what has not started
    caller.join(5.0)
    assert ran == ["slow"]  # the running call finished, the queued one never ran
    assert w.done(seq) and w.done(queued) and w.pending == 0
    assert result and isinstance(result[0], CodecWorkerClosed)  # a dropped call tells its caller
    assert len(_threads("test-codec-close")) == before and not w.alive
    with pytest.raises(CodecWorkerClosed):
        w.submit(lambda: None)
    w.close()  # twice is fine


def _call_into(w: CodecWorker, out: list[BaseException]) -> None:
    try:
        w.call(lambda: None)
    except BaseException as exc:
        out.append(exc)


def test_inline_worker_runs_work_at_once_on_the_callers_thread() -> None:
    w = CodecWorker(threaded=False)
    w.start()
    here = threading.current_thread().name
    names: list[str] = []
    seq = w.submit(lambda: names.append(threading.current_thread().name))
    assert names == [here] and w.done(seq) and w.pending == 0
    assert w.call(lambda: 7) == 7
    w.drain()
    w.close()
    with pytest.raises(CodecWorkerClosed):
        w.call(lambda: None)


# ----------------------------------------------------------------------------- lanes (issue 22, directing at scale)


def _held(w: CodecWorker, keys: tuple[str, ...] = ("held",)) -> tuple[threading.Event, threading.Event, int]:
    """A bulk call that runs until the test releases it: (started, release, its seq)."""
    started, release = threading.Event(), threading.Event()

    def run() -> None:
        started.set()
        release.wait(10)

    seq = w.submit(run, keys=keys)
    assert started.wait(5.0)
    return started, release, seq


def test_a_priority_call_goes_ahead_of_queued_bulk_calls_but_never_ahead_of_its_own_streams() -> None:
    """Bulk calls of streams a and b are queued behind a running one; priority calls come: those of new streams run
    next, in their order (they wait only for the running call); the one of stream b waits for b's earlier bulk call (a
    stream's calls stay in order) and then goes first."""
    w = CodecWorker(threaded=True, max_pending=4, bulk_patience_s=60.0, name="test-codec-lanes")
    w.start()
    ran: list[str] = []
    try:
        _, release, _ = _held(w)
        w.submit(lambda: ran.append("bulk a"), keys=("a",))
        w.submit(lambda: ran.append("bulk b"), keys=("b",))
        w.submit(lambda: ran.append("first chunk c"), priority=True, keys=("c",))
        w.submit(lambda: ran.append("first chunk b"), priority=True, keys=("b",))
        w.submit(lambda: ran.append("first chunk d"), priority=True, keys=("d",))
        w.submit(lambda: ran.append("bulk e"), keys=("e",))
        release.set()
        w.drain()
        assert ran == ["first chunk c", "first chunk d", "bulk a", "bulk b", "first chunk b", "bulk e"]
    finally:
        w.close()


def _patient_worker(name: str, started_calls: list[tuple[bool, float]] | None = None) -> CodecWorker:
    """A worker whose bulk calls are patient for 50 ms while the lane is backed up, and otherwise for far longer than
    these tests wait (the longest wait has its own test)."""
    calls = started_calls if started_calls is not None else []
    w = CodecWorker(threaded=True, max_pending=4, bulk_patience_s=0.05, bulk_longest_wait_s=10.0, name=name,
                    on_call=lambda priority, queued_s: calls.append((priority, queued_s)))
    w.start()
    return w


def test_a_backed_up_bulk_call_out_of_patience_goes_before_priority_calls_in_turns() -> None:
    """Priority calls wait while the bulk lane is backed up (hand-overs parked behind it: the scheduler holds the
    running streams' steps for it): a bulk call that has waited ``bulk_patience_s`` (or its own ``patience_s``) runs
    before them, the lanes taking turns, until nothing is parked; each call's wait is reported with its lane."""
    started_calls: list[tuple[bool, float]] = []
    w = _patient_worker("test-codec-patience", started_calls)
    ran: list[str] = []

    def bulk(name: str, **kw: float) -> CodecCall:
        return CodecCall(lambda: ran.append(name), (name,), None, kw.get("patience_s"))

    try:
        _, release, _ = _held(w)  # the bulk lane's first hand-over of 4
        w.submit_all([bulk("r", patience_s=60.0)])  # the oldest, with a patience of its own (a render's call)
        w.submit_all([bulk("a")])
        w.submit_all([bulk("b")])
        for name in ("e", "f", "g"):
            w.submit_all([bulk(name)], wait=False)  # the lane is full: parked
        assert w.parked() == 3
        time.sleep(0.08)  # every bulk call but r runs out of patience while the held call runs
        w.submit(lambda: ran.append("C"), priority=True, keys=("C",))
        w.submit(lambda: ran.append("D"), priority=True, keys=("D",))
        release.set()
        w.drain()
        # e joins the lane as the held call ends, f after a, g after b: until g is in, a bulk call out of patience goes
        # first (r is older but within its patience), then a priority call (turns); then nothing is parked: the priority
        # call, then the oldest first.
        assert ran == ["a", "C", "b", "D", "r", "e", "f", "g"]
        bulk_waits = [q for priority, q in started_calls if not priority]
        assert min(bulk_waits[1:3]) >= 0.05  # a's and b's waits (after the held call), reported
        assert all(q >= 0.0 for _, q in started_calls)
    finally:
        w.close()


def test_a_bulk_call_out_of_patience_does_not_go_first_while_nothing_is_parked() -> None:
    """Nothing parked behind the bulk lane, no step is held for it: a director's first chunk still goes first."""
    w = _patient_worker("test-codec-patience-idle")
    ran: list[str] = []
    try:
        _, release, _ = _held(w)
        w.submit(lambda: ran.append("old bulk a"), keys=("a",))
        time.sleep(0.08)
        w.submit(lambda: ran.append("first chunk c"), priority=True, keys=("c",))
        release.set()
        w.drain()
        assert ran == ["first chunk c", "old bulk a"]
    finally:
        w.close()


def test_a_bulk_call_past_its_longest_wait_goes_first_while_nothing_is_parked() -> None:
    """Nothing parked, but a steady chunk's decode has waited ``bulk_longest_wait_s``: it goes before the directors'
    first chunks, once (the lanes take turns); a render's call, patient for longer, does not."""
    w = CodecWorker(threaded=True, max_pending=4, bulk_patience_s=0.01, bulk_longest_wait_s=0.05,
                    name="test-codec-longest-wait")
    w.start()
    ran: list[str] = []
    try:
        _, release, _ = _held(w)
        w.submit(lambda: ran.append("render r"), keys=("r",), patience_s=60.0)
        w.submit(lambda: ran.append("old bulk a"), keys=("a",))
        time.sleep(0.08)
        w.submit(lambda: ran.append("first chunk c"), priority=True, keys=("c",))
        w.submit(lambda: ran.append("first chunk d"), priority=True, keys=("d",))
        assert w.parked() == 0
        release.set()
        w.drain()
        assert ran == ["old bulk a", "first chunk c", "first chunk d", "render r"]
    finally:
        w.close()


def test_nothing_queued_after_a_call_runs_before_it() -> None:
    """``call`` (renders, encodes, graph captures) is a barrier: a priority call queued after it does not pass it."""
    w = CodecWorker(threaded=True, max_pending=4, name="test-codec-barrier")
    w.start()
    ran: list[str] = []
    try:
        _, release, _ = _held(w)
        caller = threading.Thread(target=lambda: w.call(lambda: ran.append("capture")))
        caller.start()
        while w.pending < 2:
            time.sleep(0.001)
        w.submit(lambda: ran.append("first chunk"), priority=True, keys=("x",))
        release.set()
        caller.join(5.0)
        w.drain()
        assert ran == ["capture", "first chunk"]
    finally:
        w.close()


def test_the_lanes_are_bounded_each_so_a_first_chunk_never_waits_for_room_behind_bulk_work() -> None:
    waits: list[float] = []
    w = CodecWorker(threaded=True, max_pending=2, on_wait=waits.append, name="test-codec-bounds")
    w.start()
    try:
        _, release, _ = _held(w)
        w.submit(lambda: None, keys=("b",))
        assert w.handovers(False) == 2  # the bulk lane is full
        seqs = w.submit_all([CodecCall(lambda: None, ("p",)), CodecCall(lambda: None, ("q",))], priority=True)
        assert len(seqs) == 2 and w.handovers(True) == 1 and w.pending == 4 and not waits  # no wait for room
        blocked = threading.Event()

        def produce() -> None:
            w.submit(lambda: None)
            blocked.set()

        producer = threading.Thread(target=produce)
        producer.start()
        assert not blocked.wait(0.2), "a third bulk hand-over must wait for room"
        release.set()
        assert blocked.wait(5.0)
        producer.join(5.0)
        w.drain()
        assert w.pending == 0 and all(w.done(s) for s in seqs)
    finally:
        w.close()


def test_withdraw_takes_a_stream_out_of_queued_calls_and_names_the_running_one() -> None:
    """A cancelled take: its queued calls give its stream up (their callback swaps in a padding row; the call still
    runs for the other streams), and the call running on it is the one its state waits for."""
    w = CodecWorker(threaded=True, max_pending=4, name="test-codec-withdraw")
    w.start()
    withdrawn: list[tuple[str, object]] = []
    try:
        _, release, running = _held(w, keys=("x", "y"))
        queued = w.submit(lambda: None, keys=("x", "z"), withdraw=lambda key: withdrawn.append(("queued", key)))
        stuck = w.submit(lambda: None, keys=("w",))  # no withdraw callback: it cannot give its stream up
        assert w.withdraw("x") == running  # the running call still touches x
        assert withdrawn == [("queued", "x")] and not w.done(queued)
        assert w.withdraw("z") == 0 and withdrawn[-1] == ("queued", "z")  # only queued calls held z
        assert w.withdraw("w") == stuck
        assert w.withdraw("nobody") == 0
        release.set()
        w.drain()
        assert w.withdraw("x") == 0
    finally:
        w.close()


def test_inline_calls_run_at_once_in_the_order_given_whatever_their_lane() -> None:
    w = CodecWorker(threaded=False)
    ran: list[str] = []
    w.submit(lambda: ran.append("bulk"), keys=("a",))
    seqs = w.submit_all([CodecCall(lambda: ran.append("p1"), ("b",)), CodecCall(lambda: ran.append("p2"), ("c",))],
                        priority=True)
    assert ran == ["bulk", "p1", "p2"] and all(w.done(s) for s in seqs) and w.withdraw("a") == 0
    w.close()


def test_a_hand_over_given_without_waiting_is_parked_behind_a_full_lane_and_keeps_every_streams_order() -> None:
    """The bulk lane is full (one call running, one queued): ``submit_all(wait=False)`` returns at once, its calls
    parked (numbered, not done, withdrawable); a priority call still goes in at once; parked calls join the lane as it
    frees, oldest first, and a stream's calls run in the order given; a ``call`` runs after every parked one."""
    waits: list[float] = []
    w = CodecWorker(threaded=True, max_pending=2, on_wait=waits.append, name="test-codec-park")
    w.start()
    ran: list[str] = []
    withdrawn: list[object] = []
    try:
        _, release, _ = _held(w, keys=("a",))
        w.submit(lambda: ran.append("a1"), keys=("a",))
        assert w.handovers(False) == 2 and w.has_room(False) is False
        parked = w.submit_all([CodecCall(lambda: ran.append("a2"), ("a",)),
                               CodecCall(lambda: ran.append("b1"), ("b", "x"), withdrawn.append)], wait=False)
        later = w.submit_all([CodecCall(lambda: ran.append("a3"), ("a",))], wait=False)
        assert w.parked(False) == 2 and w.handovers(False) == 2 and not waits  # nobody waited for room
        assert not any(w.done(s) for s in [*parked, *later]) and w.pending == 5
        assert w.withdraw("x") == 0 and withdrawn == ["x"]  # a parked call gives a stream up like a queued one
        w.submit(lambda: ran.append("first chunk c"), priority=True, keys=("c",))
        result: list[str] = []
        caller = threading.Thread(target=lambda: result.append(w.call(lambda: ",".join(ran))))
        caller.start()
        release.set()
        caller.join(10.0)
        w.drain()
        assert ran == ["first chunk c", "a1", "a2", "b1", "a3"]
        assert result == ["first chunk c,a1,a2,b1,a3"]  # the call came after every parked hand-over
        assert w.parked(False) == 0 and w.pending == 0 and all(w.done(s) for s in [*parked, *later])
    finally:
        w.close()
