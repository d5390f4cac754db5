"""Codec test fixtures: the committed tiny random codec (real on-disk layout) loaded once."""

from __future__ import annotations

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
