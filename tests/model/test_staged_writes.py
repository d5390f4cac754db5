"""Slot operations stage their device writes; one apply writes a whole round of them (runner.apply_staged).

The device state after a round of admissions applied together must equal the state after writing each operation at
once (the old per-slot writes), the values must be the ones asked for, a step right after the admissions must see
them without anyone applying them by hand, and the torch calls of a round must not grow with its admissions.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from moss_rt.generation import SamplingParams
from moss_rt.model import ModelRunner
from moss_rt.model.runner import PrefillRequest
from moss_rt.model.sampling import split_seed
from moss_rt.model.state import FLOAT_FIELDS, INT_FIELDS

PENALTY = SamplingParams(text_temperature=0.0, audio_repetition_penalty=1.1)
# Different in every field, with the edge cases the writes must keep: greedy, top-k off, a top-p below float32's
# 1e-6 floor, a 63-bit seed, a penalty that is not a float32 number.
ROUND = [
    (SamplingParams(audio_temperature=0.7, audio_top_k=25, audio_top_p=0.9, audio_repetition_penalty=1.3,
                    text_temperature=0.0), 7),
    (SamplingParams(audio_temperature=0.0, audio_top_k=0, audio_top_p=1e-9, audio_repetition_penalty=1.0,
                    text_temperature=1.5, text_top_k=3, text_top_p=0.5), (1 << 63) - 1),
    (SamplingParams(audio_temperature=1.3, audio_top_k=1, audio_top_p=0.33, audio_repetition_penalty=0.9,
                    text_temperature=0.2, text_top_k=2, text_top_p=0.99), 123456789012),
    (SamplingParams(), 0),
]
STATE = ("block_table", *INT_FIELDS, *FLOAT_FIELDS, "presence")


@pytest.fixture
def prompt(make_runner) -> np.ndarray:
    return make_runner(max_slots=1).build_prompt(text="One round, several takes.", instruction="")


def _parent(runner: ModelRunner, prompt: np.ndarray) -> tuple[Any, np.ndarray, int]:
    """A finished take, kept for retakes (its slot freed, its cache alive), and a slot left running."""
    parent = runner.alloc_slot()
    runner.prefill(parent, prompt)
    runner.set_sampling(parent, PENALTY, seed=3)
    codes = np.stack([runner.step([parent]).codes[0] for _ in range(6)])
    running = runner.alloc_slot()
    runner.prefill(running, prompt[:-2])
    runner.set_sampling(running, PENALTY, seed=4)
    runner.step([running])
    return runner.detach(parent), codes, running


def _admit_round(runner: ModelRunner, prompt: np.ndarray, kept: Any, codes: np.ndarray, running: int,
                 *, each: bool) -> list[int]:
    """What the scheduler does for a round of admissions: fresh takes (one re-using a kept prompt prefix), a retake
    sharing the kept take up to frame 4 with its history, a take ending and its slot taken again, a seek. ``each``:
    every operation's writes applied at once, as before staging."""
    def done() -> None:
        if each:
            runner.apply_staged()

    slots = []
    for i, (params, seed) in enumerate(ROUND):
        slot = runner.alloc_slot(default_sampling=False)
        done()
        if i == 1:  # a retake of the kept take from its frame 4: shares prompt + 4 frames, continues the counter
            runner.attach(slot, kept, len(prompt) + 4)
            done()
            assert runner.reserve(slot, len(prompt) + 20, len(prompt) + 4)
            runner.set_sampling(slot, params, seed, frame_index=4, history=codes[:4])
        elif i == 2:  # a kept prompt prefix (two blocks of it), as the prompt cache shares one
            runner.share_prefix(slot, kept.blocks[:2], 2 * runner.blocks.block_size, len(prompt) + 20)
            done()
            runner.set_sampling(slot, params, seed, history=np.full((2, 12), 1024))  # pads only: no history
        else:
            runner.set_sampling(slot, params, seed)
        done()
        slots.append(slot)
    runner.free_slot(slots[3])  # ended at once (a cancel): the next admission takes its slot again
    done()
    again = runner.alloc_slot()
    assert again == slots[3]
    done()
    runner.set_sampling(again, SamplingParams(audio_top_k=9), seed=11, history=codes[:2])
    done()
    runner.truncate(running, len(prompt) - 4)  # a seek of the running take
    done()
    runner.set_sampling(running, PENALTY, seed=5, frame_index=2)
    done()
    return slots


def _device(runner: ModelRunner) -> dict[str, torch.Tensor]:
    st = runner._state  # the device tensors as they are: nothing applied on reading
    return {name: getattr(st, name).clone() for name in STATE}


