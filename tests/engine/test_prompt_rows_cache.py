"""Prompt rows built once per prompt: a retake with a new seed or sampling is not tokenized again
(engine/prompts.PromptRowsCache)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from moss_rt.engine import moss
from moss_rt.engine.base import TakeSpec
from moss_rt.engine.prompts import PromptRowsCache, prompt_key
from tests.engine.harness import engine_settings, loaded_engine

TEXT = "The rain had stopped an hour ago, and the street was quiet."


def test_the_key_is_what_the_rows_depend_on() -> None:
    ref = np.arange(24, dtype=np.int64).reshape(2, 12)
    base = prompt_key(TakeSpec("a", text=TEXT, instruction="softly", reference_codes=ref))
    assert prompt_key(TakeSpec("b", text=TEXT, instruction="softly", seed=9, reference_codes=ref.copy())) == base
    for other in (TakeSpec("c", text=TEXT, instruction="loudly", reference_codes=ref),
                  TakeSpec("d", text=TEXT + "!", instruction="softly", reference_codes=ref),
                  TakeSpec("e", text=TEXT, instruction="softly", language="de", reference_codes=ref),
                  TakeSpec("f", text=TEXT, instruction="softly", tokens=120, reference_codes=ref),
                  TakeSpec("g", text=TEXT, instruction="softly", reference_codes=ref[:, ::-1]),
                  TakeSpec("h", text=TEXT, instruction="softly")):
        assert prompt_key(other) != base, other.take_id


def test_rows_are_kept_read_only_and_the_least_recently_used_go_first() -> None:
    cache = PromptRowsCache(size=2)
    rows = [np.full((3, 13), i, dtype=np.int64) for i in range(3)]
    cache.put("a", rows[0])
    cache.put("b", rows[1])
    assert cache.get("a") is rows[0]  # "a" used: "b" is now the oldest
    cache.put("c", rows[2])
    assert cache.get("b") is None and cache.get("a") is rows[0] and cache.get("c") is rows[2]
    with pytest.raises(ValueError):
        rows[0][0, 0] = 7  # shared by takes: nothing may write into a prompt


def test_a_retake_with_a_new_seed_is_not_tokenized_again(tiny_data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    real = moss.prompt_rows

    def counted(runner: object, spec: TakeSpec) -> np.ndarray:
        built.append(spec.take_id)
        return real(runner, spec)  # type: ignore[arg-type]

    monkeypatch.setattr(moss, "prompt_rows", counted)
    with loaded_engine(engine_settings(tiny_data_dir, overlap=False)) as engine:
        first = asyncio.run(engine._checked_prompt(TakeSpec("a", text=TEXT, instruction="softly", seed=1)))
        again = asyncio.run(engine._checked_prompt(TakeSpec("a.2", text=TEXT, instruction="softly", seed=2)))
        other = asyncio.run(engine._checked_prompt(TakeSpec("a.3", text=TEXT, instruction="loudly", seed=2)))
    assert built == ["a", "a.3"]  # the seed-only retake reused the rows; a new instruction is built
    assert again is first  # the very rows: read-only, shared
    assert other.shape != first.shape or not np.array_equal(other, first)
