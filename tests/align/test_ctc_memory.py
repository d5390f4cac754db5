"""The CTC aligner's device memory: the bound of one pass (moss_rt/align/memory.py) against the MMS-300m figures
worked out by hand, the calls it splits, and the engine's memory plan reserving the aligner (its weights from the
checkpoint's headers, its graph budget twice, less what it already holds)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from moss_rt.align import ctc, select
from moss_rt.align.ctc import CtcAligner, ctc_config, write_random_ctc_checkpoint
from moss_rt.align.memory import (
    DEFAULT_GRAPH_MEMORY_BYTES,
    GIB,
    MIB,
    NetDims,
    frames,
    pass_bytes,
    reserve_bytes,
)
from moss_rt.engine.memory_plan import MemoryCosts, plan_memory

MMS = NetDims.from_config(ctc_config("mms-300m"))
SEC = 16000


def test_the_bound_covers_the_passes_largest_tensors_worked_out_by_hand() -> None:
    """64 rows × 6 s of MMS-300m in fp16: the first convolution's output for a chunk of 8 rows (8 × 19,199 frames ×
    512 channels × 2 bytes = 157 MB) beside its norm's; the residual stream (64 × 299 × 1024 × 2 = 39 MB) and the
    feed-forward's intermediate (157 MB) twice. The bound is above each phase's live set and within the default
    budget; the sum of 32 such passes (the 11.7 GB an H200 showed) is far past it."""
    assert frames(MMS, 6 * SEC) == 299
    conv = 8 * 19199 * 512 * 2
    h = 64 * 299 * 1024 * 2
    ffn = 2 * 64 * 299 * 4096 * 2 + 3 * h
    bound = pass_bytes(MMS, 64, 6 * SEC)
    assert bound > 2 * conv and bound > ffn and bound > 8 * h
    assert bound <= DEFAULT_GRAPH_MEMORY_BYTES < 32 * 2 * conv


def test_the_bound_grows_with_rows_and_samples() -> None:
    sizes = [(r, s * SEC // 4) for r in (1, 2, 4, 8, 16, 32, 64) for s in range(1, 89)]
    for r, n in sizes:
        assert pass_bytes(MMS, r, n) <= pass_bytes(MMS, r, n + SEC // 4) and pass_bytes(MMS, r, n) <= pass_bytes(
            MMS, 2 * r, n
        )
    # Long windows (a whole take's 20 s and context): a few rows a call fit the budget, not 64.
    assert pass_bytes(MMS, 2, 22 * SEC) <= DEFAULT_GRAPH_MEMORY_BYTES < pass_bytes(MMS, 64, 22 * SEC)


def test_a_cuda_aligners_calls_stay_within_the_budget(tmp_path: Path) -> None:
    """The calls a GPU aligner makes (padded shapes, as on CUDA; run here on the CPU): a small budget splits a batch
    of long windows into calls whose bound fits it, and the emissions do not change."""
    folder = write_random_ctc_checkpoint(tmp_path / "tiny", size="tiny")
    aligner = CtcAligner(str(folder), device="cpu", max_batch=16, graph_memory_bytes=0)
    aligner.load()
    rng = np.random.default_rng(0)
    audios = [rng.normal(0, 0.2, int(s * SEC)).astype(np.float32) for s in (1.0, 1.1, 1.2, 0.9, 1.3, 1.05)]
    whole = aligner.emissions(audios)
    calls: list[int] = []
    forward = aligner._forward
    aligner._forward = lambda batch: (calls.append(len(batch)), forward(batch))[1]  # type: ignore[method-assign]
    aligner.pad_shapes = True  # the GPU's call planning
    budget = aligner.pass_bytes(2, int(1.5 * SEC))
    aligner.graph_memory_bytes = budget
    split = aligner.emissions(audios)
    assert calls and max(calls) <= 2 and sum(calls) == len(audios)
    for a, b in zip(whole, split, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


FULL = MemoryCosts(
    bytes_per_position=(2 * 36 * 8 * 128 + 2560) * 2, slot_bytes=12 * 1024 + 224, codec_bytes_per_stream=380 * MIB,
    codec_extra_streams=3, work_bytes=int(2.5 * GIB), work_bytes_per_slot=8 * MIB,
)  # fmt: skip


@pytest.mark.parametrize("total_gib", [24, 80])
def test_the_plan_reserves_the_aligner_before_the_kv_cache(total_gib: int) -> None:
    total = total_gib * GIB
    free = total - 13 * GIB
    aligner = reserve_bytes(630 * MIB, 30 * MIB, DEFAULT_GRAPH_MEMORY_BYTES)
    without = plan_memory(FULL, device="cuda:0", total_bytes=total, free_bytes=free)
    with_aligner = plan_memory(
        dataclasses.replace(FULL, aligner_bytes=aligner), device="cuda:0", total_bytes=total, free_bytes=free
    )
    assert with_aligner.aligner_bytes == aligner and with_aligner.planned_bytes <= with_aligner.budget_bytes
    # The KV pool (and maybe slots) gave up at least what the aligner takes.
    given_up = (
        without.backbone_cache_bytes + without.codec_state_bytes + without.work_bytes
        - with_aligner.backbone_cache_bytes - with_aligner.codec_state_bytes - with_aligner.work_bytes
    )  # fmt: skip
    assert given_up >= aligner - 16 * FULL.bytes_per_position
    assert ("word aligner (weights, graph pool, eager calls)", f"{aligner / GIB:.2f} GiB") in with_aligner.rows()
    assert with_aligner.as_dict()["aligner_bytes"] == aligner


def test_the_plans_reserve_reads_the_checkpoint_and_subtracts_what_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = write_random_ctc_checkpoint(tmp_path / "tiny", size="tiny")
    params = select.safetensors_params(folder)
    import torch
    from transformers import Wav2Vec2ForCTC

    assert params == sum(p.numel() for p in Wav2Vec2ForCTC.from_pretrained(str(folder)).state_dict().values())
    monkeypatch.setattr(select, "_cuda", lambda device: True)
    spec, budget = f"ctc:{folder}", 100 * MIB
    weights, io = select.checkpoint_device_bytes(str(folder))
    assert weights == 2 * params and io > 0
    full = select.planned_reserve_bytes(spec, device="cuda:0", engine_index=0, graph_memory_bytes=budget)
    assert full == weights + io + 2 * budget
    assert select.planned_reserve_bytes(spec, device="cuda:1", engine_index=0, graph_memory_bytes=budget) == 0
    assert select.planned_reserve_bytes("none", device="cuda:0", engine_index=0, graph_memory_bytes=budget) == 0
    assert select.planned_reserve_bytes("pocketsphinx", device="cuda", engine_index=0, graph_memory_bytes=budget) == 0
    # An aligner already loaded on the device: the plan measured it as in use, so it is not reserved twice.
    with ctc._HELD_LOCK:
        ctc._HELD[-1] = (0, weights + io)
    try:
        assert select.planned_reserve_bytes(spec, device="cuda:0", engine_index=0, graph_memory_bytes=budget) == (
            2 * budget
        )
    finally:
        with ctc._HELD_LOCK:
            ctc._HELD.pop(-1)
    # A hub id not on disk yet: planned as an MMS-300m aligner.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hub"))
    mms_weights, _ = select.checkpoint_device_bytes("nobody/not-cached")
    assert mms_weights == 2 * 315_500_000
    del torch
