"""Forced alignment over CTC emissions: the best path of a token sequence through per-frame log-probabilities.

The standard CTC topology: the target tokens with a blank before, between and after them (2L+1 states); at each
frame a path stays in its state, moves to the next, or skips a blank between two different tokens. The best path
(Viterbi) gives each token the frames it holds. With ``free_end`` the path may stop anywhere (audio still arriving):
only the tokens it reached get frames. numpy only; O(T x L) time, T x (2L+1) bytes of back-pointers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NEG_INF = np.float32(-1e30)


def ctc_forced_align(
    log_probs: np.ndarray, targets: Sequence[int], blank: int, *, free_end: bool = False
) -> list[tuple[int, int]] | None:
    """Frames [first, last + 1) of each target token on the best path, in order.

    ``log_probs`` is [T, V] (log-softmax over the vocabulary, one row per frame). A fixed-end alignment covers every
    token; a free-end one covers the tokens reached (a prefix). None when the tokens cannot fit in T frames (each
    needs a frame, and a repeated token a blank between).
    """
    lp = np.asarray(log_probs, dtype=np.float32)
    n_frames = lp.shape[0]
    n_tokens = len(targets)
    if n_tokens == 0 or n_frames == 0:
        return [] if n_tokens == 0 else None
    n_states = 2 * n_tokens + 1
    ext = np.full(n_states, blank, dtype=np.int64)
    ext[1::2] = np.asarray(targets, dtype=np.int64)
    # A skip from s-2 to s is allowed into a token state whose token differs from the one two states back.
    can_skip = np.zeros(n_states, dtype=bool)
    can_skip[3::2] = ext[3::2] != ext[1:-2:2]
    emit = lp[:, ext]  # [T, S]
    alpha = np.full(n_states, NEG_INF, dtype=np.float32)
    alpha[0] = emit[0, 0]
    alpha[1] = emit[0, 1]
    back = np.zeros((n_frames, n_states), dtype=np.int8)
    stay = np.empty(n_states, dtype=np.float32)
    step = np.empty(n_states, dtype=np.float32)
    skip = np.empty(n_states, dtype=np.float32)
    for t in range(1, n_frames):
        stay[:] = alpha
        step[0] = NEG_INF
        step[1:] = alpha[:-1]
        skip[:2] = NEG_INF
        skip[2:] = np.where(can_skip[2:], alpha[:-2], NEG_INF)
        choice = np.argmax(np.stack((stay, step, skip)), axis=0)
        best = np.maximum(np.maximum(stay, step), skip)
        back[t] = choice
        alpha = best + emit[t]
    if free_end:
        end = int(np.argmax(alpha))
    else:
        end = n_states - 1 if alpha[-1] >= alpha[-2] else n_states - 2
    if alpha[end] <= NEG_INF / 2:
        return None  # no path: too many tokens for the frames
    path = np.empty(n_frames, dtype=np.int64)
    state = end
    for t in range(n_frames - 1, -1, -1):
        path[t] = state
        state -= int(back[t, state])
    if path[0] > 1:
        return None  # unreachable start (cannot happen for finite alpha, kept as a guard)
    reached = (end - 1) // 2 + 1 if end % 2 == 1 else end // 2
    spans: list[tuple[int, int]] = []
    for k in range(reached):
        frames = np.flatnonzero(path == 2 * k + 1)
        if len(frames) == 0:
            return None
        spans.append((int(frames[0]), int(frames[-1]) + 1))
    return spans
