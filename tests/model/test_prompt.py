"""Prompt rows beyond the golden cases: layout details and input validation."""

from __future__ import annotations

import numpy as np
import pytest

from moss_rt.model.prompt import KeptTokens, build_prompt_rows, encode_text


def test_layout_of_rows(tiny):
    cfg, tok = tiny.config, tiny.tokenizer
    ref = np.arange(36).reshape(3, 12)
    cont = np.arange(24).reshape(2, 12) + 100
    rows = build_prompt_rows(tok, cfg, text="Hi", reference_codes=ref, continuation_codes=cont, tokens=40)
    assert rows.dtype == np.int64 and rows.shape[1] == 13
    text_rows = rows[:, 0] >= 0
    assert text_rows.all()
    # reference: audio_start, 3 user-slot rows with the codes, audio_end
    start = int(np.flatnonzero(rows[:, 0] == cfg.audio_start_token_id)[0])
    assert (rows[start + 1 : start + 4, 0] == cfg.audio_user_slot_token_id).all()
    np.testing.assert_array_equal(rows[start + 1 : start + 4, 1:], ref)
    assert rows[start + 4, 0] == cfg.audio_end_token_id
    # continuation rows come last, after the final audio_start row
    assert rows[-3, 0] == cfg.audio_start_token_id
    np.testing.assert_array_equal(rows[-2:, 1:], cont)
    assert (rows[-2:, 0] == cfg.audio_assistant_slot_token_id).all()
    # every other row is a text row with pad codes
    text_only = np.ones(len(rows), bool)
    text_only[start + 1 : start + 4] = False
    text_only[-2:] = False
    assert (rows[text_only, 1:] == cfg.audio_pad_token_id).all()
    # the duration hint is rendered as text
    assert encode_text(tok, "40")[0] in rows[:, 0]


def test_pieces_are_tokenised_separately(tiny):
    """Merges never cross piece boundaries: the text tokens are exactly encode(text) alone."""
    cfg, tok = tiny.config, tiny.tokenizer
    text = "the night"
    rows = build_prompt_rows(tok, cfg, text=text)
    ids = encode_text(tok, text)
    seq = rows[:, 0].tolist()
    assert any(seq[i : i + len(ids)] == ids for i in range(len(seq)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reference_codes": np.zeros((3, 11), np.int64)}, r"reference_codes must be \[T,12\]"),
        ({"reference_codes": np.full((3, 12), 1024)}, "must be in"),
        ({"continuation_codes": np.full((2, 12), -1)}, "continuation_codes codes must be in"),
    ],
)
def test_bad_codes_are_rejected(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_prompt_rows(tiny.tokenizer, tiny.config, text="x", **kwargs)


def test_kept_tokens_give_the_tokenizers_rows_and_remember_the_last_pieces(tiny):
    """A prompt built through KeptTokens is the tokenizer's own, piece for piece; it remembers what it encoded (a
    retake's line), at most ``max_tokens`` ids in all, the least recently used pieces out first."""
    cfg, tok = tiny.config, tiny.tokenizer
    kept = KeptTokens(tok)
    for instruction in ("Calm.", "Angry, then calm."):
        rows = build_prompt_rows(kept, cfg, text="The same line.", instruction=instruction, tokens=12)
        np.testing.assert_array_equal(
            rows, build_prompt_rows(tok, cfg, text="The same line.", instruction=instruction, tokens=12)
        )
    pieces = ("one", "two", "three", "four")
    sizes = {p: len(encode_text(tok, p)) for p in pieces}
    kept = KeptTokens(tok, max_tokens=sizes["one"] + sizes["two"] + sizes["three"])
    assert list(kept.encode("one")) == encode_text(tok, "one") and kept.knows("one")
    kept.encode("two")
    kept.encode("three")
    kept.encode("one")  # used again: "two" is now the oldest
    kept.encode("four")
    assert [kept.knows(p) for p in pieces] == [True, False, sizes["four"] <= sizes["two"], True]
    assert not kept.knows("x" * 200) and len(kept.encode("x" * 200)) > 0 and not kept.knows("x" * 200)  # too long
