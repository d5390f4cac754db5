"""ModelRunner: slots, prefill/truncate exactness, batch independence, stop, penalty history."""

from __future__ import annotations

import numpy as np
import pytest

from moss_rt.generation import SamplingParams
from moss_rt.model import SlotError

# Greedy stop head (the tiny model's continue margin is positive), sampled audio: takes never end early.
DEFAULT = SamplingParams(text_temperature=0.0)
PENALTY = SamplingParams(text_temperature=0.0, audio_repetition_penalty=1.1)


def _run(runner, slot, frames):
    codes = []
    for _ in range(frames):
        result = runner.step([slot])
        assert not result.stop[0]
        codes.append(result.codes[0])
    return np.stack(codes)


@pytest.fixture
def prompt(make_runner):
    return make_runner(max_slots=1).build_prompt(text="The night is long.", instruction="Whisper.")


def test_slot_allocation(make_runner):
    runner = make_runner(max_slots=2)
    assert [runner.alloc_slot(), runner.alloc_slot()] == [0, 1]
    with pytest.raises(SlotError, match="all 2 slots"):
        runner.alloc_slot()
    runner.free_slot(0)
    assert runner.alloc_slot() == 0
    with pytest.raises(SlotError, match="not allocated"):
        runner.free_slot(5)


def test_step_argument_checks(make_runner, prompt):
    runner = make_runner(max_slots=2)
    a, b = runner.alloc_slot(), runner.alloc_slot()
    with pytest.raises(SlotError, match="prefill it first"):
        runner.step([a])
    runner.prefill(a, prompt)
    with pytest.raises(ValueError, match="duplicate"):
        runner.step([a, a])
    with pytest.raises(SlotError, match="beyond the slot's length"):
        runner.prefill(b, prompt, start=3)
    with pytest.raises(ValueError, match="rows must be"):
        runner.prefill(b, prompt[:, :5])
    bad = prompt.copy()
    bad[3, 4] = 2000
    with pytest.raises(ValueError, match="row codes"):
        runner.prefill(b, bad)
    with pytest.raises(SlotError, match="exceeds max_seq_len"):
        runner.prefill(b, np.concatenate([prompt, prompt, prompt]))


def test_truncate_after_longer_prefill_equals_shorter_prefill(make_runner, prompt):
    runner = make_runner(max_slots=2)
    a, b = runner.alloc_slot(), runner.alloc_slot()
    m = len(prompt) - 10
    runner.prefill(a, prompt)
    runner.truncate(a, m)
    runner.prefill(b, prompt[:m])
    for slot in (a, b):
        runner.set_sampling(slot, PENALTY, seed=11)
    np.testing.assert_array_equal(_run(runner, a, 6), _run(runner, b, 6))


def test_chunked_prefill_equals_one_shot(make_runner, prompt):
    runner = make_runner(max_slots=2)
    a, b = runner.alloc_slot(), runner.alloc_slot()
    runner.prefill(a, prompt)
    runner.prefill(b, prompt[:50])
    runner.prefill(b, prompt[50:120], start=50)
    runner.prefill(b, np.zeros((7, 13), np.int64), start=120)  # junk, overwritten by the next chunk
    runner.prefill(b, prompt[120:], start=120)
    assert runner.slot_length(b) == len(prompt)
    for slot in (a, b):
        runner.set_sampling(slot, DEFAULT, seed=3)
    np.testing.assert_array_equal(_run(runner, a, 5), _run(runner, b, 5))


def test_seek_regenerates_the_same_frames_exactly(make_runner, prompt):
    """Truncate to prompt+N, restore history and counter: frames N.. come out again bit-identically."""
    runner = make_runner(max_slots=1)
    slot = runner.alloc_slot()
    runner.prefill(slot, prompt)
    runner.set_sampling(slot, PENALTY, seed=21)
    first = _run(runner, slot, 12)
    n = 5
    runner.truncate(slot, len(prompt) + n)
    runner.set_sampling(slot, PENALTY, seed=21, frame_index=n, history=first[:n])
    np.testing.assert_array_equal(_run(runner, slot, 7), first[n:])
    # a different seed branches off
    runner.truncate(slot, len(prompt) + n)
    runner.set_sampling(slot, PENALTY, seed=22, frame_index=n, history=first[:n])
    assert not np.array_equal(_run(runner, slot, 7), first[n:])


def test_take_is_independent_of_its_batch_neighbours(make_runner, prompt):
    alone = make_runner(max_slots=8)
    slot = alone.alloc_slot()
    alone.prefill(slot, prompt)
    alone.set_sampling(slot, PENALTY, seed=99)
    solo = _run(alone, slot, 15)

    crowd = make_runner(max_slots=8)
    slots = [crowd.alloc_slot() for _ in range(8)]
    texts = ["Hello.", "Get out!", "A longer line of text, said calmly.", "Yes.", "No!", "Maybe?", "Why not."]
    for i, s in enumerate(slots[:7]):
        crowd.prefill(s, crowd.build_prompt(text=texts[i], instruction=f"style {i}"))
        crowd.set_sampling(s, SamplingParams(audio_temperature=0.5 + 0.2 * i, audio_top_k=10 * i), seed=i)
        # neighbours use the default stop head and may stop: the target must not care
    target = slots[5]  # in the middle of the batch
    crowd.free_slot(target)
    assert crowd.alloc_slot() == target
    crowd.prefill(target, prompt)
    crowd.set_sampling(target, PENALTY, seed=99)
    order = [slots[7 - 1 - i] for i in range(7)] + [target]
    order = [s for s in order if s != target][:3] + [target] + [s for s in order if s != target][3:]
    got = []
    for _ in range(15):
        runnable = [s for s in order if s == target or crowd.slot_length(s) < 300]
        result = crowd.step(runnable)
        got.append(result.codes[runnable.index(target)])
    np.testing.assert_array_equal(np.stack(got), solo)


