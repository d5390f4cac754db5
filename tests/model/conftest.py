"""Shared fixtures for the model tests: the committed tiny checkpoint and a CPU runner factory."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from moss_rt.model import ModelRunner, load_model
from moss_rt.model.loader import LoadedModel

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "model"
TINY = FIXTURES / "tiny"


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    # Tiny tensors: intra-op threading only adds sync overhead (badly so on loaded CI boxes).
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model(TINY, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def golden() -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "golden.npz") as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="session")
def golden_cases() -> dict:
    return json.loads((FIXTURES / "golden_cases.json").read_text())


@pytest.fixture
def make_runner(tiny: LoadedModel) -> Callable[..., ModelRunner]:
    def factory(max_slots: int = 8, max_seq_len: int = 320) -> ModelRunner:
        return ModelRunner(
            tiny.model,
            tiny.tokenizer,
            tiny.config,
            max_slots=max_slots,
            max_seq_len=max_seq_len,
            device="cpu",
            dtype=torch.float32,
        )

    return factory
