"""Codec test fixtures: the committed tiny random codec (real on-disk layout) loaded once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moss_rt.codec import CodecModel, load_codec

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "codec"
TINY_DIR = FIXTURES / "tiny"
GOLDEN = FIXTURES / "golden_v2_tiny.npz"


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return TINY_DIR


@pytest.fixture(scope="session")
def tiny_codec() -> CodecModel:
    """fp32 tiny codec with encoder; shared — tests must not mutate it."""
    torch.manual_seed(0)
    return load_codec(TINY_DIR)


@pytest.fixture(autouse=True)
def _one_cpu_thread() -> Iterator[None]:
    """The tiny codec's ops are far too small to gain from intra-op threads, and with other processes on the
    machine OpenMP spin-waiting made this suite ~9x slower (58 s vs 6.5 s on 2 busy cores). Restored after."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
