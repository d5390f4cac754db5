"""PinnedStaging: a round's small host arrays reach the device in one copy, exactly, however many rounds the device
lags behind (model/staging.py; ModelRunner.apply_staged packs its writes through it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moss_rt.model import staging as staging_module
from moss_rt.model.staging import ALIGN, PinnedStaging
from tests.gpu.conftest import DEVICES


def _round(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """Arrays of a round: block-table rows, slot scalars, floats, presence slots and rows (odd sizes: alignment)."""
    return [
        rng.integers(-(2**62), 2**62, (n, 1 + 7), dtype=np.int64),
        rng.integers(0, 1000, (7, n), dtype=np.int64),
        rng.random((5, n), dtype=np.float32),
        rng.integers(0, 9, n, dtype=np.int64),
        rng.random((n, 3, 13)) < 0.3,
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_every_round_arrives_exactly_while_the_device_lags(device: str) -> None:
    """More rounds than the ring holds, each read by a kernel queued behind slow work: every one arrives as it was
    on the host when copied (a buffer written again before its copy ran, or a device buffer overwritten before
    its readers ran, would show as another round's values)."""
    rng = np.random.default_rng(1)
    staging = PinnedStaging(device)
    rounds = [_round(rng, n) for n in (1, 5, 16, 3, 64, 2, 9, 31, 7, 4, 12, 40, 1, 8)]
    expected = [[a.copy() for a in arrays] for arrays in rounds]
    assert len(rounds) > staging_module.MAX_BUFFERS
    slow = torch.randn(2048, 2048, device=device) if device == "cuda" else None
    seen = []
    for arrays in rounds:
        if slow is not None:
            for _ in range(4):  # the device well behind the host, as a model step keeps it
                slow = (slow @ slow).clamp_(-1, 1)
        out = staging.copy(arrays)
        seen.append([t.clone() for t in out])  # read at once, as apply_staged's scatters do
        for a in arrays:
            a[...] = 0  # the host reuses its arrays: what was copied must not change
    for arrays, got in zip(expected, seen, strict=True):
        for want, tensor in zip(arrays, got, strict=True):
            assert tensor.device.type == device
            assert tensor.dtype == torch.from_numpy(want).dtype and tuple(tensor.shape) == want.shape
            np.testing.assert_array_equal(tensor.cpu().numpy(), want)


def test_layout_aligns_every_array() -> None:
    arrays = [np.zeros(3, np.bool_), np.zeros((2, 3), np.int64), np.zeros(5, np.float32), np.zeros(0, np.int64)]
    offsets, total = PinnedStaging._layout(arrays)
    assert offsets == [0, ALIGN, ALIGN + 48, ALIGN + 48 + 32]
    assert all(at % ALIGN == 0 for at in offsets) and total == offsets[-1]