def test_batched_range_path_matches_per_slot_path(make_runner, prompt):
    """The path CUDA graphs capture (rows [0,B), unlisted rows inactive) gives the same takes."""
    runs = []
    for per_slot in (True, False):
        runner = make_runner(max_slots=4)
        slots = [runner.alloc_slot() for _ in range(4)]
        for i, s in enumerate(slots):
            runner.prefill(s, prompt if i != 1 else prompt[:-20])
            runner.set_sampling(s, SamplingParams(audio_temperature=0.0, text_temperature=0.0), seed=i)
        runner.per_slot_eager = per_slot
        frames = {s: [] for s in slots}
        for t in range(6):
            stepped = [3, 0] if t % 2 else [0, 1, 3]  # slot 2 never steps: it must stay untouched
            result = runner.step(stepped)
            for s, codes in zip(stepped, result.codes, strict=True):
                frames[s].append(codes)
        lengths = [runner.slot_length(s) for s in slots]
        runner.per_slot_eager = True
        frames[2] = list(_run(runner, 2, 3))
        runs.append(({s: np.stack(v) for s, v in frames.items()}, lengths))
    (a, la), (b, lb) = runs
    assert la == lb == [len(prompt) + 6, len(prompt) - 20 + 3, len(prompt), len(prompt) + 6]
    for s in a:
        np.testing.assert_array_equal(a[s], b[s])


def test_stop_ends_a_take_without_a_frame(make_runner, prompt):
    runner = make_runner(max_slots=1, max_seq_len=600)
    slot = runner.alloc_slot()
    runner.prefill(slot, prompt)
    runner.set_sampling(slot, SamplingParams(), seed=0)
    for frame in range(400):  # noqa: B007 - frame is read after the loop
        result = runner.step([slot])
        if result.stop[0]:
            break
    else:
        pytest.fail("the tiny model never stopped in 400 frames")
    assert 0 < frame
    assert runner.slot_length(slot) == len(prompt) + frame
    assert (result.codes[0] == 1024).all()
    assert result.backbone_ms is not None and result.local_ms is not None and result.sampling_ms is not None
    # drawing again from the same state repeats the stop (same seed and counter)
    assert runner.step([slot]).stop[0]


def test_repetition_penalty_uses_the_takes_history(make_runner, prompt):
    """Greedy with a huge penalty never repeats a code within a codebook, history included."""
    runner = make_runner(max_slots=1)
    slot = runner.alloc_slot()
    runner.prefill(slot, prompt)
    greedy = SamplingParams(audio_temperature=0.0, text_temperature=0.0, audio_repetition_penalty=1e4)
    runner.set_sampling(slot, greedy, seed=0)
    history = _run(runner, slot, 4)
    runner.truncate(slot, len(prompt))
    runner.set_sampling(slot, greedy, seed=0, history=np.vstack([history, np.full((1, 12), 1024)]))
    later = _run(runner, slot, 10)
    codes = np.vstack([history, later])
    for k in range(12):
        assert len(set(codes[:, k])) == len(codes), k
    # without the penalty greedy decoding does repeat itself on this model
    runner.truncate(slot, len(prompt))
    runner.set_sampling(slot, SamplingParams(audio_temperature=0.0, text_temperature=0.0), seed=0)
    plain = _run(runner, slot, 14)
    assert any(len(set(plain[:, k])) < len(plain) for k in range(12))


def test_new_sampling_forgets_the_slots_earlier_history(make_runner, prompt):
    """A take after one whose history filled the penalty's presence table starts with an empty one (the slot's table
    is cleared on the device when no history is given), whether its slot came with default sampling or not."""
    runner = make_runner(max_slots=1)
    slot = runner.alloc_slot()
    history = np.arange(24, dtype=np.int64).reshape(2, 12) + 3
    runner.set_sampling(slot, SamplingParams(), seed=0, history=history)
    assert int(runner.state.presence[slot].sum()) == 24
    runner.set_sampling(slot, SamplingParams(), seed=0)
    assert not bool(runner.state.presence[slot].any())
    runner.set_sampling(slot, SamplingParams(), seed=0, history=history)
    runner.free_slot(slot)
    again = runner.alloc_slot(default_sampling=False)
    assert again == slot and int(runner.state.presence[slot].sum()) == 24  # not touched: the caller sets it next
    runner.set_sampling(again, SamplingParams(), seed=1)
    assert not bool(runner.state.presence[slot].any())


def test_sampling_parameter_validation(make_runner):
    runner = make_runner(max_slots=1)
    slot = runner.alloc_slot()
    with pytest.raises(ValueError, match="temperatures"):
        runner.set_sampling(slot, SamplingParams(audio_temperature=-1.0), 0)
    with pytest.raises(ValueError, match="penalty"):
        runner.set_sampling(slot, SamplingParams(audio_repetition_penalty=0.0), 0)
    with pytest.raises(ValueError, match="history"):
        runner.set_sampling(slot, DEFAULT, 0, history=np.zeros((3, 5), np.int64))


def test_key_buckets_cover_every_reachable_length_once(make_runner):
    runner = make_runner(max_slots=1, max_seq_len=1024)
    assert runner.key_buckets() == [256, 512, 1024]
    assert {runner._key_bucket(n) for n in range(1, 1025)} == set(runner.key_buckets())
    odd = make_runner(max_slots=1, max_seq_len=1000)
    assert odd.key_buckets() == [256, 512, 1001]
    assert {odd._key_bucket(n) for n in range(1, 1001)} == set(odd.key_buckets())
