"""Prompt rows [T, 1+n_vq] exactly as the upstream v1.5 processor builds them.

Each text piece is tokenised on its own (no special tokens added), so BPE merges never
cross piece boundaries; special ids are inserted directly. Text rows carry the audio
pad code in every codebook channel; reference audio rows carry the user slot id,
continuation (prompt audio) rows the assistant slot id.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from moss_rt.model.config import MossTTSConfig

USER_ROLE = "user\n"
REFERENCE_HEADER = "<user_inst>\n- Reference(s):\n"
NO_REFERENCE = "None"
USER_SUFFIX = "\n</user_inst>"
TURN_BREAK = "\n"
ASSISTANT_ROLE = "assistant\n"


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of one piece without special tokens (tokenizers.Tokenizer or a transformers tokenizer)."""
    encoded = tokenizer.encode(text, add_special_tokens=False)
    ids = getattr(encoded, "ids", encoded)
    return [int(i) for i in ids]


# Token ids a KeptTokens remembers, in all: the pieces of the last prompts (a line's text, its direction blocks, the
# fixed pieces). A director's retakes of one line with new instructions keep its text, whose tokenization is most of a
# prompt's. 2^18 ids: ~9 MB at most, a thousand lines of a few hundred tokens.
TOKENS_KEPT = 1 << 18


class KeptTokens:
    """A tokenizer that remembers the ids of the pieces it encoded last, up to TOKENS_KEPT ids in all (least recently
    used out first).

    Why: a retake with a new instruction rebuilds its prompt, and on a busy server a helper thread's tokenization of
    the line waits for the interpreter lock behind the engine's and the codec's threads (11-18 ms at p50 for 16
    directors retaking together on an H200). With the line's pieces remembered, the prompt of a retake costs a short
    instruction's tokenization and is built on the spot (engine/prompts.cheap_to_build). Thread-safe."""

    def __init__(self, tokenizer: Any, max_tokens: int = TOKENS_KEPT) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._held = 0  # ids held in all
        self._lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = False) -> tuple[int, ...]:
        """The ids of ``text`` (never with special tokens: every prompt piece is encoded without)."""
        assert not add_special_tokens, "prompt pieces are encoded without special tokens"
        with self._lock:
            ids = self._ids.get(text)
            if ids is not None:
                self._ids.move_to_end(text)
                return ids
        ids = tuple(encode_text(self.tokenizer, text))  # outside the lock: tokenizing takes the time
        if len(ids) > self.max_tokens:
            return ids  # never kept: it would push everything else out
        with self._lock:
            if text not in self._ids:  # another thread may have kept it meanwhile
                self._ids[text] = ids
                self._held += len(ids)
            while self._held > self.max_tokens:
                _, dropped = self._ids.popitem(last=False)
                self._held -= len(dropped)
        return ids

    def knows(self, text: str) -> bool:
        with self._lock:
            return text in self._ids


def load_tokenizer(folder: str | Path) -> Any:
    """The checkpoint folder's tokenizer.json through the ``tokenizers`` library."""
    from tokenizers import Tokenizer

    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {folder}")
    return Tokenizer.from_file(str(path))


def _field(value: object) -> str:
    """Upstream renders a missing or blank field as the literal 'None'."""
    if value is None:
        return "None"
    text = str(value).strip()
    return text or "None"


def render_fields(
    *,
    instruction: str | None = None,
    tokens: int | None = None,
    quality: str | None = None,
    sound_event: str | None = None,
    ambient_sound: str | None = None,
    language: str | None = None,
) -> str:
    """The block between the reference(s) and the target text."""
    return (
        "\n- Instruction:\n"
        + _field(instruction)
        + "\n- Tokens:\n"
        + _field(tokens)
        + "\n- Quality:\n"
        + _field(quality)
        + "\n- Sound Event:\n"
        + _field(sound_event)
        + "\n- Ambient Sound:\n"
        + _field(ambient_sound)
        + "\n- Language:\n"
        + _field(language)
        + "\n- Text:\n"
    )


def _text_rows(ids: list[int], config: MossTTSConfig) -> np.ndarray:
    rows = np.full((len(ids), config.n_channels), config.audio_pad_token_id, dtype=np.int64)
    rows[:, 0] = ids
    return rows


def _audio_rows(codes: np.ndarray, slot_id: int, config: MossTTSConfig, what: str) -> np.ndarray:
    codes = np.asarray(codes)
    if codes.ndim != 2 or codes.shape[1] != config.n_vq:
        raise ValueError(f"{what} must be [T,{config.n_vq}] codes, got shape {codes.shape}")
    if codes.size and (codes.min() < 0 or codes.max() >= config.audio_vocab_size):
        raise ValueError(f"{what} codes must be in [0,{config.audio_vocab_size})")
    rows = np.empty((codes.shape[0], config.n_channels), dtype=np.int64)
    rows[:, 0] = slot_id
    rows[:, 1:] = codes
    return rows


def build_prompt_rows(
    tokenizer: Any,
    config: MossTTSConfig,
    *,
    text: str,
    instruction: str = "",
    language: str = "",
    tokens: int | None = None,
    reference_codes: np.ndarray | list[np.ndarray] | None = None,
    continuation_codes: np.ndarray | None = None,
    quality: str | None = None,
    sound_event: str | None = None,
    ambient_sound: str | None = None,
) -> np.ndarray:
    """Rows for one generation request.

    ``reference_codes`` (one [T,n_vq] array or a list) = voice clone references inside the
    user turn. ``continuation_codes`` = prompt audio the model continues: placed after the
    final audio-start row as assistant rows (upstream "continuation" mode; its text should
    be the prompt transcript followed by the new text). Generation starts after the last row.
    """

    def enc(piece: str) -> list[int]:
        return encode_text(tokenizer, piece)

    parts: list[np.ndarray] = [_text_rows([config.im_start_token_id] + enc(USER_ROLE) + enc(REFERENCE_HEADER), config)]
    references = (
        reference_codes if isinstance(reference_codes, list) else ([] if reference_codes is None else [reference_codes])
    )
    if references:
        for ref in references:
            parts.append(_text_rows([config.audio_start_token_id], config))
            parts.append(_audio_rows(ref, config.audio_user_slot_token_id, config, "reference_codes"))
            parts.append(_text_rows([config.audio_end_token_id], config))
    else:
        parts.append(_text_rows(enc(NO_REFERENCE), config))
    fields = render_fields(
        instruction=instruction,
        tokens=tokens,
        quality=quality,
        sound_event=sound_event,
        ambient_sound=ambient_sound,
        language=language,
    )
    tail = (
        enc(fields)
        + enc(text or "")
        + enc(USER_SUFFIX)
        + [config.im_end_token_id]
        + enc(TURN_BREAK)
        + [config.im_start_token_id]
        + enc(ASSISTANT_ROLE)
        + [config.audio_start_token_id]
    )
    parts.append(_text_rows(tail, config))
    if continuation_codes is not None:
        parts.append(
            _audio_rows(continuation_codes, config.audio_assistant_slot_token_id, config, "continuation_codes")
        )
    return np.concatenate(parts, axis=0)
