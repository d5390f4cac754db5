"""Batched prefill in the real engine (tiny model, CPU fp32): takes that are ready together share one pass."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import numpy as np
import pytest

from moss_rt.client import DirectingClient
from moss_rt.engine import arrivals
from moss_rt.engine import moss as engine_module
from tests.engine.helpers import LONG, metrics, take_codes
from tests.helpers import RunningServer, run, wait_until

FIRST = "The first line, said alone."


def _hold_first_step(srv: RunningServer) -> tuple[threading.Event, threading.Event]:
    """Make the worker wait inside its first model step until released (takes queue up meanwhile)."""
    runner = srv.engine._runner
    real_step = runner.step
    stepping, release = threading.Event(), threading.Event()

    def held(slots: list[int]):  # noqa: ANN202 - stands in for ModelRunner.step
        if not release.is_set():
            stepping.set()
            release.wait(60)
        return real_step(slots)

    runner.step = held
    return stepping, release


async def _speak(srv: RunningServer, text: str, seed: int) -> tuple[str, dict[str, object]]:
    async with DirectingClient.connect(srv.ws_url) as client:
        take = await client.speak(text, seed=seed, max_new_tokens=6, chunk_frames=2, **LONG)
        return str(take.take_id), take.end


async def _first_then_queued(srv: RunningServer, texts: list[str], seed: Callable[[int], int]) -> list:
    """One take alone; while its first step is held, ``texts`` queue up; then everything runs to the end."""
    stepping, release = _hold_first_step(srv)
    first = asyncio.create_task(_speak(srv, FIRST, 7))
    assert await asyncio.to_thread(stepping.wait, 60)
    others = [asyncio.create_task(_speak(srv, text, seed(i))) for i, text in enumerate(texts)]
    try:
        await wait_until(lambda: srv.engine.queued_count == len(texts), 30.0)
    finally:
        release.set()
    results = await asyncio.gather(first, *others)
    for _, end in results:
        assert end["reason"] == "max_frames" and end["n_frames"] == 6, end
    return results


def test_takes_waiting_together_are_prefilled_in_one_batched_pass(moss_server) -> None:
    """Four takes queued behind a running one are prefilled in ONE pass (visible in /metrics), and a take
    prefilled in that batch has the same codes as the same take prefilled alone. (Without the prompt cache:
    with it, the queued takes would share the first one's prompt blocks instead; see test_prompt_cache.py.)"""
    srv = moss_server(prompt_cache=False)

    async def scenario() -> None:
        texts = ["Hi.", FIRST, "A third, rather longer line of text, said slowly.", "No."]
        results = await _first_then_queued(srv, texts, lambda i: 7 if i == 1 else 20 + i)
        m = await metrics(srv)
        # The first take alone, then the four waiting ones together.
        assert m["moss_rt_prefill_batch_size_count"] == 2
        assert m["moss_rt_prefill_batch_size_sum"] == 5
        assert m['moss_rt_prefill_batch_size_bucket{le="1.0"}'] == 1
        assert m['moss_rt_prefill_batch_size_bucket{le="4.0"}'] == 2
        assert m["moss_rt_prefill_call_seconds_count"] == 2
        np.testing.assert_array_equal(take_codes(srv, results[0][0]), take_codes(srv, results[2][0]))

    run(scenario())


def test_a_failing_batched_pass_falls_back_to_one_take_at_a_time(moss_server) -> None:
    srv = moss_server()
    runner = srv.engine._runner
    real_prefill_batch = runner.prefill_batch

    def no_batches(requests):  # noqa: ANN001, ANN202 - stands in for ModelRunner.prefill_batch
        if len(requests) > 1:
            raise RuntimeError("out of memory, say")
        return real_prefill_batch(requests)

    runner.prefill_batch = no_batches

    async def scenario() -> None:
        await _first_then_queued(srv, ["One.", "Two.", "Three."], lambda i: 30 + i)
        m = await metrics(srv)
        assert m["moss_rt_prefill_batch_size_count"] == 4  # all four alone: nobody failed
        assert m["moss_rt_prefill_batch_size_sum"] == 4
        assert m.get('moss_rt_takes_total{reason="error"}', 0.0) == 0

    run(scenario())


def test_passes_are_capped_by_prefill_max_rows(moss_server) -> None:
    # Each prompt here is 100-200 rows: two takes per pass (no prompt cache: most of their rows are the first's).
    srv = moss_server(prefill_max_rows=400, prompt_cache=False)
    runner = srv.engine._runner
    texts = ["One.", "Two.", "Three.", "Four."]
    assert all(100 < len(runner.build_prompt(text=t)) <= 200 for t in texts)

    async def scenario() -> None:
        await _first_then_queued(srv, texts, lambda i: 40 + i)
        m = await metrics(srv)
        assert m["moss_rt_prefill_batch_size_count"] == 3  # the first alone, then 2 + 2
        assert m["moss_rt_prefill_batch_size_sum"] == 5
        assert m['moss_rt_prefill_batch_size_bucket{le="2.0"}'] == 3

    run(scenario())


def test_a_burst_still_on_its_way_shares_one_pass_with_the_take_that_landed_first(
    moss_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle engine handed a take waits for the takes still on their way (their prompt rows being built on helper
    threads) and prefills them all in one pass: the first to land is not sent ahead alone (engine/arrivals)."""
    srv = moss_server(prompt_cache=False)
    monkeypatch.setattr(arrivals, "BURST_MAX_S", 60.0)  # only the landings end the wait here
    texts = ["Hi.", FIRST, "No."]
    gates = {text: threading.Event() for text in texts}
    real_prompt_rows = engine_module.prompt_rows

    def held(runner, spec):  # noqa: ANN001, ANN202 - stands in for prompts.prompt_rows
        assert gates[spec.text].wait(60)
        return real_prompt_rows(runner, spec)

    monkeypatch.setattr(engine_module, "prompt_rows", held)

    async def scenario() -> None:
        takes = [asyncio.create_task(_speak(srv, text, 50 + i)) for i, text in enumerate(texts)]
        await wait_until(lambda: srv.engine._submits.count == len(texts), 30.0)
        gates[texts[0]].set()
        await wait_until(lambda: srv.engine._submits.count == len(texts) - 1, 30.0)
        await asyncio.sleep(0.3)  # time enough for a pass of the first take alone, were it sent ahead
        assert (await metrics(srv)).get("moss_rt_prefill_batch_size_count", 0.0) == 0
        for gate in gates.values():
            gate.set()
        for _, end in await asyncio.gather(*takes):
            assert end["reason"] == "max_frames" and end["n_frames"] == 6, end
        m = await metrics(srv)
        assert m["moss_rt_prefill_batch_size_count"] == 1
        assert m["moss_rt_prefill_batch_size_sum"] == len(texts)

    run(scenario())
