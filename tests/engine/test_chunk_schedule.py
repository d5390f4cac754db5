"""Which frames of a take go to the codec together (engine/slots.Take.chunk_due, flushed_on, in_ramp), step by step,
without a model: a director's take sends one-frame chunks until it is on the engine's shared cadence, then whole
chunks; it never sends an odd-length chunk to get in phase, nor waits a whole cadence for the frames after its
first ones. A script line has no one-frame ramp."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from moss_rt.engine.base import RAMP_FRAMES, TakePriority, TakeSpec
from moss_rt.engine.slots import Take


class QuietChannel:
    cancel_reason = None
    paused = False

    def push(self, event: object) -> None:
        pass


@dataclass
class Sent:
    step: int  # the engine's steps so far when the chunk went to the codec
    frames: int
    ramp: bool  # in the codec's priority lane (a director's ramp)


def chunks(chunk_frames: int, steps_before: int, frames: int, *, batch: bool = False) -> list[Sent]:
    """The chunks of a take that makes one frame a step from step ``steps_before + 1`` until ``frames``, as the
    scheduler hands them over (its last frames when it reaches its budget)."""
    priority = TakePriority.BATCH if batch else TakePriority.INTERACTIVE
    spec = TakeSpec("t", text="x", seed=1, chunk_frames=chunk_frames, priority=priority)
    take = Take(spec, channel=QuietChannel())  # type: ignore[arg-type]
    sent: list[Sent] = []
    step = steps_before
    while take.frames < frames:
        take.frames += 1
        step += 1
        if take.chunk_due(step) or take.frames == frames:
            sent.append(Sent(step, take.pending, not take.batch and take.in_ramp))
            take.flushed_on(step)
    return sent


def test_a_directors_ramp_goes_on_one_frame_at_a_time_until_the_cadence() -> None:
    # Its eighth frame is made on step 13: three more one-frame chunks, the third on step 16 (the cadence), then
    # whole chunks on the cadence, the last one what its budget leaves.
    sent = chunks(8, 5, 40)
    assert [c.frames for c in sent] == [1] * 11 + [8, 8, 8, 5]
    assert [c.step for c in sent[10:]] == [16, 24, 32, 40, 45]
    assert [c.ramp for c in sent] == [True] * 11 + [False] * 4
    # Its eighth frame on the cadence: whole chunks right after it.
    assert [c.frames for c in chunks(8, 0, 24)] == [1] * 8 + [8, 8]


@pytest.mark.parametrize("chunk_frames", [1, 3, 4, 8])
@pytest.mark.parametrize("steps_before", range(8))
def test_no_odd_chunk_to_get_in_phase_and_never_a_cadence_without_audio(chunk_frames: int, steps_before: int) -> None:
    frames = 60
    sent = chunks(chunk_frames, steps_before, frames)
    ramp = [c for c in sent if c.ramp]
    assert ramp[0].frames == 1 and sum(c.frames for c in ramp) >= RAMP_FRAMES  # first audio after one frame
    # After the one-frame chunks, whole chunks on the cadence (the budget's last one aside).
    ones = next(i for i, c in enumerate(sent) if c.frames != 1 or c is sent[-1])
    assert all(c.frames == chunk_frames and c.step % chunk_frames == 0 for c in sent[ones:-1])
    assert sum(c.frames for c in sent) == frames
    # A listener waits at most one cadence (chunk_frames steps) between two chunks.
    assert max(b.step - a.step for a, b in zip(sent, sent[1:], strict=False)) <= chunk_frames
    # The codec's priority lane holds the ramp: every chunk that starts within its first RAMP_FRAMES frames, and every
    # one-frame chunk before it is in phase (chunks of more than one frame), and nothing after them.
    starts = [sum(c.frames for c in sent[:i]) for i in range(len(sent))]
    in_ramp = [start < RAMP_FRAMES or (chunk_frames > 1 and i < ones) for i, start in enumerate(starts)]
    assert [c.ramp for c in sent] == in_ramp


def test_a_script_line_has_no_one_frame_ramp() -> None:
    sent = chunks(8, 5, 30, batch=True)
    assert [c.frames for c in sent] == [3, 8, 8, 8, 3] and not any(c.ramp for c in sent)
