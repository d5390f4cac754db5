"""MossEngine.submit around its prompt check (which runs on a helper thread, outside the event loop)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from moss_rt.config import Settings
from moss_rt.engine import moss as moss_module
from moss_rt.engine.base import EndReason, EngineBusy, TakeFinished, TakeSpec
from moss_rt.engine.moss import MossEngine
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
