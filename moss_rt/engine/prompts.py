"""Prompt rows for a take, and the check that they fit the slot's KV cache.

The engine builds the rows on a helper thread at submit time, so a prompt that can never fit is
refused as bad input (``invalid_field``) before it queues, instead of failing later as a generation
error; the worker thread reuses them.
"""

from __future__ import annotations

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


def prompt_rows(runner: PromptBuilder, spec: TakeSpec) -> np.ndarray:
    """The take's prompt rows [T, 13] (thread-safe: tokenization only, no tensors)."""
    return runner.build_prompt(
        text=spec.text,
        instruction=spec.instruction,
        language=spec.language,
        tokens=spec.tokens,
        reference_codes=spec.reference_codes,
    )


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