def test_a_round_applied_at_once_equals_each_write_applied_alone(make_runner, prompt):
    """Four admissions with different sampling, a retake with history, a shared prompt prefix, a freed slot taken
    again and a seek, staged and applied together: the device state equals the one written operation by operation,
    and holds the values asked for. A step right after (nothing applied by hand) gives the same codes."""
    batched, alone = make_runner(max_slots=6), make_runner(max_slots=6)
    kept_b, codes_b, running_b = _parent(batched, prompt)
    kept_a, codes_a, running_a = _parent(alone, prompt)
    np.testing.assert_array_equal(codes_b, codes_a)
    slots = _admit_round(batched, prompt, kept_b, codes_b, running_b, each=False)
    assert _admit_round(alone, prompt, kept_a, codes_a, running_a, each=True) == slots
    assert not alone.staged

    assert batched.staged  # nothing of the round reached the device yet
    before = _device(batched)
    assert int(before["seed_lo"][slots[0]]) != 7 and int(before["lengths"][slots[1]]) == 0

    # The retake, the shared prefix and the seeked take step right away (nothing applied by hand); the fresh takes
    # after their prompts (a prefill applies what is staged too).
    ready = [slots[1], slots[2], running_b]
    for runner in (batched, alone):
        result = runner.step(ready)
        if runner is batched:
            first = result
    np.testing.assert_array_equal(first.codes, result.codes)
    np.testing.assert_array_equal(first.stop, result.stop)
    assert not batched.staged
    for runner in (batched, alone):
        runner.prefill_batch([PrefillRequest(slots[0], prompt), PrefillRequest(slots[3], prompt)])
        last = [runner.step([*slots, running_b]) for _ in range(3)]
        if runner is batched:
            then = last
    for b, a in zip(then, last, strict=True):
        np.testing.assert_array_equal(b.codes, a.codes)
    after_b, after_a = _device(batched), _device(alone)
    for name in STATE:
        assert torch.equal(after_b[name], after_a[name]), name

    # ...and those are the values asked for (the state before the step, so counters and lengths as admitted).
    batched2 = make_runner(max_slots=6)
    kept, codes, running = _parent(batched2, prompt)
    _admit_round(batched2, prompt, kept, codes, running, each=False)
    batched2.apply_staged()
    st = _device(batched2)
    for slot, (params, seed) in zip(slots[:3], ROUND[:3], strict=True):
        lo, hi = split_seed(seed)
        assert (int(st["seed_lo"][slot]), int(st["seed_hi"][slot])) == (lo, hi)
        assert int(st["audio_top_k"][slot]) == params.audio_top_k and int(st["text_top_k"][slot]) == params.text_top_k
        for name, value in (("audio_temperature", params.audio_temperature),
                            ("audio_penalty", params.audio_repetition_penalty),
                            ("text_temperature", params.text_temperature), ("text_top_p", params.text_top_p)):
            assert st[name][slot] == torch.tensor(value, dtype=torch.float32), name
    assert float(st["audio_top_p"][slots[1]]) == pytest.approx(1e-6)  # the floor, not 0 (= off)
    assert [int(st["lengths"][s]) for s in (*slots, running)] == [0, len(prompt) + 4, 32, 0, len(prompt) - 4]
    assert [int(st["frame_index"][s]) for s in (*slots, running)] == [0, 4, 0, 0, 2]
    history = torch.zeros((12, 1024), dtype=torch.bool)
    for k in range(12):
        history[k, codes[:4, k]] = True
    assert torch.equal(st["presence"][slots[1]], history)
    assert not st["presence"][slots[2]].any() and not st["presence"][slots[0]].any()
    assert int(st["presence"][slots[3]].sum()) == int(sum(len(set(codes[:2, k])) for k in range(12)))
    assert torch.equal(st["block_table"][slots[1], :2], torch.as_tensor(kept.blocks[:2]))


def test_reading_state_applies_what_is_staged(make_runner, prompt):
    """``state`` (what tests and benches read) never shows a staged value: reading it applies them."""
    runner = make_runner(max_slots=2)
    slot = runner.alloc_slot()
    runner.set_sampling(slot, SamplingParams(audio_top_k=17), seed=99, history=np.zeros((1, 12), np.int64))
    assert runner.staged and int(runner._state.audio_top_k[slot]) == 0
    assert int(runner.state.audio_top_k[slot]) == 17 and int(runner.state.presence[slot].sum()) == 12
    assert not runner.staged


class _Calls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def _round_calls(runner: ModelRunner, kept: Any, codes: np.ndarray, takes: int) -> int:
    """Torch calls of admitting ``takes`` retakes (kept blocks, history) in one round, and applying them."""
    with _Calls() as mode:
        for i in range(takes):
            slot = runner.alloc_slot(default_sampling=False)
            runner.attach(slot, kept, kept.length - 2)
            runner.set_sampling(slot, PENALTY, seed=i, frame_index=4, history=codes[:4])
        runner.apply_staged()
    return sum(mode.calls.values())


def test_a_rounds_device_writes_do_not_grow_with_its_admissions(make_runner, prompt):
    """Admitting one take or six in a round costs the same few torch calls (each is a dispatch through the
    interpreter lock, which the codec worker and web threads contend for), and none before the apply."""
    counts = {}
    for takes in (1, 6):
        runner = make_runner(max_slots=7)
        kept, codes, _ = _parent(runner, prompt)
        runner.free_slot(1)
        counts[takes] = _round_calls(runner, kept, codes, takes)
    assert counts[1] == counts[6], counts
    assert counts[6] <= 24, counts
