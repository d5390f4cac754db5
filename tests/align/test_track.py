"""The streaming word track with a scripted aligner: what settles when, stability, estimates, retakes."""

from __future__ import annotations

import numpy as np

from moss_rt.align.base import INTERPOLATED, AlignJob, AlignResult, WordTime, kept_words
from moss_rt.align.track import SAFE_MARGIN_SEC, WordTrack

RATE = 16000


class Scripted:
    """An aligner that knows when each word is said (take time) and answers like a real one would."""

    def __init__(self, truth: list[tuple[float, float]], track: WordTrack) -> None:
        self.truth = truth
        self.track = track

    def run(self, job: AlignJob, offset: float) -> AlignResult:
        end = offset + len(job.audio) / RATE
        pending = [t for t in self.truth if t[1] > offset + 1e-9][: len(job.words)]
        if not job.free_end:
            return AlignResult([(s - offset, e - offset) for s, e in pending])
        reached = [(s - offset, min(e, end) - offset) for s, e in pending if s < end]
        return AlignResult(reached)


def speech(seconds: float, loud: list[tuple[float, float]]) -> np.ndarray:
    audio = np.zeros(int(seconds * RATE), np.float32)
    rng = np.random.default_rng(0)
    for s, e in loud:
        a, b = min(len(audio), int(s * RATE)), min(len(audio), int(e * RATE))
        audio[a:b] = rng.normal(0, 0.2, b - a)
    return audio


def stream(track: WordTrack, audio: np.ndarray, aligner, chunk: float = 0.64) -> list[tuple[float, WordTime]]:
    """Feed ``audio`` in chunks, one job per chunk; (edge when settled, word) for every word settled."""
    out = []
    step = int(chunk * RATE)
    for at in range(0, len(audio), step):
        track.add_audio(audio[at : at + step])
        due = track.next_job()
        if due is not None:
            job, pending = due
            out += [(track.edge, w) for w in track.apply(pending, aligner(job, pending.offset))]
    return out


def finish(track: WordTrack, aligner, *, complete: bool = True) -> list[WordTime]:
    got = []
    while (due := track.next_job(final=True, complete=complete)) is not None:
        job, pending = due
        got += track.apply(pending, aligner(job, pending.offset))
    return got


TEXT = "One two three four five."
TRUTH = [(0.2, 0.5), (0.8, 1.1), (1.5, 1.9), (2.2, 2.6), (3.0, 3.4)]


def test_words_settle_behind_the_edge_in_order_and_never_change() -> None:
    track = WordTrack(TEXT, sample_rate=RATE, input_rate=RATE)
    aligner = Scripted(TRUTH, track)
    settled = stream(track, speech(4.0, TRUTH), aligner.run)
    assert [w.word for _, w in settled] == ["One", "two", "three", "four"]  # the last waits for the end
    for edge, word in settled:
        assert word.end <= edge - SAFE_MARGIN_SEC
        assert edge - word.end <= 1.3
    before = list(track.words)
    finish(track, aligner.run)
    assert track.words[: len(before)] == before
    assert [(w.start, w.end) for w in track.words] == [(s, e) for s, e in TRUTH]
    assert all(not w.flags for w in track.words)


def test_unplaced_words_between_placed_ones_are_interpolated() -> None:
    track = WordTrack(TEXT, sample_rate=RATE, input_rate=RATE)
    track.add_audio(speech(4.0, TRUTH))

    def gappy(job: AlignJob, offset: float) -> AlignResult:
        return AlignResult([(0.2, 0.5), None, None, (2.2, 2.6), (3.0, 3.4)])

    finish(track, gappy)
    words = track.words
    assert [w.flags for w in words] == [(), (INTERPOLATED,), (INTERPOLATED,), (), ()]
    assert words[0].end <= words[1].start < words[2].start < words[2].end <= words[3].start


def test_noise_gets_estimated_words_on_time() -> None:
    """An aligner that places nothing (the tiny model's noise): words still settle while the audio streams."""
    track = WordTrack(TEXT, sample_rate=RATE, input_rate=RATE)
    settled = stream(track, speech(4.0, [(0.0, 4.0)]), lambda job, offset: AlignResult())
    assert settled, "estimated words go out while the take streams"
    assert all(w.flags == (INTERPOLATED,) for _, w in settled)
    assert all(edge - w.end <= 1.3 for edge, w in settled)
    finish(track, lambda job, offset: AlignResult())
    assert [w.word for w in track.words] == ["One", "two", "three", "four", "five"]


def test_silence_is_not_taken_for_words() -> None:
    """A long pause: nothing is estimated into it (the speaker has not said the words yet)."""
    track = WordTrack(TEXT, sample_rate=RATE, input_rate=RATE)
    assert stream(track, speech(3.0, []), lambda job, offset: AlignResult()) == []


def test_a_take_cut_short_keeps_only_the_words_said() -> None:
    track = WordTrack(TEXT, sample_rate=RATE, input_rate=RATE)
    aligner = Scripted(TRUTH, track)
    track.add_audio(speech(1.3, TRUTH))
    finish(track, aligner.run, complete=False)
    assert [w.word for w in track.words] == ["One", "two"]


def test_checkpoint_settles_the_text_so_far() -> None:
    track = WordTrack("One two.", sample_rate=RATE, input_rate=RATE)
    aligner = Scripted(TRUTH, track)
    track.add_audio(speech(1.3, TRUTH[:2]))
    track.checkpoint()
    track.set_text("One two. Three four five.")
    job, pending = track.next_job()  # the checkpoint first, with a fixed end
    assert not job.free_end and [t.word for t in pending.tokens] == ["One", "two"]
    assert [w.word for w in track.apply(pending, aligner.run(job, pending.offset))] == ["One", "two"]
    track.add_audio(speech(4.0, TRUTH)[int(1.3 * RATE) :])
    finish(track, aligner.run)
    assert [w.word for w in track.words] == ["One", "two", "Three", "four", "five"]


def test_retake_keeps_its_parents_words_before_the_branch() -> None:
    parent = WordTrack(TEXT, sample_rate=RATE, input_rate=RATE)
    parent.add_audio(speech(4.0, TRUTH))
    finish(parent, Scripted(TRUTH, parent).run)
    kept = kept_words(parent.words, TEXT, 1.2)
    assert [w.word for w in kept] == ["One", "two"]
    assert kept_words(parent.words, "One TWO three.", 1.2) == kept[:1]  # the text changed from the 2nd word
    retake = WordTrack(TEXT, sample_rate=RATE, input_rate=RATE, kept=kept)
    assert retake.words == kept and retake.anchor == kept[-1].end
    retake.add_audio(speech(4.0, TRUTH))
    finish(retake, Scripted(TRUTH, retake).run)
    assert retake.words[:2] == kept and [w.word for w in retake.words] == ["One", "two", "three", "four", "five"]


def test_pcm_input_is_resampled_and_mixed() -> None:
    track = WordTrack(TEXT, sample_rate=RATE)
    stereo = np.zeros(48000 * 2, dtype="<i2").tobytes()
    track.add_pcm(stereo, 2)
    assert abs(track.edge - 1.0) < 1e-9
    job, _ = track.next_job(final=True, complete=True)
    assert abs(len(job.audio) - RATE) < 64
