"""How often a streaming take's words are aligned, and how much audio each job reads again (issue 25's GPU share):
a job every chunk only while a complete word waits to settle, otherwise every other chunk; the audio in which the
last job found no unsettled word is not read again (but for a short context); a take's end gets its job at once."""

from __future__ import annotations

import numpy as np

from moss_rt.align.base import AlignJob, AlignResult
from moss_rt.align.ctc import PAUSE_SEC, CtcAligner
from moss_rt.align.track import LEFT_CONTEXT_SEC, MAX_STEP_SEC, MIN_STEP_SEC, WordTrack, streaming_job_due

RATE = 16000
CHUNK = 0.64


def test_the_cadence_policy() -> None:
    assert not streaming_job_due(MIN_STEP_SEC / 2, step=MIN_STEP_SEC, word_waiting=True)
    assert streaming_job_due(CHUNK, step=MIN_STEP_SEC, word_waiting=True)  # a complete word waits: every chunk
    assert not streaming_job_due(CHUNK, step=MIN_STEP_SEC, word_waiting=False)  # nothing waits: skip a chunk
    assert streaming_job_due(2 * CHUNK, step=MIN_STEP_SEC, word_waiting=False)  # … but not two
    assert MAX_STEP_SEC <= 2 * CHUNK
    # Close to the window's end, waiting would settle words by age from a stale reading: no skipping.
    assert streaming_job_due(CHUNK, step=MIN_STEP_SEC, word_waiting=False, room_sec=MAX_STEP_SEC / 2)


class Truth:
    """Answers like a trained aligner: the words said so far (clipped at the edge), a pause after the last one."""

    def __init__(self, truth: list[tuple[float, float]]) -> None:
        self.truth = truth

    def __call__(self, job: AlignJob, offset: float) -> AlignResult:
        end = offset + len(job.audio) / RATE
        pending = [t for t in self.truth if t[1] > offset + 1e-9][: len(job.words)]
        if not job.free_end:
            return AlignResult([(s - offset, e - offset) for s, e in pending])
        spans = [(max(s, offset) - offset, min(e, end) - offset) for s, e in pending if s < end]
        paused = bool(spans) and end - offset - spans[-1][1] >= PAUSE_SEC
        return AlignResult(spans, len(spans) if paused else None)


def _voiced(seconds: float, truth: list[tuple[float, float]]) -> np.ndarray:
    audio = np.zeros(int(seconds * RATE), np.float32)
    noise = np.random.default_rng(0).normal(0, 0.2, len(audio)).astype(np.float32)
    for s, e in truth:
        audio[int(s * RATE) : int(e * RATE)] = noise[int(s * RATE) : int(e * RATE)]
    return audio


def _jobs(text: str, truth: list[tuple[float, float]], seconds: float) -> tuple[WordTrack, list[tuple[float, float]]]:
    """Stream in 0.64 s chunks; (edge, job audio start) of every job."""
    track = WordTrack(text, sample_rate=RATE, input_rate=RATE)
    aligner = Truth(truth)
    audio = _voiced(seconds, truth)
    jobs = []
    step = int(CHUNK * RATE)
    for at in range(0, len(audio), step):
        track.add_audio(audio[at : at + step])
        if (due := track.next_job()) is not None:
            jobs.append((round(track.edge, 2), round(due[1].offset, 3)))
            track.apply(due[1], aligner(due[0], due[1].offset))
    return track, jobs


def test_a_word_still_said_at_the_edge_skips_a_chunk_and_a_complete_one_does_not() -> None:
    # "two" runs over the 1.28 s edge (still being said): no job at 1.92. At 2.56 everything said is settled
    # (a pause after "two"): no job at 3.2. At 3.84 "four" is complete but unsettled (0.24 s since, no next word
    # yet): the very next chunk gets a job.
    truth = [(0.1, 0.5), (0.6, 1.5), (2.7, 3.05), (3.25, 3.6), (4.0, 4.3)]
    track, jobs = _jobs("One two three four five.", truth, 5.12)
    edges = [edge for edge, _ in jobs]
    assert 1.28 in edges and 1.92 not in edges and 2.56 in edges  # skipped while "two" was still said
    assert 3.2 not in edges and 3.84 in edges and 4.48 in edges
    settled = [w.word for w in track.words]
    assert settled[:4] == ["One", "two", "three", "four"]
    assert len(jobs) < 5.12 / CHUNK  # fewer jobs than chunks


def test_audio_with_no_unsettled_word_is_not_read_again() -> None:
    # A long pause after "two": once it settles, each job starts a context before the edge's last 0.3 s, not at
    # the end of "two".
    truth = [(0.1, 0.5), (0.6, 1.0), (4.0, 4.4)]
    track, jobs = _jobs("One two three.", truth, 5.12)
    two_end = 1.0
    later = [offset for edge, offset in jobs if edge > 2.0]
    assert later and all(offset > two_end + 0.4 for offset in later)  # not from the end of "two"
    assert all(edge - offset <= CHUNK * 2 + 0.3 + LEFT_CONTEXT_SEC + 1e-6 for edge, offset in jobs if edge > 2.0)
    assert [w.word for w in track.words][:2] == ["One", "two"]
    # The take's end: its last job at once, even right after a streaming one ("three" is still being said).
    track, _ = _jobs("One two three.", truth, 4.16)
    assert track.next_job() is None
    due = track.next_job(final=True, complete=True)
    assert due is not None
    track.apply(due[1], Truth(truth)(due[0], due[1].offset))
    assert [w.word for w in track.words] == ["One", "two", "three"]


def test_the_ctc_aligner_reports_a_pause_after_the_last_word(tmp_path) -> None:
    from moss_rt.align.ctc import write_random_ctc_checkpoint

    write_random_ctc_checkpoint(tmp_path / "ctc", size="tiny")
    aligner = CtcAligner(str(tmp_path / "ctc"), device="cpu")
    aligner.load()
    vocab = aligner._vocab
    frames, sec = 100, 0.02  # 2 s of emissions

    def emissions(letters_at: dict[int, str]) -> np.ndarray:
        lp = np.full((frames, len(vocab)), -20.0, np.float32)
        lp[:, aligner._blank] = 0.0
        for t, c in letters_at.items():
            lp[t, :] = -20.0
            lp[t, vocab[c]] = 0.0
        return lp

    job = AlignJob(np.zeros(int(frames * sec * RATE), np.float32), ("ab", "cd"), free_end=True)
    spelling = aligner._spell(job.words)
    paused = aligner._place(job, spelling, emissions({10: "a", 12: "b"}))  # then 1.74 s of blanks
    assert len(paused.spans) == 1 and paused.settled == 1
    speaking = aligner._place(job, spelling, emissions({10: "a", 12: "b", 93: "|", 95: "c"}))  # "cd" under way
    assert speaking.settled is None
    just_ended = aligner._place(job, spelling, emissions({80: "a", 90: "b"}))  # 0.18 s since: maybe a breath
    assert just_ended.settled is None
