"""CTC forced alignment (our Viterbi) on synthetic emissions whose best path is known."""

from __future__ import annotations

import numpy as np

from moss_rt.align.viterbi import ctc_forced_align

BLANK = 0


def emissions(path: list[int], vocab: int = 6, sure: float = -0.05, unsure: float = -6.0) -> np.ndarray:
    """Log-probabilities that make ``path`` (one token id per frame, 0 = blank) the clear best path."""
    lp = np.full((len(path), vocab), unsure, dtype=np.float32)
    lp[np.arange(len(path)), path] = sure
    return lp


def test_fixed_end_recovers_each_tokens_frames() -> None:
    path = [0, 0, 1, 1, 1, 0, 2, 2, 0, 3, 3, 3, 0, 0, 4, 4, 0]
    assert ctc_forced_align(emissions(path), [1, 2, 3, 4], BLANK) == [(2, 5), (6, 8), (9, 12), (14, 16)]


def test_repeated_token_needs_the_blank_between() -> None:
    path = [0, 2, 2, 0, 2, 0]
    assert ctc_forced_align(emissions(path), [2, 2], BLANK) == [(1, 3), (4, 5)]
    # Without a frame for the blank, two equal tokens cannot fit in two frames.
    assert ctc_forced_align(emissions([2, 2]), [2, 2], BLANK) is None


def test_adjacent_different_tokens_need_no_blank() -> None:
    assert ctc_forced_align(emissions([1, 2, 3]), [1, 2, 3], BLANK) == [(0, 1), (1, 2), (2, 3)]


def test_free_end_covers_only_the_tokens_reached() -> None:
    path = [0, 1, 1, 0, 2, 2, 0, 3]
    # The audio stops inside token 3: tokens 4 and 5 were not reached.
    assert ctc_forced_align(emissions(path), [1, 2, 3, 4, 5], BLANK, free_end=True) == [(1, 3), (4, 6), (7, 8)]
    # A fixed end must place every token, however badly.
    spans = ctc_forced_align(emissions(path), [1, 2, 3, 4, 5], BLANK)
    assert spans is not None and len(spans) == 5 and spans[-1][1] == len(path)


def test_too_many_tokens_for_the_frames_is_none() -> None:
    assert ctc_forced_align(emissions([1, 2]), [1, 2, 3], BLANK) is None
    assert ctc_forced_align(np.zeros((0, 6), np.float32), [1], BLANK) is None
    assert ctc_forced_align(emissions([0, 1]), [], BLANK) == []


def test_spans_are_ordered_and_disjoint_on_noise() -> None:
    rng = np.random.default_rng(3)
    lp = np.log(rng.dirichlet(np.ones(8), 200)).astype(np.float32)
    targets = list(rng.integers(1, 8, 40))
    spans = ctc_forced_align(lp, targets, BLANK)
    assert spans is not None and len(spans) == 40
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert all(s < e for s, e in spans)
