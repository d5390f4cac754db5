"""The CTC aligner on a tiny random checkpoint that moss_rt writes in the hub layout, batched through the service."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moss_rt.align.base import AlignJob, AlignResult
from moss_rt.align.ctc import AlignerSourceError, CtcAligner, resolve_ctc_source, write_random_ctc_checkpoint
from moss_rt.align.select import AlignerChoiceError, build_aligner
from moss_rt.align.service import AlignService


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_ctc_checkpoint(tmp_path_factory.mktemp("ctc") / "tiny-ctc", size="tiny")


def test_checkpoint_has_the_hub_layout(checkpoint: Path) -> None:
    names = {p.name for p in checkpoint.iterdir()}
    assert {"config.json", "model.safetensors", "vocab.json", "preprocessor_config.json"} <= names
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Wav2Vec2ForCTC"] and config["moss_rt_random_weights"] is True
    assert resolve_ctc_source(str(checkpoint)) == checkpoint.resolve()


def test_a_folder_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AlignerSourceError):
        resolve_ctc_source(str(tmp_path))
    with pytest.raises(AlignerSourceError):
        resolve_ctc_source("./no/such/folder")


def test_batched_alignment_answers_every_job_in_order(checkpoint: Path) -> None:
    aligner = CtcAligner(str(checkpoint), device="cpu", max_batch=8)
    aligner.load()
    assert aligner.demo and aligner.sample_rate == 16000
    rng = np.random.default_rng(0)
    jobs = [
        AlignJob(rng.normal(0, 0.1, 16000 * 2).astype(np.float32), ("forty", "ships")),
        AlignJob(rng.normal(0, 0.1, 16000 * 45).astype(np.float32), tuple("the quick brown fox".split() * 10)),
        AlignJob(rng.normal(0, 0.1, 16000).astype(np.float32), ("hello", "world", "again"), free_end=True),
        AlignJob(rng.normal(0, 0.1, 16000).astype(np.float32), ("你", "ok")),  # a word its vocabulary cannot spell
    ]
    results = aligner.align_batch(jobs)
    assert [len(r.spans) for r in results[:2]] == [2, 40]  # 45 s went through the network in windows
    assert len(results[2].spans) <= 3
    assert results[3].spans[0] is None and results[3].spans[1] is not None
    for job, result in zip(jobs, results, strict=True):
        placed = [s for s in result.spans if s is not None]
        assert all(0 <= s < e <= len(job.audio) / 16000 + 0.03 for s, e in placed)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(placed, placed[1:], strict=False))


def test_service_batches_concurrent_takes_on_one_worker(checkpoint: Path) -> None:
    aligner = CtcAligner(str(checkpoint), device="cpu", max_batch=16)
    service = AlignService(aligner, max_pending=32)
    service.start()

    async def scenario() -> list[int]:
        await service.wait_loaded()
        audio = np.random.default_rng(1).normal(0, 0.1, 16000 * 2).astype(np.float32)
        results = await asyncio.gather(*(service.align(AlignJob(audio, ("a", "b", "c"))) for _ in range(12)))
        return [len(r.spans) for r in results]

    try:
        assert asyncio.run(scenario()) == [3] * 12
        assert service.jobs_done == 12
    finally:
        service.close()


def test_pocketsphinx_workers_follow_the_cores(monkeypatch) -> None:
    from moss_rt.align import select

    for cores, workers in ((1, 2), (2, 2), (6, 3), (16, 8), (64, 8)):
        monkeypatch.setattr(select.os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert select.cpu_workers() == workers
        assert select.cpu_workers(3) == 3  # the setting wins
    assert select.build_aligner("pocketsphinx").workers == 8  # type: ignore[union-attr]


def test_aligner_choice() -> None:
    assert build_aligner("none") is None
    assert build_aligner("pocketsphinx").name == "pocketsphinx"  # type: ignore[union-attr]
    assert build_aligner("pocketsphinx", workers=5).workers == 5  # type: ignore[union-attr]
    assert build_aligner("ctc:some/model", device="cpu").name == "ctc:some/model"  # type: ignore[union-attr]
    with pytest.raises(AlignerChoiceError):
        build_aligner("whisper")


def test_auto_runs_ctc_only_on_cuda_with_the_model_cached(monkeypatch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from moss_rt.align import select
    from moss_rt.align.ctc import DEFAULT_CTC_MODEL

    monkeypatch.setattr(select, "_cuda", lambda device: True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    assert build_aligner("auto").name == "pocketsphinx"  # type: ignore[union-attr]
    monkeypatch.setattr(select, "_ctc_model_cached", lambda: True)
    assert build_aligner("auto").name == f"ctc:{DEFAULT_CTC_MODEL}"  # type: ignore[union-attr]
    monkeypatch.setattr(select, "_cuda", lambda device: False)
    assert build_aligner("auto").name == "pocketsphinx"  # type: ignore[union-attr]


def test_auto_without_the_ctc_model_cached_does_not_import_torch(tmp_path: Path) -> None:
    """Asking for CUDA imports torch (1-2 s of every start of a service that never needs it: the scripted engine,
    which every browser and server test starts, or a CPU-only service): with no CTC model cached, auto never asks."""
    code = (
        "import sys; from moss_rt.align.select import build_aligner; a = build_aligner('auto'); "
        "print(a.name, 'torch' in sys.modules)"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "empty-hub-cache"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True)
    assert out.stdout.split() == ["pocketsphinx", "False"], out.stderr


class _RecordingAligner:
    """An aligner that answers at once and remembers the size of every batch it was given."""

    name, sample_rate, device, workers, demo = "recording", 16000, "cpu", 1, True

    def __init__(self, *, max_batch: int, gather_sec: float) -> None:
        self.max_batch, self.gather_sec = max_batch, gather_sec
        self.batches: list[int] = []

    def load(self) -> None:
        pass

    def align_batch(self, jobs: Any) -> list[AlignResult]:
        self.batches.append(len(jobs))
        return [AlignResult([None] * len(job.words)) for job in jobs]

    def close(self) -> None:
        pass


def test_jobs_arriving_within_the_gather_time_share_one_batch() -> None:
    """A device aligner's worker holding one job waits for more (up to ``gather_sec``): jobs of takes that arrive
    apart go through the network together, and a full batch runs without waiting out the rest of the time."""
    aligner = _RecordingAligner(max_batch=3, gather_sec=30.0)
    service = AlignService(aligner, max_pending=8)  # type: ignore[arg-type]
    service.start()

    async def scenario() -> None:
        await service.wait_loaded()
        job = AlignJob(np.zeros(1600, np.float32), ("a",))
        first = asyncio.ensure_future(service.align(job))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(service.align(job))
        await asyncio.sleep(0.05)
        assert not first.done()  # still gathering
        await asyncio.wait_for(asyncio.gather(first, second, service.align(job)), 20)  # full: runs long before 30 s

    try:
        asyncio.run(scenario())
        assert aligner.batches == [3]
    finally:
        service.close()


def test_a_device_aligner_gathers_and_a_cpu_one_does_not(checkpoint: Path) -> None:
    assert CtcAligner(str(checkpoint), device="cuda").gather_sec > 0
    assert CtcAligner(str(checkpoint), device="cpu").gather_sec == 0
    assert CtcAligner(str(checkpoint), device="cuda", gather_sec=0).gather_sec == 0


def test_batches_padded_to_a_few_shapes_give_the_same_emissions(checkpoint: Path) -> None:
    """On a GPU a batch is padded to a few shapes (rows: a power of two up to 8, then a multiple of 8; samples: a
    multiple of SHAPE_STEP_SEC), a CUDA graph each: the emissions of every audio are those of the unpadded batch,
    and the shapes a stream of jobs of every length makes are few."""
    from moss_rt.align.ctc import SHAPE_STEP_SEC, padded_shape

    step = int(SHAPE_STEP_SEC * 16000)
    assert padded_shape(1, 1, step) == (1, step) and padded_shape(3, step, step) == (4, step)
    assert padded_shape(5, step + 1, step) == (8, 2 * step) and padded_shape(64, 5 * step, step) == (64, 5 * step)
    shapes = {padded_shape(rows, samples, step) for rows in range(1, 65) for samples in range(16000, 16000 * 6, 37)}
    assert len(shapes) <= 11 * 21
    aligner = CtcAligner(str(checkpoint), device="cpu", max_batch=8)
    aligner.load()
    rng = np.random.default_rng(1)
    batch = [rng.normal(0, 0.1, n).astype(np.float32) for n in (16000, 23456, 9999)]
    plain = aligner._forward(batch)
    aligner.pad_shapes = True
    padded = aligner._forward(batch)
    for a, b in zip(plain, padded, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=1e-4)
