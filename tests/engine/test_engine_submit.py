"""MossEngine.submit around its prompt check (which runs on a helper thread, outside the event loop)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest

from moss_rt.config import Settings
from moss_rt.engine import moss as moss_module
from moss_rt.engine import prompts
from moss_rt.engine.base import EndReason, EngineBusy, TakeFinished, TakeSpec
from moss_rt.engine.moss import MossEngine
from moss_rt.model.prompt import build_prompt_rows
from tests.engine.harness import GREEDY_STOP
from tests.helpers import run


def _settings(data_dir: Path, *, max_slots: int, max_queue: int) -> Settings:
    return Settings(engine="moss", model="tiny", codec="tiny", device="cpu", data_dir=data_dir,
                    max_slots=max_slots, max_queue=max_queue, max_seq_len=256)


def test_a_take_submitted_while_the_engine_closes_is_refused(
    tiny_data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() may run while submit awaits its prompt check; the take must then be refused as busy, not
    queued into an inbox that the stopped worker never reads again (its client would wait forever)."""
    checking, release = threading.Event(), threading.Event()
    real_prompt_rows = moss_module.prompt_rows

    def held(runner, spec):  # noqa: ANN001, ANN202 - stands in for prompts.prompt_rows
        checking.set()
        release.wait(30)
        return real_prompt_rows(runner, spec)

    monkeypatch.setattr(moss_module, "prompt_rows", held)

    async def scenario() -> None:
        engine = MossEngine(_settings(tiny_data_dir, max_slots=2, max_queue=2))
        await engine.start()
        submit = asyncio.create_task(engine.submit(TakeSpec("late", text="Hi.", seed=1)))
        try:
            assert await asyncio.to_thread(checking.wait, 30)
            await engine.close()
        finally:
            release.set()
        with pytest.raises(EngineBusy):
            await submit

    run(scenario())


def test_a_barge_in_is_not_refused_for_the_take_it_replaces(tiny_data_dir: Path) -> None:
    """Slots and queue full: a new take is refused as busy, but a take cutting in on a socket's streaming take (a
    barge-in, submitted while that take stops: web/ws early admission) is taken, as it was when it waited for the
    replaced take's end first."""

    async def scenario() -> None:
        engine = MossEngine(_settings(tiny_data_dir, max_slots=1, max_queue=0))
        await engine.start()
        try:
            running = await engine.submit(TakeSpec("running", text="Hi there.", seed=1, max_frames=200,
                                                   sampling=GREEDY_STOP))
            with pytest.raises(EngineBusy):
                await engine.submit(TakeSpec("new", text="Hello.", seed=2))
            cut_in = await engine.submit(TakeSpec("cut-in", text="Hello.", seed=3, barge_in=True, max_frames=4,
                                                  sampling=GREEDY_STOP))
            running.cancel()
            ends = [event async for event in cut_in if isinstance(event, TakeFinished)]
            assert [e.reason for e in ends] == [EndReason.MAX_FRAMES]
        finally:
            await engine.close()

    run(scenario())


def test_a_retake_with_a_new_direction_builds_its_prompt_on_the_spot(
    tiny_data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line's first take tokenizes it on a helper thread; a later take of the same line with another instruction
    builds its rows where it is submitted (the line's tokens are remembered: no turn of a thread to wait for on a busy
    server), and they are the rows a fresh build gives. A long direction still goes to the helper thread."""
    built_on: list[tuple[str, bool]] = []  # (instruction, built on the event loop's thread)
    real_prompt_rows = moss_module.prompt_rows

    def recording(runner, spec):  # noqa: ANN001, ANN202 - stands in for prompts.prompt_rows
        built_on.append((spec.instruction, threading.current_thread() is loop_thread))
        return real_prompt_rows(runner, spec)

    monkeypatch.setattr(moss_module, "prompt_rows", recording)
    loop_thread = threading.current_thread()
    line = "A line the director takes again, and again."

    async def take(engine: MossEngine, take_id: str, instruction: str) -> None:
        channel = await engine.submit(TakeSpec(take_id, text=line, instruction=instruction, seed=1, max_frames=2,
                                               sampling=GREEDY_STOP))
        ends = [event async for event in channel if isinstance(event, TakeFinished)]
        assert [e.reason for e in ends] == [EndReason.MAX_FRAMES]

    async def scenario() -> None:
        engine = MossEngine(_settings(tiny_data_dir, max_slots=2, max_queue=2))
        await engine.start()
        try:
            await take(engine, "first", "Calm.")
            await take(engine, "retake", "Whisper, then shout.")
            monkeypatch.setattr(prompts, "CHEAP_PIECE_CHARS", 20)
            await take(engine, "long", "Slowly, then faster, and far away.")
            runner = engine._runner
            assert runner is not None
            # The remembered tokens give the rows the tokenizer itself gives.
            rows = runner.build_prompt(text=line, instruction="Whisper, then shout.")
            plain = build_prompt_rows(runner.tokenizer, runner.config, text=line, instruction="Whisper, then shout.")
            assert np.array_equal(rows, plain)
        finally:
            await engine.close()

    run(scenario())
    assert built_on == [("Calm.", False), ("Whisper, then shout.", True), ("Slowly, then faster, and far away.", False)]
