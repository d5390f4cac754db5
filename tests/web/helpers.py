"""Test helpers for reading scripted audio back into frame indices and seeds."""

from __future__ import annotations

import numpy as np

from moss_rt.engine.scripted import frame_marker, seed_marker
from moss_rt.protocol import FRAME_SAMPLES


def stereo_frames(pcm: bytes) -> list[tuple[int, int]]:
    """(left marker, right marker) for each 80 ms frame of stereo scripted PCM."""
    samples = np.frombuffer(pcm, dtype="<i2").reshape(-1, 2)
    assert samples.shape[0] % FRAME_SAMPLES == 0, "PCM must hold whole frames"
    heads = samples[::FRAME_SAMPLES]
    return [(int(left), int(right)) for left, right in heads]


def frame_indices(pcm: bytes) -> list[int]:
    """Frame index encoded in each frame of stereo scripted PCM."""
    return [left - 1 for left, _ in stereo_frames(pcm)]


def expected_stereo(first: int, n: int, seed: int) -> list[tuple[int, int]]:
    return [(frame_marker(i), seed_marker(seed)) for i in range(first, first + n)]
