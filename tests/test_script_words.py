"""A script export's words (moss_rt/scripts/words.py) with a stand-in store and aligner: stored words are read, a
missing line is aligned once however many ask, an export waits only so long (then the line is left to a line cue
and its alignment goes on), and a failing alignment costs the line its words, nothing else."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from moss_rt.align.base import WordTime
from moss_rt.protocol import ErrorCode, ProtocolError
from moss_rt.scripts import words as line_words
from moss_rt.scripts.format import Cue
from moss_rt.scripts.timeline import LineAudio, Placed
from moss_rt.scripts.words import LineWords

SAID = [WordTime("Hello", 0.1, 0.4, text="Hello.")]


class Store:
    """The session store's words as the stand-in keeps them; ``gone`` takes answer not_found."""

    def __init__(self, words: dict[str, list[WordTime]], gone: tuple[str, ...] = ()) -> None:
        self.words = words
        self.gone = gone

    def get_take(self, session_id: str, take_id: str) -> Any:
        if take_id in self.gone:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no take {take_id}", field="take")
        return SimpleNamespace(take_id=take_id)


def placed(*take_ids: str) -> list[Placed]:
    return [Placed(Cue(n, "A", "Hello."), 1, n * 48000, LineAudio(t, n, 48000)) for n, t in enumerate(take_ids, 1)]


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Store:
    store = Store({"t_kept": SAID})

    def read(sessions: Store, session_id: str, take_id: str) -> list[WordTime] | None:
        if take_id in sessions.gone:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no take {take_id}", field="take")
        return sessions.words.get(take_id)

    monkeypatch.setattr(line_words, "read_stored_words", read)
    return store


def service(store: Store) -> tuple[LineWords, set[asyncio.Task[Any]]]:
    tasks: set[asyncio.Task[Any]] = set()

    def spawn(coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        tasks.add(task)
        return task

    state = SimpleNamespace(aligner=SimpleNamespace(aligner=SimpleNamespace(workers=1)))
    return LineWords(state, store, spawn), tasks  # type: ignore[arg-type]


def test_stored_words_are_read_and_missing_ones_aligned_once(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    aligned: list[str] = []

    async def align(state: Any, session_id: str, take: Any) -> list[WordTime]:
        aligned.append(take.take_id)
        await asyncio.sleep(0.01)
        store.words[take.take_id] = SAID
        return SAID

    monkeypatch.setattr(line_words, "stored_take_words", align)

    async def scenario() -> None:
        words, _ = service(store)
        lines = placed("t_kept", "t_new")
        first, second = await asyncio.gather(words.of_lines("s_x", lines), words.of_lines("s_x", lines))
        assert first == second == {1: SAID, 2: SAID}
        assert aligned == ["t_new"]  # two exports at once: one alignment, and none for the stored words

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_an_export_waits_only_so_long_and_the_alignment_goes_on(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        gate = asyncio.Event()

        async def slow(state: Any, session_id: str, take: Any) -> list[WordTime]:
            await gate.wait()
            store.words[take.take_id] = SAID
            return SAID

        monkeypatch.setattr(line_words, "stored_take_words", slow)
        monkeypatch.setattr(line_words, "EXPORT_WAIT_SEC", 0.05)
        words, tasks = service(store)
        assert await words.of_lines("s_x", placed("t_kept", "t_slow")) == {1: SAID}  # line 2: a line cue
        assert any(not t.done() for t in tasks)  # its alignment goes on
        gate.set()
        await asyncio.gather(*tasks)
        assert await words.of_lines("s_x", placed("t_kept", "t_slow")) == {1: SAID, 2: SAID}  # the next export

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_failing_alignment_costs_only_that_line_its_words(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(state: Any, session_id: str, take: Any) -> list[WordTime]:
        raise RuntimeError("aligner bug")

    monkeypatch.setattr(line_words, "stored_take_words", broken)
    store.gone = ("t_gone",)

    async def scenario() -> None:
        words, _ = service(store)
        assert await words.of_lines("s_x", placed("t_kept", "t_bad", "t_gone")) == {1: SAID}
        await words.after_render("s_x", "t_bad")  # never raises into the line's render

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_without_an_aligner_nothing_is_aligned(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    async def never(state: Any, session_id: str, take: Any) -> list[WordTime]:
        raise AssertionError("aligned without an aligner")

    monkeypatch.setattr(line_words, "stored_take_words", never)

    async def scenario() -> None:
        spawn = lambda coro, name: asyncio.create_task(coro)  # noqa: E731
        words = LineWords(SimpleNamespace(aligner=None), store, spawn)  # type: ignore[arg-type]
        assert await words.of_lines("s_x", placed("t_kept", "t_new")) == {1: SAID}
        await words.after_render("s_x", "t_new")
        words.in_background("s_x", "t_new")

    asyncio.run(asyncio.wait_for(scenario(), 10))
