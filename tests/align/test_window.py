"""A streaming job's window (issue 25's GPU target): however long a take runs and whether or not its words settle,
a job reads at most ``window_sec`` of audio; words unsettled for longer are settled by age, once and in order, and
every word still gets a time at the end."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moss_rt.align.base import AlignJob, AlignResult, WordTime
from moss_rt.align.ctc import CtcAligner, length_groups, write_random_ctc_checkpoint
from moss_rt.align.normalize import tokenize
from moss_rt.align.service import AlignService
from moss_rt.align.track import MIN_WINDOW_SEC, SAID_CHARS_PER_SEC, STREAM_WINDOW_SEC, WordTrack
from moss_rt.config import Settings

RATE = 16000
WINDOW = 3.0
TEXT = " ".join(f"word{chr(97 + i % 26)}{chr(97 + i // 26)}" for i in range(150))  # 150 distinct words


def _stuck(job: AlignJob) -> AlignResult:
    """An aligner that never moves on: a free end reaches the first word and stretches it over all the audio
    (what a random network does); a fixed end spreads the words evenly."""
    seconds = len(job.audio) / RATE
    if job.free_end:
        return AlignResult([(0.0, seconds)])
    share = seconds / len(job.words)
    return AlignResult([(i * share, (i + 1) * share) for i in range(len(job.words))])


def _voiced(seconds: float, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.2, int(seconds * RATE)).astype(np.float32)


def _stream(track: WordTrack, audio: np.ndarray, align, *, chunk: float = 0.64) -> tuple[list[float], list[WordTime]]:
    """Feed ``audio`` in chunks, one job per chunk as the server does; the audio of every job, and the words as a
    client gets them (each batch the words settled since the last)."""
    windows: list[float] = []
    sent: list[WordTime] = []
    step = int(chunk * RATE)
    for at in range(0, len(audio), step):
        track.add_audio(audio[at : at + step])
        before = list(track.words)
        due = track.next_job()
        if due is not None:
            job, pending = due
            windows.append(len(job.audio) / RATE)
            track.apply(pending, align(job))
        assert track.words[: len(before)] == before, "a word once settled never changes"
        sent = list(track.words)
    return windows, sent


def _finish(track: WordTrack, align) -> None:
    while (due := track.next_job(final=True, complete=True)) is not None:
        track.apply(due[1], align(due[0]))


def _in_order(words: list[WordTime]) -> bool:
    return all(w.start < w.end for w in words) and all(a.end <= b.start for a, b in zip(words, words[1:], strict=False))


def test_a_take_whose_words_never_settle_reads_at_most_the_window_per_job() -> None:
    track = WordTrack(TEXT, sample_rate=RATE, input_rate=RATE, window_sec=WINDOW)
    windows, streamed = _stream(track, _voiced(60.0), _stuck)
    assert len(windows) > 40
    assert max(windows) <= WINDOW + 1 / RATE
    # Without the window the last jobs would read the whole take: every word here is settled by age, as placed.
    written = [t.word for t in tokenize(TEXT)]
    assert len(streamed) >= 10
    assert [w.word for w in streamed] == written[: len(streamed)], "each word once, in the text's order"
    assert _in_order(streamed)
    assert all(w.end <= 60.0 for w in streamed)
    assert 60.0 - streamed[-1].end <= WINDOW + 0.64 + 1e-6, "no word waits much longer than the window"
    _finish(track, _stuck)
    assert [w.word for w in track.words] == written, "the end of the take gives every word a time"
    assert track.words[: len(streamed)] == streamed
    assert _in_order(track.words)


def test_a_tail_that_never_settles_is_read_about_twice_whatever_the_takes_length() -> None:
    """What the network computes over in all, for each second of a take the aligner cannot follow: each second is
    read again while it stays in the window, half as often once the tail is longer than clear speech keeps one.
    Without the window it grew with the take (3.6 s per second over 60 s, each job re-reading the whole take)."""
    for seconds in (20.0, 60.0):
        track = WordTrack(TEXT, sample_rate=RATE, input_rate=RATE)
        windows, _ = _stream(track, _voiced(seconds), _stuck)
        assert max(windows) <= STREAM_WINDOW_SEC + 1 / RATE
        assert sum(windows) / seconds <= 2.0


def test_the_network_sees_at_most_the_windows_frames(tmp_path: Path) -> None:
    """The real CTC aligner (tiny random network, whose words mostly never settle): count what goes through it."""
    aligner = CtcAligner(str(write_random_ctc_checkpoint(tmp_path / "ctc", size="tiny")), device="cpu")
    aligner.load()
    rows: list[int] = []
    forward = aligner._forward

    def counted(batch):
        rows.extend(len(audio) for audio in batch)
        return forward(batch)

    aligner._forward = counted  # type: ignore[method-assign]
    track = WordTrack(TEXT, sample_rate=RATE, input_rate=RATE, window_sec=WINDOW)
    windows, streamed = _stream(track, _voiced(30.0, seed=1), lambda job: aligner.align_batch([job])[0])
    assert len(rows) == len(windows) > 20  # one network window per job
    stride = 320  # input samples per emission frame
    assert max(rows) // stride <= WINDOW * RATE / stride + 1
    assert max(rows) / RATE > WINDOW - 0.7, "the window was reached (the test exercises it)"
    _finish(track, lambda job: aligner.align_batch([job])[0])
    assert [w.word for w in track.words] == [t.word for t in tokenize(TEXT)]
    assert _in_order(track.words)


class Truth:
    """An aligner that knows when each word is said (take time) and answers like a good one would."""

    def __init__(self, truth: list[tuple[float, float]], track: WordTrack) -> None:
        self.truth, self.track = truth, track
        self.offset = 0.0

    def __call__(self, job: AlignJob) -> AlignResult:
        offset = self.track.anchor
        end = offset + len(job.audio) / RATE
        pending = [t for t in self.truth if t[1] > offset + 1e-9][: len(job.words)]
        if not job.free_end:
            return AlignResult([(s - offset, e - offset) for s, e in pending])
        return AlignResult([(max(s, offset) - offset, min(e, end) - offset) for s, e in pending if s < end])


def _speech(seconds: float, truth: list[tuple[float, float]]) -> np.ndarray:
    audio = np.zeros(int(seconds * RATE), np.float32)
    noise = _voiced(seconds)
    for s, e in truth:
        audio[int(s * RATE) : int(e * RATE)] = noise[int(s * RATE) : int(e * RATE)]
    return audio


def test_a_pause_longer_than_the_window_is_let_go_and_the_words_after_it_are_found() -> None:
    text = "One two three four."
    truth = [(0.2, 0.6), (0.8, 1.2), (9.0, 9.4), (9.6, 10.0)]  # 7.8 s of silence between "two" and "three"
    track = WordTrack(text, sample_rate=RATE, input_rate=RATE, window_sec=WINDOW)
    windows, streamed = _stream(track, _speech(11.0, truth), Truth(truth, track))
    assert max(windows) <= WINDOW + 1 / RATE
    assert [w.word for w in streamed] == ["One", "two", "three"]
    _finish(track, Truth(truth, track))
    assert [(w.start, w.end) for w in track.words] == truth and not any(w.flags for w in track.words)


def test_audio_that_arrives_at_once_is_read_a_window_at_a_time() -> None:
    """A retake's kept audio, or steps skipped while the aligner was busy: no job reads more than the window, and
    the words in it are found where they are (not estimated)."""
    text = "One two three four five six seven eight."
    truth = [(round(0.3 + 1.4 * i, 3), round(0.9 + 1.4 * i, 3)) for i in range(8)]
    track = WordTrack(text, sample_rate=RATE, input_rate=RATE, window_sec=WINDOW)
    track.add_audio(_speech(11.5, truth))
    aligner = Truth(truth, track)
    windows = []
    while (due := track.next_job()) is not None:
        windows.append(len(due[0].audio) / RATE)
        track.apply(due[1], aligner(due[0]))
    assert len(windows) >= 3 and max(windows) <= WINDOW + 1 / RATE
    assert [(w.start, w.end) for w in track.words] == truth[:7]  # the last one waits for more audio or the end
    _finish(track, aligner)
    assert [(w.start, w.end) for w in track.words] == truth and not any(w.flags for w in track.words)


def test_words_that_settle_on_their_own_are_not_touched_by_the_window() -> None:
    text = "One two three four five."
    truth = [(0.2, 0.5), (0.8, 1.1), (1.5, 1.9), (2.2, 2.6), (3.0, 3.4)]
    track = WordTrack(text, sample_rate=RATE, input_rate=RATE, window_sec=MIN_WINDOW_SEC)  # the smallest there is
    windows, streamed = _stream(track, _speech(4.0, truth), Truth(truth, track))
    assert max(windows) <= MIN_WINDOW_SEC + 1 / RATE
    _finish(track, Truth(truth, track))
    assert [(w.start, w.end) for w in track.words] == truth


def test_a_free_end_job_gets_no_more_words_than_its_audio_can_hold() -> None:
    track = WordTrack(TEXT, sample_rate=RATE, input_rate=RATE)
    track.add_audio(_voiced(1.0))
    job, pending = track.next_job()
    assert job.free_end and 1 <= len(job.words) < 150
    assert sum(len(w) + 1 for w in job.words[:-1]) <= SAID_CHARS_PER_SEC * 1.0
    final, _ = track.next_job(final=True, complete=True)
    assert len(final.words) == 150  # a fixed end gets them all
    cut_short = WordTrack(TEXT, sample_rate=RATE, input_rate=RATE)
    cut_short.add_audio(_voiced(0.3))
    last, _ = cut_short.next_job(final=True, complete=False)
    assert last.free_end and len(last.words) == 150  # the take's last job decides which were said: all go in


def test_batches_are_split_by_length_only_where_padding_costs_more_than_a_call() -> None:
    second = RATE
    assert length_groups([second] * 12, 64, 8 * second) == [(0, 12)]  # equal windows: one call
    # 40 short windows and 20 long ones: padding the short ones to 5 s would compute 160 s of silence.
    assert length_groups([second] * 40 + [5 * second] * 20, 64, 8 * second) == [(0, 40), (40, 60)]
    # ... but not when a call costs more than the padding saved.
    assert length_groups([4 * second] * 4 + [5 * second] * 4, 64, 8 * second) == [(0, 8)]
    groups = length_groups([second] * 10, 4, 0)  # at most max_rows a call, every window once, in order
    assert [a for a, _ in groups[1:]] == [b for _, b in groups[:-1]] and groups[0][0] == 0 and groups[-1][1] == 10
    assert all(0 < b - a <= 4 for a, b in groups)
    assert length_groups([], 64, second) == []


def test_the_window_is_a_setting_of_the_service() -> None:
    assert Settings().aligner_window_sec == STREAM_WINDOW_SEC

    class Fake:
        name, sample_rate, device, workers, max_batch, gather_sec, demo = "fake", RATE, "cpu", 1, 1, 0.0, True

    assert AlignService(Fake(), window_sec=2.5).window_sec == 2.5  # type: ignore[arg-type]
    assert AlignService(Fake(), window_sec=0.0).window_sec == MIN_WINDOW_SEC  # type: ignore[arg-type]
