"""Batched prefill: several slots in one backbone pass equal each slot prefilled alone (CPU fp32, bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moss_rt.generation import SamplingParams
from moss_rt.model import ModelRunner, SlotError
from moss_rt.model.runner import PrefillRequest, plan_prefill_passes

GREEDY = SamplingParams(text_temperature=0.0, audio_temperature=0.0)
SAMPLED = SamplingParams(text_temperature=0.0, audio_repetition_penalty=1.1)  # 1.7 / 0.8 / 25 + penalty
TRUNCATE_AT = 100  # slot 2 is cut back to this many positions, then its new tail is prefilled from there


@pytest.fixture
def prompts(make_runner) -> list[np.ndarray]:
    r = make_runner(max_slots=1)
    return [
        r.build_prompt(text="The night is long.", instruction="Whisper."),
        r.build_prompt(text="Hi.", instruction=""),
        r.build_prompt(text="A much longer line of text, said very calmly and slowly.", instruction="Whisper."),
        # The longest: with its key window one attention over the padded batch would differ from the others
        # alone in the last bits (checked), so the exact test below really tests that the CPU runs slots apart.
        r.build_prompt(
            text="The night is long, and the stars are listening. Nobody else is awake at this hour, so speak softly.",
            instruction="Shout it across the yard.",
        ),
    ]


def _history(runner: ModelRunner, prompts: list[np.ndarray]) -> list[int]:
    """Three slots; slot 2 already holds a take (prompt + 6 frames) that is then truncated, as a seek does."""
    slots = [runner.alloc_slot() for _ in range(3)]
    runner.prefill(slots[2], prompts[2])
    runner.set_sampling(slots[2], SAMPLED, seed=4)
    for _ in range(6):
        runner.step([slots[2]])
    runner.truncate(slots[2], TRUNCATE_AT)
    return slots


def _requests(slots: list[int], prompts: list[np.ndarray]) -> list[PrefillRequest]:
    return [
        PrefillRequest(slots[0], prompts[0]),
        PrefillRequest(slots[1], prompts[1]),
        PrefillRequest(slots[2], prompts[3][TRUNCATE_AT:], start=TRUNCATE_AT),  # nonzero start offset
    ]


def _frames(runner: ModelRunner, slots: list[int], frames: int) -> np.ndarray:
    out = []
    for _ in range(frames):
        result = runner.step(slots)
        assert not result.stop.any()
        out.append(result.codes)
    return np.stack(out, axis=1)  # [slots, frames, 12]


def _assert_same_cache(a: ModelRunner, b: ModelRunner, slots: list[int]) -> None:
    for s in slots:
        n = a.slot_length(s)
        assert b.slot_length(s) == n
        for name, x, y in zip(("keys", "values", "hidden"), a.slot_cache(s, n), b.slot_cache(s, n), strict=True):
            assert torch.equal(x, y), (name, s)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_batched_prefill_equals_prefilling_each_slot_alone(make_runner, prompts, sampling) -> None:
    lengths = [len(prompts[0]), len(prompts[1]), len(prompts[3])]
    assert len(set(lengths)) == 3 and lengths[1] < lengths[0]  # padding happens

    alone = make_runner(max_slots=3)
    slots = _history(alone, prompts)
    for req in _requests(slots, prompts):
        alone.prefill(req.slot, req.rows, start=req.start)

    together = make_runner(max_slots=3)
    assert _history(together, prompts) == slots
    short = slots[1]
    assert together.prefill_batch(_requests(slots, prompts)) == 1  # one backbone pass for all three
    assert [together.slot_length(s) for s in slots] == lengths

    _assert_same_cache(alone, together, slots)
    # The short slot's padded rows wrote nowhere but the scratch block: it holds only its own blocks.
    assert len(together.blocks.slot_blocks(short)) == together.blocks.blocks_for(lengths[1])

    for runner in (alone, together):
        for i, s in enumerate(slots):
            runner.set_sampling(s, sampling, seed=30 + i)
    # Generation runs on past every padded position of the batch: nothing of the padding is ever seen.
    frames = lengths[0] - lengths[1] + 4
    np.testing.assert_array_equal(_frames(alone, slots, frames), _frames(together, slots, frames))
    _assert_same_cache(alone, together, slots)


def test_one_padded_attention_matches_to_rounding(make_runner, prompts) -> None:
    """The CUDA path (one attention over the padded batch, cpu_batch_invariant=False here) on the CPU:
    the reduction over keys runs over the batch's longest key window, so the cache equals prefilling
    alone only to float rounding; the codes still come out the same."""
    alone = make_runner(max_slots=3)
    slots = _history(alone, prompts)
    for req in _requests(slots, prompts):
        alone.prefill(req.slot, req.rows, start=req.start)
    padded = make_runner(max_slots=3)
    _history(padded, prompts)
    padded.per_slot_eager = False
    assert padded.prefill_batch(_requests(slots, prompts)) == 1
    padded.per_slot_eager = True  # steps as in the other runner: only the prefill differs
    for s in slots:
        n = alone.slot_length(s)
        for x, y in zip(padded.slot_cache(s, n), alone.slot_cache(s, n), strict=True):
            torch.testing.assert_close(x, y)
    for runner in (alone, padded):
        for i, s in enumerate(slots):
            runner.set_sampling(s, SAMPLED, seed=50 + i)
    np.testing.assert_array_equal(_frames(alone, slots, 12), _frames(padded, slots, 12))


def test_passes_are_capped_by_padded_rows(make_runner, prompts) -> None:
    """prefill_max_rows below every prompt: each is cut into 64-row pieces spread over several passes; the
    cache equals prefilling each slot alone in the same pieces (chunked prefill itself equals one-shot only
    to rounding: its key windows differ)."""
    cap = 64
    pieces = make_runner(max_slots=3)
    slots = _history(pieces, prompts)
    for req in _requests(slots, prompts):
        for off in range(0, len(req.rows), cap):
            pieces.prefill(req.slot, req.rows[off : off + cap], start=req.start + off)

    capped = make_runner(max_slots=3)
    capped.prefill_max_rows = cap
    _history(capped, prompts)
    passes = capped.prefill_batch(_requests(slots, prompts))
    assert passes == len(plan_prefill_passes([len(r.rows) for r in _requests(slots, prompts)], cap)) > 3
    _assert_same_cache(pieces, capped, slots)


def test_plan_prefill_passes() -> None:
    assert plan_prefill_passes([], 8) == []
    assert plan_prefill_passes([3, 2, 1], 9) == [[(0, 0, 3), (1, 0, 2), (2, 0, 1)]]
    # 3 chunks x 4 rows padded = 12 > 10: the third goes to a second pass
    assert plan_prefill_passes([4, 1, 2], 10) == [[(0, 0, 4), (1, 0, 1)], [(2, 0, 2)]]
    # a chunk longer than the cap is cut; its second piece comes in a later pass than its first
    assert plan_prefill_passes([7, 2], 4) == [[(0, 0, 4)], [(1, 0, 2)], [(0, 4, 3)]]
    for lengths, cap in (([5, 9, 1, 13, 2], 6), ([400] * 64, 8192), ([1] * 10, 3)):
        passes = plan_prefill_passes(lengths, cap)
        for group in passes:
            assert len(group) * max(n for _, _, n in group) <= cap
            assert len({i for i, _, _ in group}) == len(group)
        covered = {i: 0 for i in range(len(lengths))}
        for group in passes:
            for i, off, n in group:
                assert off == covered[i]  # pieces of a request come in order
                covered[i] += n
        assert covered == dict(enumerate(lengths))


def test_a_bad_request_writes_nothing(make_runner, prompts) -> None:
    runner = make_runner(max_slots=2)
    a, b = runner.alloc_slot(), runner.alloc_slot()
    with pytest.raises(ValueError, match="duplicate"):
        runner.prefill_batch([PrefillRequest(a, prompts[0]), PrefillRequest(a, prompts[1])])
    with pytest.raises(SlotError, match="beyond the slot's length"):
        runner.prefill_batch([PrefillRequest(a, prompts[0]), PrefillRequest(b, prompts[1], start=3)])
    assert runner.slot_length(a) == runner.slot_length(b) == 0
    assert runner.blocks.slot_blocks(a) == [] and runner.free_blocks == runner.blocks.num_blocks - 1
    assert runner.prefill_batch([]) == 0


@pytest.mark.parametrize("tail", [1, 2, 3, 4])
def test_a_few_rows_next_to_a_long_chunk_equal_them_alone(make_runner, prompts, tail) -> None:
    """The last few rows of a prompt (a chunk of 1-3 rows is common: prompt length mod prefill_chunk) in one
    pass with a long chunk of another slot: bit-identical to prefilling them alone. CPU GEMMs are not
    row-invariant across row counts (a handful of rows takes another kernel path than hundreds), so this holds
    only if nothing of a slot's pass is batched with another slot's rows on the CPU."""
    short, long_ = prompts[0], prompts[3]
    runners = []
    for batched in (False, True):
        runner = make_runner(max_slots=2)
        a, b = runner.alloc_slot(), runner.alloc_slot()
        runner.prefill(a, short[:-tail])
        requests = [PrefillRequest(a, short[-tail:], start=len(short) - tail), PrefillRequest(b, long_)]
        if batched:
            runner.prefill_batch(requests)
        else:
            for req in requests:
                runner.prefill(req.slot, req.rows, start=req.start)
        runners.append(runner)
    _assert_same_cache(*runners, [0, 1])
