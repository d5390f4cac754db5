"""The CTC aligner on CUDA (``pytest -m gpu``; skipped without a GPU): its network replayed through a CUDA graph per
padded shape equals the same network run eagerly, and the Hugging Face module's forward (the path a CPU runs), on
a tiny random checkpoint: fp32 to rounding, fp16 (what the aligner runs on a GPU) to fp16's precision. Three
shapes, one of them replayed with other audio of other lengths, and one too big to capture (run eagerly)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from moss_rt.align.ctc import CtcAligner, write_random_ctc_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# fp16 keeps ~3 significant digits: log-probabilities near -3.5 differ by a few 1e-3 between kernels.
TOLERANCE = {"float32": 2e-4, "float16": 3e-2}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_ctc_checkpoint(tmp_path_factory.mktemp("ctc") / "tiny-ctc", size="tiny")


def _audio(rng: np.random.Generator, *seconds: float) -> list[np.ndarray]:
    return [rng.normal(0, 0.2, int(s * 16000)).astype(np.float32) for s in seconds]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_graphed_forward_equals_eager(checkpoint: Path, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # fp32 convolutions in full precision, both sides
    graphed = CtcAligner(str(checkpoint), device="cuda", max_batch=8, dtype=dtype)
    graphed.load()
    hf = CtcAligner(str(checkpoint), device="cuda", max_batch=8, dtype=dtype, cuda_graphs=False)
    hf.load()
    assert graphed._graphed is not None and hf._graphed is None
    rng = np.random.default_rng(0)
    batches = [
        _audio(rng, 1.3, 0.7, 1.1),  # 4 rows × 1.5 s
        _audio(rng, 2.0, 1.9, 0.4, 1.0, 2.0, 0.3, 1.2, 1.8),  # 8 rows × 2 s
        _audio(rng, 1.4, 1.25, 0.5),  # 4 rows × 1.5 s again: a replay, other audio, other lengths
        _audio(rng, 1.0, 3.3),  # 2 rows × 3.5 s
        _audio(rng, 7.0, 6.9, 7.0, 2.0, 6.5),  # 8 rows × 7 s: past the graphs' 8 × 6 s, run eagerly
    ]
    for batch in batches:
        ours, theirs = graphed._forward(batch), hf._forward(batch)
        for a, b, audio in zip(ours, theirs, batch, strict=True):
            assert a.shape == b.shape and len(a) > 0.9 * len(audio) / 320
            np.testing.assert_allclose(a, b, atol=TOLERANCE[dtype], rtol=0)
    stats = graphed.graph_stats
    assert stats is not None
    # The largest shape (8 rows × 6 s) captured first, then the three asked for; one replay; 8 × 7 s eager.
    assert (stats["captures"], stats["replays"], stats["eager"], stats["failed"]) == (4, 4, 1, 0)
    assert stats["resets"] == 0 and stats["pool_peak_mb"] <= stats["budget_mb"]
    assert stats["pool_mb"] is None or stats["pool_mb"] >= 0


def test_replays_equal_the_same_pass_run_eagerly(checkpoint: Path) -> None:
    """The graph and the forward it captured, on the same inputs: the same kernels, the same numbers."""
    aligner = CtcAligner(str(checkpoint), device="cuda", max_batch=8, dtype="float16")
    aligner.load()
    runner = aligner._graphed
    rng = np.random.default_rng(1)
    for seconds in ((1.0, 0.6), (1.0, 0.9), (2.2, 1.6, 0.2)):
        batch = _audio(rng, *seconds)
        rows, samples = (2, 16000) if len(batch) == 2 else (4, 36000)
        replayed = runner.run(batch, (rows, samples))
        with torch.inference_mode():
            x = torch.zeros(rows, samples)
            for row, a in enumerate(batch):
                x[row, : len(a)] = torch.from_numpy(a)
            lengths = torch.tensor([len(a) for a in batch] + [samples] * (rows - len(batch)))
            eager = runner.net(x.cuda(), lengths.cuda(), normalize=runner.normalize)[: len(batch)].cpu().numpy()
        np.testing.assert_allclose(replayed, eager, atol=1e-3, rtol=0)
    assert runner.stats["captures"] == 3 and runner.stats["replays"] == 3  # the largest shape first, then two
