"""The passes that compile kernels ahead of the warm-up's captures (ModelRunner.compile_step / compile_prefill, run
on several threads at once by engine/warm_compile.py) change nothing a take reads: only the scratch block of the KV
pool, and the last step's outputs. On the CPU, where the same passes run eagerly (they compile nothing here)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

from moss_rt.generation import SamplingParams
from moss_rt.model import ModelRunner
from moss_rt.model.runner import SlotError

PENALTY = SamplingParams(text_temperature=0.0, audio_repetition_penalty=1.1)


def _state(runner: ModelRunner) -> dict[str, torch.Tensor]:
    """Everything of the device state a take reads later (not ``codes``/``stop``/``active``: a step's own I/O)."""
    st = runner.state
    keep = torch.ones(st.hidden.shape[0], dtype=torch.bool)
    keep[: st.block_size] = False  # block 0, the scratch block, absorbs what nobody reads
    out = {"k": st.k_cache[:, keep].clone(), "v": st.v_cache[:, keep].clone(), "hidden": st.hidden[keep].clone()}
    for name in ("block_table", "lengths", "frame_index", "seed_lo", "seed_hi", "audio_temperature", "audio_top_k",
                 "audio_top_p", "audio_penalty", "text_temperature", "text_top_k", "text_top_p", "presence"):
        out[name] = getattr(st, name).clone()
    return out


def _take(runner: ModelRunner, rows: np.ndarray, frames: int) -> tuple[np.ndarray, object]:
    """A take of ``rows`` for ``frames`` frames, its cache then kept (detached) as the prompt cache keeps one."""
    slot = runner.alloc_slot()
    runner.prefill(slot, rows)
    runner.set_sampling(slot, PENALTY, seed=3)
    codes = np.stack([runner.step([slot]).codes[0] for _ in range(frames)])
    return codes, runner.detach(slot)


def test_compile_passes_leave_everything_but_the_scratch_block(make_runner: Callable[..., ModelRunner]) -> None:
    runner = make_runner(max_slots=4, max_seq_len=600)
    rows = runner.build_prompt(text="The rain had stopped an hour ago, and the house was quiet.", instruction="Calm.")
    _, kept = _take(runner, rows, 5)  # a kept cache and sampler state: what a later take would continue from
    before = _state(runner)
    graphs = runner.prefill_graphs
    # Every pass warm_compile may run, several at once on threads as the engine runs them.
    passes = [lambda s=s: runner.compile_prefill(s) for s in graphs.shapes()]
    passes += [lambda b=b, k=k: runner.compile_step(b, k) for k in runner.key_buckets() for b in (1, 2, 4)]
    errors: list[BaseException] = []

    def run(chunk: list[Callable[[], None]]) -> None:
        try:
            for p in chunk:
                p()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(passes[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    after = _state(runner)
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    # And a take continuing the kept cache makes what it makes on a runner that never ran them.
    fresh = make_runner(max_slots=4, max_seq_len=600)
    _, fresh_kept = _take(fresh, rows, 5)
    for r, ref in ((runner, kept), (fresh, fresh_kept)):
        slot = r.alloc_slot()
        r.attach(slot, ref, len(rows) + 5)
        r.set_sampling(slot, PENALTY, seed=4, frame_index=5)
    continued = [np.stack([r.step([0]).codes[0] for _ in range(4)]) for r in (runner, fresh)]
    np.testing.assert_array_equal(continued[0], continued[1])


def test_compile_step_refuses_once_a_slot_is_allocated(make_runner: Callable[..., ModelRunner]) -> None:
    runner = make_runner(max_slots=2, max_seq_len=300)
    runner.alloc_slot()
    with pytest.raises(SlotError, match="before any slot is allocated"):
        runner.compile_step(1, 256)
