"""Batch work (a script render's lines) stands aside while a director waits for a take's first frame, within a share
of the wall time (engine/batch_yield)."""

from __future__ import annotations

from pathlib import Path

from moss_rt.engine.base import EndReason, TakePriority
from moss_rt.engine.batch_yield import BatchYield
from tests.engine.harness import Rounds, assert_heard_whole, engine_settings, loaded_engine, spec

TEXT = "The rain had stopped an hour ago, and the street was quiet."


def test_batch_work_stands_aside_for_a_burst_then_in_at_most_its_share_of_the_rounds() -> None:
    batch_yield = BatchYield(share=0.5, burst=8)
    assert not batch_yield.decide(False)  # nobody waits: batch work steps
    aside = [batch_yield.decide(True) for _ in range(2000)]  # a director waiting at every round
    assert all(aside[:15]) and not aside[15]  # the burst: 8 rounds of credit, spent at a net half a round each
    assert 0.5 * 2000 <= sum(aside) <= 0.5 * 2000 + 8  # its share of the rounds, and not less
    assert aside[-4:] in ([True, False, True, False], [False, True, False, True])  # in turns: slowed, never stopped


def test_credit_comes_back_while_nobody_waits_up_to_the_burst() -> None:
    batch_yield = BatchYield(share=0.5, burst=8)
    for _ in range(100):
        batch_yield.decide(True)
    for _ in range(100):  # no director for a while (the credit is capped at the burst)
        assert not batch_yield.decide(False)
    streak = 0
    while batch_yield.decide(True):
        streak += 1
    assert streak == 15  # the whole burst again, and no more


def test_the_share_is_the_servers_setting(tiny_data_dir: Path) -> None:
    """--batch-yield-share reaches the scheduler: at 0.75 a director waiting every round keeps batch work aside in
    three rounds of four."""
    with loaded_engine(engine_settings(tiny_data_dir, overlap=False, batch_yield_share=0.75)) as engine:
        batch_yield = engine._scheduler._batch_yield
        aside = [batch_yield.decide(True) for _ in range(400)]
        assert 0.75 * 400 <= sum(aside) <= 0.75 * 400 + 8


def test_script_lines_make_no_frame_between_a_directors_arrival_and_its_first_frame(tiny_data_dir: Path) -> None:
    """Two script lines stream; a director's take arrives: until its first frame the lines make none (its prefill
    pass and first step run with no batch step before them), then they go on, and every take's audio is whole."""
    with loaded_engine(engine_settings(tiny_data_dir, overlap=True, max_seq_len=512)) as engine:
        rounds = Rounds(engine)
        lines = rounds.add(*[spec(f"b{i}", 10 + i, 40, 4, text=f"{TEXT} Line {i}.", priority=TakePriority.BATCH)
                             for i in range(2)])
        rounds.until(lambda: all(t.frames >= 10 for t in lines))
        before = [t.frames for t in lines]
        (d,) = rounds.add(spec("d", 2, 12, 2, text=f"{TEXT} A director cuts in."))
        rounds.until(lambda: d.first_frame_at is not None)
        assert [t.frames for t in lines] == before  # the lines stood aside
        rounds.until(lambda: all(t.frames > f for t, f in zip(lines, before, strict=True)))  # then they go on
        rounds.until(lambda: all(t.channel.finished for t in (*lines, d)))
        assert_heard_whole(engine, [*lines, d])
        assert all(t.channel.end.reason is EndReason.MAX_FRAMES for t in (*lines, d))  # type: ignore[attr-defined]
