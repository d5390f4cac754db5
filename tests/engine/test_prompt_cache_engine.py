"""The prompt cache in the real engine (tiny model, CPU), driven round by round (tests/engine/harness.py): takes
whose prompts open alike share kept blocks instead of prefilling them, a burst computes a shared prompt once,
kept blocks make room when takes need it, and a take that was computing rows for others may fail without
stranding them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moss_rt.engine.prompts import prompt_rows
from moss_rt.engine.scheduler import Scheduler
from moss_rt.model.runner import ModelRunner
from tests.engine.harness import Driven, drive, engine_settings, loaded_engine, spec

LINE = "The rain had stopped an hour ago, and the street was quiet."


def _rows(engine: Any, source: str) -> float:
    return engine.metrics.registry.get_sample_value("moss_rt_prompt_rows_total", {"source": source}) or 0.0


def _prompt_len(engine: Any, text: str) -> int:
    return len(prompt_rows(engine._runner, spec("x", 0, 1, 1, text=text)))


def _codes(driven: Driven) -> dict[str, np.ndarray]:
    for take_id, ch in driven.channels.items():
        assert not ch.problems, (take_id, ch.problems)
    return {take_id: ch.codes for take_id, ch in driven.channels.items()}


def _burst(data_dir: Path, *, cache: bool) -> tuple[dict[str, np.ndarray], float, float, int]:
    with loaded_engine(engine_settings(data_dir, overlap=False, prompt_cache=cache)) as engine:
        driven = drive(engine, [spec(f"t{i}", 10 + i, 12, 4, text=LINE) for i in range(5)])
        for ch in driven.channels.values():
            assert ch.end.n_frames == 12
        return _codes(driven), _rows(engine, "prefill"), _rows(engine, "cache"), _prompt_len(engine, LINE)


def test_a_burst_of_one_prompt_computes_it_once_with_the_same_codes(tiny_data_dir: Path) -> None:
    """Five takes of one line arriving together: the first computes the prompt while the others wait, then they
    share its blocks, the partial last one too. Their codes equal those of a run without the cache, bit for bit
    (the CPU prefills each take alone, so the shared blocks hold exactly what each would have computed)."""
    cached, computed, shared, n = _burst(tiny_data_dir, cache=True)
    plain, plain_computed, plain_shared, _ = _burst(tiny_data_dir, cache=False)
    assert n % 16, "the prompt ends inside a block: the partial block is shared too"
    assert (computed, shared) == (n, 4 * n)
    assert (plain_computed, plain_shared) == (5 * n, 0)
    for take_id in plain:
        np.testing.assert_array_equal(cached[take_id], plain[take_id], err_msg=take_id)


def test_a_later_take_of_the_same_voice_prefills_only_its_own_text(tiny_data_dir: Path) -> None:
    direction = {"instruction": "Warm, unhurried, a little amused.", "language": "en"}
    texts = [LINE, "Nobody answered the door, so she knocked again."]
    with loaded_engine(engine_settings(tiny_data_dir, overlap=False)) as engine:
        runner: ModelRunner = engine._runner  # type: ignore[assignment]
        sched: Scheduler = engine._scheduler  # type: ignore[assignment]
        rows = [prompt_rows(runner, spec("x", 0, 1, 1, text=t, **direction)) for t in texts]
        keys = [sched.prompts.keys(r) for r in rows]
        assert keys[0] is not None and keys[1] is not None
        common = keys[0].common_blocks(keys[1]) * runner.blocks.block_size
        assert common >= 32, "the user turn and the direction come before the text"

        first = drive(engine, [spec("first", 1, 10, 5, text=texts[0], **direction)])
        assert (_rows(engine, "prefill"), _rows(engine, "cache")) == (len(rows[0]), 0)
        second = drive(engine, [spec("second", 2, 10, 5, text=texts[1], **direction)])
        assert _rows(engine, "cache") == common
        assert _rows(engine, "prefill") == len(rows[0]) + len(rows[1]) - common
        assert first.channels["first"].end.n_frames == second.channels["second"].end.n_frames == 10
        # Once both ended, their kept blocks are the cache's alone, and counted by its gauge.
        assert engine.metrics.registry.get_sample_value("moss_rt_prompt_cache_blocks") == len(sched.prompts) > 0


def test_kept_blocks_make_room_for_takes_that_need_it(tiny_data_dir: Path) -> None:
    """A small pool (2 slots of 256 positions): one prompt after another, each different, keeps filling the cache;
    every take still starts and runs to its end, the cache giving its least recently used blocks back."""
    with loaded_engine(engine_settings(tiny_data_dir, overlap=False, max_slots=2)) as engine:
        runner: ModelRunner = engine._runner  # type: ignore[assignment]
        sched: Scheduler = engine._scheduler  # type: ignore[assignment]
        total = runner.blocks.num_blocks - 1
        first = sched.prompts.keys(prompt_rows(runner, spec("x", 0, 1, 1, text=f"Take 0: {LINE}")))
        kept_most = 0
        for i in range(8):
            driven = drive(engine, [spec(f"t{i}a", i, 60, 8, text=f"Take {i}: {LINE}"),
                                    spec(f"t{i}b", 50 + i, 60, 8, text=f"Another line, number {i}.")])
            assert [ch.end.n_frames for ch in driven.channels.values()] == [60, 60]
            kept_most = max(kept_most, len(sched.prompts))
            if i == 0:
                assert sched.prompts.match(first).length == first.length  # type: ignore[union-attr]
        assert kept_most > total // 3  # the cache filled a good part of the pool
        assert _rows(engine, "cache") > 0  # the takes' common opening (the user turn) was shared
        # The first take's own blocks, the least recently used, were given back for later takes.
        assert sched.prompts.match(first).length < first.length  # type: ignore[union-attr]
        assert runner.blocks.promised == 0


def test_takes_waiting_for_a_failed_take_compute_the_rows_themselves(tiny_data_dir: Path) -> None:
    """The take computing a burst's shared prompt fails in its prefill: it ends with an error, and the takes that
    waited for its blocks go on (one computes them, the others share them) and run to their end."""
    with loaded_engine(engine_settings(tiny_data_dir, overlap=False)) as engine:
        runner: ModelRunner = engine._runner  # type: ignore[assignment]
        real = runner.prefill_batch
        failed: list[int] = []

        def first_pass_fails(requests):  # noqa: ANN001, ANN202 - stands in for ModelRunner.prefill_batch
            if not failed:
                failed.append(requests[0].slot)
                raise RuntimeError("device fault, say")
            return real(requests)

        runner.prefill_batch = first_pass_fails  # type: ignore[method-assign]
        driven = drive(engine, [spec(f"t{i}", i, 8, 4, text=LINE) for i in range(3)])
        ends = {take_id: ch.end for take_id, ch in driven.channels.items()}
        assert ends["t0"].reason.value == "error" and "device fault" in (ends["t0"].error or "")
        assert [ends[t].n_frames for t in ("t1", "t2")] == [8, 8]
        n = _prompt_len(engine, LINE)
        assert (_rows(engine, "prefill"), _rows(engine, "cache")) == (n, n)
