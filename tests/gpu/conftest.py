"""The GPU tier: the model and the engine on CUDA (``pytest -m gpu`` on an H200; skipped without a GPU).

Every test here runs on ``DEVICES``: the ``cuda`` variant is marked ``gpu`` and skips cleanly when
``torch.cuda.is_available()`` is False; the ``cpu`` variant (not marked) runs the same body on the CPU in CI,
so the tests' own logic is proven on every run, not only when someone has a GPU at hand.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from moss_rt.model import ModelRunner, load_model
from moss_rt.model.loader import LoadedModel

# Reused fixtures (imported so pytest registers them for this folder too): the committed upstream golden
# fixtures of tests/model and the real-engine server factory of tests/engine.
from tests.engine.conftest import moss_server, tiny_data_dir  # noqa: F401
from tests.model.conftest import TINY, golden, golden_cases  # noqa: F401

HAS_CUDA = torch.cuda.is_available()
GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=GPU)]


@pytest.fixture(autouse=True)
def _one_cpu_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads only add contention on the CPU variants (restored after)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


_LOADED: dict[str, LoadedModel] = {}


def tiny_model(device: str) -> LoadedModel:
    """The committed tiny fixture checkpoint in fp32 on ``device`` (loaded once per device)."""
    if device not in _LOADED:
        _LOADED[device] = load_model(TINY, device=device, dtype=torch.float32)
    return _LOADED[device]


@pytest.fixture
def make_runner() -> Callable[..., ModelRunner]:
    """Factory: ModelRunner(device, max_slots, max_seq_len, **options) on the tiny fixture, fp32.

    Small slot counts and sequence lengths keep graph capture quick (one graph per batch bucket x key bucket).
    """

    def factory(device: str, max_slots: int = 8, max_seq_len: int = 320, **options: object) -> ModelRunner:
        loaded = tiny_model(device)
        runner = ModelRunner(
            loaded.model,
            loaded.tokenizer,
            loaded.config,
            max_slots=max_slots,
            max_seq_len=max_seq_len,
            device=device,
            dtype=torch.float32,
            **options,  # type: ignore[arg-type]
        )
        if device == "cuda" and options.get("use_cuda_graphs", True):
            assert runner.use_cuda_graphs, "the CUDA variant must step through CUDA graphs"
        return runner

    return factory
