"""A session's take history, sans-I/O: ids and seeds, seek and replay bookkeeping, bounded history."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from moss_rt.protocol import ProtocolError, Seek, StartTake
from moss_rt.session import RecentTakes, TakeHistory


def make_session(max_takes_kept: int = 4, store: RecentTakes | None = None, prefix: str = "t") -> TakeHistory:
    ids = (f"{prefix}{i}" for i in itertools.count())
    seeds = itertools.count(1000)
    return TakeHistory(
        store if store is not None else RecentTakes(),
        max_takes_kept=max_takes_kept,
        id_factory=lambda: next(ids),
        seed_factory=lambda: next(seeds),
    )


def codes(first: int, n: int) -> np.ndarray:
    return np.arange(first * 12, (first + n) * 12, dtype=np.int64).reshape(n, 12) % 1024


def finish(session: TakeHistory, take, n: int) -> None:  # noqa: ANN001
    session.record_chunk(take, take.n_frames, codes(take.n_frames, n))
    session.record_end(take, "done", {"gpu_total_ms": 1.0})


def test_start_assigns_id_and_seed_and_becomes_the_running_take() -> None:
    s = make_session()
    first = s.plan_start(StartTake(text="a", seed=5))
    assert first.take.take_id == "t0" and first.take.seed == 5 and s.running is first.take
    second = s.plan_start(StartTake(text="b"))
    assert second.take.seed == 1000 and s.running is second.take


def test_chunks_must_arrive_in_order() -> None:
    s = make_session()
    take = s.plan_start(StartTake(text="a")).take
    s.record_chunk(take, 0, codes(0, 3))
    with pytest.raises(ValueError):
        s.record_chunk(take, 5, codes(5, 1))
    s.record_chunk(take, 3, codes(3, 2))
    assert take.n_frames == 5 and np.array_equal(take.codes, codes(0, 5))


def test_retake_branches_with_prefix_overrides_and_new_seed() -> None:
    s = make_session()
    parent = s.plan_start(StartTake(text="line", instruction="calm", seed=1)).take
    finish(s, parent, 20)
    plan = s.plan_seek(Seek(take="t0", frame=8, instruction="angry", sampling={"audio_top_k": 5}))
    new = plan.take
    ack = {"type": "seek", "take": "t1", "from_take": "t0", "frame": 8, "sample": 8 * 3840}
    assert plan.mode == "retake" and plan.ack().to_dict() == ack
    assert new.parent == "t0" and new.branch_frame == 8 and new.n_frames == 8
    assert np.array_equal(new.codes, parent.codes[:8]) and np.array_equal(plan.prefix_codes, parent.codes[:8])
    assert new.request.instruction == "angry" and new.request.text == "line"
    assert new.request.sampling.audio_top_k == 5
    assert new.request.sampling.audio_top_p == parent.request.sampling.audio_top_p
    assert new.seed == 1000 and s.running is new
    # The parent is untouched.
    assert parent.n_frames == 20 and parent.request.instruction == "calm"


def test_retake_with_explicit_seed_and_from_zero() -> None:
    s = make_session()
    parent = s.plan_start(StartTake(text="line")).take
    finish(s, parent, 5)
    plan = s.plan_seek(Seek(take="t0", frame=0, seed=77))
    assert plan.take.seed == 77 and plan.take.n_frames == 0 and plan.prefix_codes.shape == (0, 12)


def test_replay_returns_source_and_refuses_running_take() -> None:
    s = make_session()
    take = s.plan_start(StartTake(text="x")).take
    s.record_chunk(take, 0, codes(0, 4))
    with pytest.raises(ProtocolError) as info:
        s.plan_seek(Seek(take="t0", frame=1, mode="replay"))
    assert info.value.code == "invalid_field"
    s.record_end(take, "done", {})
    plan = s.plan_seek(Seek(take="t0", frame=2, mode="replay"))
    assert plan.take is take and plan.source is take and plan.sample == 2 * 3840 and s.running is None


def test_seek_errors() -> None:
    s = make_session()
    with pytest.raises(ProtocolError) as info:
        s.plan_seek(Seek(take="nope", frame=0))
    assert info.value.code == "not_found" and info.value.field == "take"
    take = s.plan_start(StartTake(text="x")).take
    finish(s, take, 3)
    with pytest.raises(ProtocolError) as info:
        s.plan_seek(Seek(take="t0", frame=4))
    assert info.value.code == "invalid_field" and info.value.field == "frame"


def test_history_is_bounded_and_store_follows() -> None:
    store = RecentTakes()
    s = make_session(max_takes_kept=3, store=store)
    for _ in range(5):
        take = s.plan_start(StartTake(text="x")).take
        finish(s, take, 1)
    assert [t.take_id for t in s.takes] == ["t2", "t3", "t4"]
    assert store.get("t0") is None and store.get("t4") is not None
    with pytest.raises(ProtocolError):
        s.get("t1")


def test_running_take_is_never_evicted() -> None:
    store = RecentTakes(capacity=2)
    a, b = make_session(store=store), make_session(store=store, prefix="b")
    running = a.plan_start(StartTake(text="long")).take
    for _ in range(4):
        finish(b, b.plan_start(StartTake(text="x")).take, 1)
    assert store.get(running.take_id) is running and len(store) == 2


def test_summary_describes_the_take() -> None:
    s = make_session()
    take = s.plan_start(StartTake(text="hello", take="scene-1", seed=9)).take
    finish(s, take, 2)
    summary = take.summary()
    assert summary["label"] == "scene-1" and summary["seed"] == 9 and summary["n_frames"] == 2
    assert summary["status"] == "ended" and summary["reason"] == "done" and summary["gpu_total_ms"] == 1.0
    assert summary["request"]["text"] == "hello"
