"""Prompt rows for a take, and the check that they fit the slot's KV cache.

The engine builds the rows on a helper thread at submit time, so a prompt that can never fit is
refused as bad input (``invalid_field``) before it queues, instead of failing later as a generation
error; the worker thread reuses them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable
from typing import Protocol

import numpy as np

from moss_rt.engine.base import TakeSpec


class PromptBuilder(Protocol):
    """Builds prompt rows: the model runner, or a front end's PromptNamer (tokenizer and config, no weights)."""

    def build_prompt(
        self,
        *,
        text: str,
        instruction: str = ...,
        language: str = ...,
        tokens: int | None = ...,
        reference_codes: np.ndarray | None = ...,
    ) -> np.ndarray: ...


class PromptTooLong(ValueError):
    """The prompt plus the frames kept by a retake leave no position to generate into."""


# A prompt whose text's tokens are remembered is built on the event loop when its other pieces are at most this long:
# tokenizing a short direction block takes tens of microseconds, where a helper thread's turn costs a busy server
# milliseconds of waiting for the interpreter lock (model.prompt.KeptTokens).
CHEAP_PIECE_CHARS = 400


def cheap_to_build(runner: object, spec: TakeSpec) -> bool:
    """Whether the take's prompt rows cost little enough to build on the spot: its text's tokens are remembered (a
    retake or replay of a line built before) and its direction is short."""
    tokens_known = getattr(runner, "tokens_known", None)
    if tokens_known is None or not tokens_known(spec.text):
        return False
    return len(spec.instruction or "") + len(spec.language or "") <= CHEAP_PIECE_CHARS


def prompt_rows(runner: PromptBuilder, spec: TakeSpec) -> np.ndarray:
    """The take's prompt rows [T, 13] (thread-safe: tokenization only, no tensors)."""
    return runner.build_prompt(
        text=spec.text,
        instruction=spec.instruction,
        language=spec.language,
        tokens=spec.tokens,
        reference_codes=spec.reference_codes,
    )


# Prompts whose rows are kept for takes that repeat them: a retake with a new seed or sampling (and a replay of a
# line) has its parent's prompt, and tokenizing it again costs ~0.5-1 ms of a helper thread holding the interpreter
# lock, 64 of them in a burst of retakes, while the engine's thread admits them. 256 of ~560 rows: ~15 MB at most.
PROMPTS_KEPT = 256


def prompt_key(spec: TakeSpec) -> Hashable:
    """What the take's prompt rows depend on: its words, direction, language, length hint and voice reference (by a
    digest of its codes)."""
    ref = spec.reference_codes
    voice = None
    if ref is not None:
        codes = np.ascontiguousarray(ref, dtype=np.int64)
        voice = (codes.shape, hashlib.blake2b(codes.tobytes(), digest_size=16).digest())
    return (spec.text, spec.instruction, spec.language, spec.tokens, voice)


class PromptRowsCache:
    """The rows of the last PROMPTS_KEPT prompts built, least recently used out first. Rows handed out are read-only
    (takes share them; nothing writes a prompt in place). Used from one thread (the event loop)."""

    def __init__(self, size: int = PROMPTS_KEPT) -> None:
        self.size = size
        self._rows: OrderedDict[Hashable, np.ndarray] = OrderedDict()

    def get(self, key: Hashable) -> np.ndarray | None:
        rows = self._rows.get(key)
        if rows is not None:
            self._rows.move_to_end(key)
        return rows

    def put(self, key: Hashable, rows: np.ndarray) -> np.ndarray:
        rows.flags.writeable = False
        self._rows[key] = rows
        self._rows.move_to_end(key)
        while len(self._rows) > self.size:
            self._rows.popitem(last=False)
        return rows


def frames_room(prompt_len: int, kept_frames: int, max_seq_len: int) -> int:
    """Cache positions left after the prompt; raises :class:`PromptTooLong` when none are left
    for a new frame after the ``kept_frames`` of a retake."""
    room = max_seq_len - prompt_len
    if room <= kept_frames:
        raise PromptTooLong(
            f"the prompt needs {prompt_len} positions"
            + (f" and the retake keeps {kept_frames} frames" if kept_frames else "")
            + f", but a take's cache holds {max_seq_len} (max_seq_len); shorten the text, instruction or reference"
        )
    return room
