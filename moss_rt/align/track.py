"""The words of one take while its audio arrives (sans-I/O): which audio to align next, and which words are settled.

Earlier words never change once sent, so the track only settles ("commits") a word when later audio makes it safe:

- **streaming** (audio still arriving): the audio from the end of the last committed word (the *anchor*) to the
  edge is aligned against the words not committed yet, with a free end (:attr:`AlignJob.free_end`). A word is
  committed when the aligner has moved on past it (it is not the last word reached) and it ends at least
  ``SAFE_MARGIN_SEC`` before the edge. Every job covers only the uncommitted tail.
- **settled by age**: the uncommitted tail is at most ``window_sec`` of audio (``STREAM_WINDOW_SEC`` by default):
  when the edge moves further from the anchor than that, the words the last job reached that start before
  ``edge - window_sec`` are committed as that job placed them, and audio before that point in which it found no
  word is let go (the anchor moves up to it). A job's audio, what a GPU aligner's network computes over, is
  therefore bounded whatever the take's length and whether or not its words settle (noise, music, a whisper, a
  model that cannot follow the voice); so are its words (``SAID_CHARS_PER_SEC``), what a Viterbi pass walks. A tail
  unsettled for longer than clear speech ever keeps one (``SLOW_AFTER_SEC``) is read half as often.
- **lost**: when the aligner reaches no word at all in ``LOST_SEC`` of voiced audio (noise such as the tiny demo
  model's, another language, singing), the words are placed by a speaking-rate estimate over the voiced audio and
  flagged ``interpolated``; the take's words keep arriving on time.
- **checkpoints** (a take fed with text: a continuation ended): the text handed out so far is all in the audio so
  far, so it is aligned with a fixed end and committed whole.
- **final**: a take that ended ``done`` says its whole text; the rest is aligned with a fixed end and every word
  gets a time (unplaced ones interpolated between their neighbours). A take cut short (cancelled, replaced,
  max_frames…) keeps only the words the audio reached.

Times are seconds from the take's sample 0. A retake starts with the words of its parent that end before the
branch point (and match its text): they are the take's first words, already committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import soxr

from moss_rt.align.base import INTERPOLATED, AlignJob, AlignResult, Span, WordTime
from moss_rt.align.normalize import Token, tokenize

SAFE_MARGIN_SEC = 0.15  # a word settles once it ends this far behind the audio edge (and the aligner moved on)
MIN_STEP_SEC = 0.3  # new audio before the next streaming job
STEP_FRACTION = 0.25  # … or this share of the uncommitted window, when that is longer (bounds the work)
# A tail left unsettled for longer than words take on clear speech (a job reads 2.1 s at most streaming the espeak-ng
# fixture) is audio the aligner cannot follow (noise, music, a whisper): reading it again every chunk buys nothing, so
# it is read half as often (its words are still settled by age on every step).
SLOW_AFTER_SEC = 2.5
SLOW_STEP_FRACTION = 0.5
LOST_SEC = 0.3  # voiced audio with no word reached before the words are placed by estimate
CHARS_PER_SEC = 14.0  # speaking rate of the estimate (letters and word gaps of conversational English)
VOICED_RMS = 0.01  # a 20 ms frame louder than this (-40 dBFS) is voiced
FRAME_SEC = 0.02
MIN_WORD_SEC = 0.02
TAIL_DB = -30.0  # the end of a word: its last 10 ms within this of its loudest
TAIL_FLOOR = 10 ** (-55 / 20)
ONSET_SEC = 0.15
# A streaming job aligns at most this much audio: words that have been unsettled longer are settled by age (the
# module docstring). Long enough that the words a real aligner settles normally never reach it (they settle within
# about a second), short enough to bound a job's work. Settings.aligner_window_sec sets it for the service.
STREAM_WINDOW_SEC = 5.0
# The smallest window: a word, the pause after it and the margin must fit (on the espeak-ng fixture 1.5 s keeps the
# streamed accuracy, 1.2 s already cuts words apart: a start off by 0.6 s).
MIN_WINDOW_SEC = 1.5
# Nobody says more letters than this a second: a free-end job is handed no more words than its audio could hold.
SAID_CHARS_PER_SEC = 3 * CHARS_PER_SEC
# The cadence (:func:`streaming_job_due`): a streaming job is due every MIN_STEP_SEC of new audio (every 0.64 s chunk)
# only while a word waits to settle, one the last job found complete (it ends before that job's edge) but could not
# settle yet: its latency clock runs. When the last job's words all settled, or the one it left runs on to its edge
# (within IN_PROGRESS_SEC: still being said, it ends in later audio, so the next job but one settles it as early), the
# next job waits for MAX_STEP_SEC of new audio (two chunks). Only a word touching the edge counts as still said: a
# word that ended 20 ms before it is held by this chunk, and waiting two chunks would make it a chunk late.
MAX_STEP_SEC = 1.0
IN_PROGRESS_SEC = 0.001
# Re-reading less (:meth:`WordTrack._let_go_unspoken`): after a streaming job that followed the voice, the audio from
# the anchor up to the first word it left unsettled (or up to KEEP_TAIL_SEC before its edge, when it left none) held
# no word: the next job starts there, less LEFT_CONTEXT_SEC of context. On the espeak-ng fixture streamed with
# PocketSphinx 0.3/0.15 keep the accuracy (mean 4.0 ms, worst start 8 ms); a shorter tail (0.25) already moved a
# start by 48 ms.
KEEP_TAIL_SEC = 0.3
LEFT_CONTEXT_SEC = 0.15


def streaming_job_due(new_audio_sec: float, *, step: float, word_waiting: bool, room_sec: float = float("inf")) -> bool:
    """Whether a streaming take's next job is due, ``new_audio_sec`` of audio after the last one began (its edge).

    ``step``: the least new audio for any job (``MIN_STEP_SEC``, or a share of a long unsettled window). While a word
    waits to settle (``word_waiting``: the last job found it complete but could not settle it) a job is due at every
    step, so the word goes out a chunk after the one holding it. Otherwise at ``MAX_STEP_SEC`` of new audio: the word
    the last job left still being said ends in the coming audio, and the job after it settles it as early; unless
    ``room_sec`` (the window's room left: ``window_sec`` less the unsettled audio) is under ``MAX_STEP_SEC``, where
    waiting would settle words by age from a stale reading (on the fixture with a 1.5 s window a start moved 178 ms).
    A take that ends (``next_job(final=True)``) or a checkpoint gets its job at once, whatever this says."""
    if new_audio_sec < step:
        return False
    return word_waiting or new_audio_sec >= max(step, MAX_STEP_SEC) or room_sec < MAX_STEP_SEC


@dataclass(frozen=True)
class Pending:
    """What one job covers, to read its result back."""

    tokens: tuple[Token, ...]
    offset: float  # take time of the job's first sample
    end: float  # take time just after its last sample
    fixed_end: bool  # all of ``tokens`` are in the audio (a checkpoint, or the end of a take that said its text)
    final: bool  # the take is over: nothing after this job
    chars: int  # the text up to here is settled once this job is applied


@dataclass(frozen=True)
class _Guess:
    """How the last streaming job placed the words it reached but did not settle (take time): what settling by
    age commits."""

    tokens: tuple[Token, ...]
    spans: tuple[Span, ...]  # per token of ``tokens``
    offset: float  # take time the job's audio began at (the anchor then)
    seen: float  # take time the job's audio ran to


def _weight(token: Token) -> int:
    return sum(len(w) for w in token.spoken) + 1


class WordTrack:
    """One take's words: feed its audio (:meth:`add_pcm`) and text (:meth:`set_text`); run the jobs
    :meth:`next_job` hands out on an aligner and give the results to :meth:`apply`, which answers the words it
    committed (in order, never changed afterwards)."""

    def __init__(
        self,
        text: str,
        *,
        sample_rate: int,
        input_rate: int = 48000,
        kept: Sequence[WordTime] = (),
        window_sec: float = STREAM_WINDOW_SEC,
    ) -> None:
        self.sample_rate = sample_rate
        self.window_sec = max(MIN_WINDOW_SEC, float(window_sec))  # a streaming job's audio at most
        self._input_rate = input_rate
        self._resamplers: dict[int, soxr.ResampleStream] = {}
        self.words: list[WordTime] = list(kept)
        self._chars_done = kept[-1].chars[1] if kept and kept[-1].chars else 0
        self._anchor = kept[-1].end if kept else 0.0
        self._audio = np.zeros(0, dtype=np.float32)
        self._origin = 0.0  # take time of self._audio[0]
        self._received = 0  # input samples per channel so far
        self._text = text
        self._tokens: list[Token] | None = None
        self._checkpoints: list[tuple[float, int]] = []  # (edge, text length) at each one
        self._last_job_edge = self._anchor
        self._finished = False
        self._lost = False  # the aligner reaches no word in this audio: words are estimated as it streams
        self._guess: _Guess | None = None
        self._word_waiting = True  # the last streaming job left a complete word unsettled (see streaming_job_due)

    # ------------------------------------------------------------------ inputs

    @property
    def edge(self) -> float:
        """Take time of the end of the audio received so far."""
        return self._received / self._input_rate

    @property
    def anchor(self) -> float:
        """Take time where the unsettled audio begins (the last settled word's end, or later: see settling by age)."""
        return self._anchor

    @property
    def text(self) -> str:
        return self._text

    def set_text(self, text: str) -> None:
        if text != self._text:
            self._text = text
            self._tokens = None

    def add_pcm(self, pcm: bytes, channels: int) -> None:
        """The take's next int16 PCM (interleaved when stereo) at the input rate."""
        samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
        if channels > 1:
            samples = samples.reshape(-1, channels).mean(axis=1)
        self._received += len(samples)
        if self._input_rate != self.sample_rate:
            stream = self._resamplers.setdefault(
                channels, soxr.ResampleStream(self._input_rate, self.sample_rate, 1, dtype="float32")
            )
            samples = stream.resample_chunk(samples)
        self._audio = np.concatenate([self._audio, samples.astype(np.float32, copy=False)])

    def add_audio(self, samples: np.ndarray) -> None:
        """Mono float32 audio already at the aligner's rate (a whole file for ``POST /api/align``)."""
        self._received += int(round(len(samples) * self._input_rate / self.sample_rate))
        self._audio = np.concatenate([self._audio, np.asarray(samples, dtype=np.float32)])

    def _flush_resampler(self) -> None:
        """The resampler's last few ms (its filter holds them back until told the audio ended)."""
        for stream in self._resamplers.values():
            tail = stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)
            self._audio = np.concatenate([self._audio, tail.astype(np.float32, copy=False)])
        self._resamplers.clear()

    def checkpoint(self) -> None:
        """The text set so far is all said in the audio received so far (a continuation of a fed take ended)."""
        self._checkpoints.append((self.edge, len(self._text)))

    # ------------------------------------------------------------------ jobs

    def _pending_tokens(self, chars: int | None = None) -> tuple[Token, ...]:
        if self._tokens is None:
            self._tokens = tokenize(self._text)
        limit = len(self._text) if chars is None else chars
        return tuple(t for t in self._tokens if t.start >= self._chars_done and t.end <= limit)

    def _window(self, end: float) -> np.ndarray:
        first = max(0, int(round((self._anchor - self._origin) * self.sample_rate)))
        last = max(first, int(round((end - self._origin) * self.sample_rate)))
        return self._audio[first:last]

    def next_job(self, *, final: bool = False, complete: bool = False) -> tuple[AlignJob, Pending] | None:
        """The next alignment to run, or None when nothing is due. ``final``: the take is over (``complete``: it
        said its whole text); call until it answers None, then the track is done."""
        if self._finished:
            return None
        if final:
            self._flush_resampler()
        if self._checkpoints:
            edge, chars = self._checkpoints[0]
            tokens = self._pending_tokens(chars)
            if not tokens:
                self._checkpoints.pop(0)
                self._chars_done = max(self._chars_done, chars)
                return self.next_job(final=final, complete=complete)
            return self._job(tokens, edge, fixed_end=True, final=False, chars=chars)
        tokens = self._pending_tokens()
        if final:
            if not tokens:
                self._finished = True
                return None
            return self._job(tokens, self.edge, fixed_end=complete, final=True, chars=len(self._text))
        end = self.edge
        if tokens and end - self._anchor > self.window_sec:
            self._settle_by_age(tokens, end - self.window_sec)
            tokens = self._pending_tokens()
            # Still further back: audio no job has read. It is read from the anchor on, a window at a time.
            end = min(end, self._anchor + self.window_sec)
        window = end - self._anchor
        fraction = STEP_FRACTION if window <= SLOW_AFTER_SEC else SLOW_STEP_FRACTION
        step = max(MIN_STEP_SEC, fraction * window)
        if not tokens or window < MIN_STEP_SEC:
            return None
        due = streaming_job_due(
            self.edge - self._last_job_edge, step=step, word_waiting=self._word_waiting,
            room_sec=self.window_sec - (self.edge - self._anchor),
        )  # fmt: skip
        if not due:
            return None
        return self._job(tokens, end, fixed_end=False, final=False, chars=len(self._text))

    def _job(
        self, tokens: tuple[Token, ...], end: float, *, fixed_end: bool, final: bool, chars: int
    ) -> tuple[AlignJob, Pending]:
        self._last_job_edge = end
        if not fixed_end and not final:
            # A free end reaches only the words said in the audio: no more are handed over than it could hold. Not
            # the take's last job: it says which words were said at all (those it does not get, never were), and
            # after streaming jobs settled the rest its audio may be a fraction of a second holding several.
            budget = SAID_CHARS_PER_SEC * (end - self._anchor)
            keep, weight = 1, _weight(tokens[0])
            while keep < len(tokens) and weight + _weight(tokens[keep]) <= budget:
                weight += _weight(tokens[keep])
                keep += 1
            tokens = tokens[:keep]
        spoken = tuple(w for t in tokens for w in t.spoken)
        audio = self._window(end).copy()
        pending = Pending(tokens, self._anchor, end, fixed_end, final, chars)
        return AlignJob(audio, spoken, free_end=not fixed_end), pending

    # ------------------------------------------------------------------ results

    def apply(self, pending: Pending, result: AlignResult) -> list[WordTime]:
        """Commit what the job's result settles; returns those words (possibly none)."""
        if pending.offset != self._anchor:
            return []  # a stale result (something was committed since the job was handed out)
        spans, reached = self._token_spans(pending, result)
        self._guess = None
        if pending.fixed_end:
            times = self._filled(pending, spans, len(pending.tokens), hi=pending.end)
            committed = self._commit(pending.tokens, times, spans)
            if pending.final:
                self._finished = True
            else:
                self._checkpoints.pop(0)
                self._chars_done = max(self._chars_done, pending.chars)
            return committed
        if pending.final:
            # Cut short: the words reached are said (the last one perhaps only begun); the rest never were.
            last_placed = max((i for i, s in enumerate(spans[:reached]) if s is not None), default=-1)
            count = last_placed + 1
            committed = self._commit(pending.tokens[:count], self._filled(pending, spans, count), spans)
            if not committed:
                committed = self._estimate(pending.tokens, pending, upto=pending.end)
            self._finished = True
            return committed
        # Streaming: settle the words the aligner moved past that end safely behind the edge.
        limit = pending.end - SAFE_MARGIN_SEC
        candidates = max(0, reached - 1)
        if result.settled is not None and result.settled >= reached > 0 and self._audible(spans[reached - 1]):
            # The aligner is in a pause after the last word it reached: that word is over too. Only for a word
            # that is clearly sound: a free end likes to put the next word into the breath before the edge.
            candidates = reached
        last_placed = max((i for i, s in enumerate(spans[:candidates]) if s is not None), default=-1)
        times = self._filled(pending, spans, last_placed + 1)
        count = 0
        while count < len(times) and times[count][1] <= limit:
            count += 1
        committed = self._commit(pending.tokens[:count], times[:count], spans)
        if reached:
            self._lost = False
        elif not committed:
            # Nothing reached: lost once LOST_SEC of voiced audio says so, and then until the aligner finds a word.
            committed = self._estimate(pending.tokens, pending, upto=limit, lost_only=not self._lost)
            self._lost = self._lost or bool(committed)
        done = len(committed)  # a prefix of the job's tokens; the rest it reached is what settling by age uses
        self._guess = _Guess(pending.tokens[done:reached], tuple(spans[done:reached]), pending.offset, pending.end)
        # A word waits to settle (the next chunk gets a job) unless the job reached words and left none unsettled
        # but one still being said at its edge. Lost, or nothing reached yet: every chunk, as the estimate needs.
        # Silence (no voiced frame from the anchor to the kept tail, nothing reached): no word to wait for either.
        silent = (
            not reached and not committed and len(self._voiced_times(self._anchor, pending.end - KEEP_TAIL_SEC)) == 0
        )
        self._word_waiting = (
            (not reached and not silent) or self._lost
            or any(span is None or span[1] < pending.end - IN_PROGRESS_SEC for span in spans[done:reached])
        )  # fmt: skip
        if reached or silent:
            self._let_go_unspoken(pending, spans[done:reached])
        return committed

    def _let_go_unspoken(self, pending: Pending, unsettled: Sequence[Span]) -> None:
        """The job followed the voice (it reached a word): the audio it read from the anchor up to the first word it
        left unsettled, or up to ``KEEP_TAIL_SEC`` before its edge when it left none (a word's onset the aligner has
        not reached yet may lie there), holds no word. The next job starts there, less ``LEFT_CONTEXT_SEC`` of
        context: the pause after a settled word is not read again and again."""
        if unsettled and unsettled[0] is None:
            return  # a word it reached but could not place lies somewhere after the anchor
        stop = pending.end - KEEP_TAIL_SEC
        if unsettled:
            stop = min(stop, unsettled[0][0])  # type: ignore[index]
        stop -= LEFT_CONTEXT_SEC
        if stop > self._anchor:
            # (the job's reading, self._guess, keeps its offset: it did not start at the new anchor, so settling by
            # age does not take it for a job that settled nothing)
            self._anchor = stop
            self._trim()

    def _settle_by_age(self, tokens: tuple[Token, ...], cut: float) -> list[WordTime]:
        """The unsettled audio began more than ``window_sec`` ago (before ``cut``): commit the words the last
        streaming job reached that start before ``cut``, as it placed them (unplaced ones among them shared out
        between their neighbours), then let go of the audio up to ``cut`` in which it found no other word (up to
        the next word it placed, at most).

        Audio no job has read yet (a retake's kept audio, steps skipped while the aligner's queue was full) is not
        let go: the next job reads it from the anchor, a window at a time. A word such a job (one that ended
        before the edge) reached at its very end may go on after it, so it waits for the next window, unless that
        job settled nothing at all: then its first word is committed as placed, so every window moves on."""
        guess = self._guess or _Guess((), (), self._anchor, self._anchor)
        spans: list[Span] = []
        for token, guessed, span in zip(tokens, guess.tokens, guess.spans, strict=False):
            if token != guessed:
                break  # the text changed from here (a take fed with text): that reading is not this word's
            spans.append(span)
        last_placed = max((i for i, s in enumerate(spans) if s is not None), default=-1)
        pending = Pending(tokens, self._anchor, max(guess.seen, self._anchor), False, False, len(self._text))
        times = self._filled(pending, spans, last_placed + 1)
        read_to_edge = guess.seen >= cut
        count = 0
        while count < len(times) and times[count][0] < cut:
            if not read_to_edge and times[count][1] > guess.seen - SAFE_MARGIN_SEC:
                break  # it may go on after what the job read
            count += 1
        if count == 0 and times and not read_to_edge and guess.offset == self._anchor:
            count = 1  # that job settled nothing: its first word is, so the next window starts further on
        committed = self._commit(tokens[:count], times[:count], spans)
        # What it read up to the cut holds no other word before the next one it placed: let that audio go.
        stop = min(cut, guess.seen, *(span[0] for span in guess.spans[count:] if span is not None))
        if self._anchor < stop:
            self._anchor = stop
            self._trim()
        left = _Guess(guess.tokens[count:], guess.spans[count:], guess.offset, guess.seen)
        self._guess = left if count < len(spans) else None
        return committed

    def _token_spans(self, pending: Pending, result: AlignResult) -> tuple[list[Span], int]:
        """Per token: the span of its spoken words (take time), and how many tokens the aligner reached."""
        spans: list[Span] = []
        reached = 0
        at = 0
        got = result.spans
        for token in pending.tokens:
            n = len(token.spoken)
            mine = [s for s in got[at : at + n] if s is not None]
            if at < len(got):
                reached += 1
            if mine:
                span = (pending.offset + min(s[0] for s in mine), pending.offset + max(s[1] for s in mine))
                spans.append(self._tightened(span))
            else:
                spans.append(None)
            at += n
        return spans, reached

    def _audible(self, span: Span) -> bool:
        if span is None:
            return False
        first = max(0, int(round((span[0] - self._origin) * self.sample_rate)))
        last = min(len(self._audio), int(round((span[1] - self._origin) * self.sample_rate)))
        hop = self.sample_rate // 100
        n = (last - first) // hop
        if n < 1:
            return False
        frames = self._audio[first : first + n * hop].reshape(n, hop)
        return float(np.sqrt(np.mean(frames**2, axis=1)).max()) >= VOICED_RMS

    def _tightened(self, span: tuple[float, float]) -> tuple[float, float]:
        """A placed word trimmed to where it is audible: an aligner's word often runs on into the breath, room noise
        or pause beside it (``TAIL_DB`` below the word's loudest part), which no caption should show. At most half
        the word goes at either end."""
        start, end = span
        hop = self.sample_rate // 100
        first = int(round((start - self._origin) * self.sample_rate))
        # (never past the audio held: a resampler holds its last few ms back until the take ends)
        last = min(len(self._audio), int(round((end - self._origin) * self.sample_rate)))
        n = (last - max(first, 0)) // hop
        if first < 0 or n < 2:
            return span
        frames = self._audio[first : first + n * hop].reshape(n, hop)
        rms = np.sqrt(np.mean(frames**2, axis=1))
        floor = max(float(rms.max()) * 10 ** (TAIL_DB / 20), TAIL_FLOOR)
        audible = np.flatnonzero(rms >= floor)
        if len(audible) == 0:
            return span
        kept = max(int(audible[-1]) + 1, (n + 1) // 2)
        end = min(end, start + kept * hop / self.sample_rate)
        # Its start moved up to its first audible 10 ms (the pause before it is not the word either).
        lead = min(int(audible[0]), n // 2)
        start += lead * hop / self.sample_rate
        # Its start pulled back over audible audio just before it (a soft onset the aligner took for silence),
        # never before the last settled word's end nor more than ONSET_SEC.
        earliest = max(self._anchor, self._origin, start - ONSET_SEC)
        while start - hop / self.sample_rate >= earliest - 1e-9:
            at = int(round((start - self._origin) * self.sample_rate)) - hop
            if at < 0 or float(np.sqrt(np.mean(self._audio[at : at + hop] ** 2))) < floor:
                break
            start -= hop / self.sample_rate
        return start, end

    def _filled(
        self, pending: Pending, spans: Sequence[Span], count: int, hi: float | None = None
    ) -> list[tuple[float, float]]:
        """The first ``count`` tokens' times: placed ones as placed (kept in order), unplaced ones shared out between
        their placed neighbours by length (or up to ``hi`` after the last placed one)."""
        out: list[tuple[float, float]] = []
        i = 0
        prev_end = self._anchor
        while i < count:
            span = spans[i]
            if span is not None:
                start = max(span[0], prev_end)
                end = max(span[1], start + MIN_WORD_SEC)
                out.append((start, end))
                prev_end = end
                i += 1
                continue
            j = i
            while j < count and spans[j] is None:
                j += 1
            if j < len(spans) and j < count and spans[j] is not None:
                upper = spans[j][0]  # type: ignore[index]
            else:
                upper = pending.end if hi is None else hi
            out += self._share(pending.tokens[i:j], prev_end, max(upper, prev_end), pending)
            prev_end = out[-1][1]
            i = j
        return out

    def _share(self, tokens: Sequence[Token], lo: float, hi: float, pending: Pending) -> list[tuple[float, float]]:
        """``tokens`` laid out over the voiced audio between ``lo`` and ``hi`` in proportion to their length."""
        voiced = self._voiced_times(lo, hi)
        weights = np.array([_weight(t) for t in tokens], dtype=np.float64)
        edges = np.concatenate([[0.0], np.cumsum(weights) / weights.sum()])
        if len(voiced) == 0:
            points = lo + edges * (hi - lo)
        else:
            idx = np.minimum((edges * len(voiced)).astype(int), len(voiced) - 1)
            points = voiced[idx]
            points[0], points[-1] = max(lo, points[0]), min(hi, voiced[-1] + FRAME_SEC)
        out = []
        for k in range(len(tokens)):
            start = float(points[k])
            end = float(max(points[k + 1], start + MIN_WORD_SEC))
            out.append((start, end))
        return out

    def _voiced_times(self, lo: float, hi: float) -> np.ndarray:
        """Start times of the voiced 20 ms frames between ``lo`` and ``hi`` (take time)."""
        first = max(0, int(round((lo - self._origin) * self.sample_rate)))
        last = max(first, int(round((hi - self._origin) * self.sample_rate)))
        audio = self._audio[first:last]
        hop = int(FRAME_SEC * self.sample_rate)
        n = len(audio) // hop
        if n == 0:
            return np.zeros(0)
        rms = np.sqrt(np.mean(audio[: n * hop].reshape(n, hop) ** 2, axis=1))
        return self._origin + (first + np.flatnonzero(rms > VOICED_RMS) * hop) / self.sample_rate

    def _estimate(
        self, tokens: Sequence[Token], pending: Pending, *, upto: float, lost_only: bool = False
    ) -> list[WordTime]:
        """The aligner reached nothing: place words at the speaking rate over the voiced audio from the anchor,
        committing those that end before ``upto`` (flagged interpolated)."""
        voiced = self._voiced_times(self._anchor, upto)
        if lost_only and len(voiced) * FRAME_SEC < LOST_SEC:
            return []  # silence, or too little to say the aligner is lost: wait
        times: list[tuple[float, float]] = []
        spoken_sec = 0.0
        for token in tokens:
            start_at = int(spoken_sec / FRAME_SEC)
            spoken_sec += _weight(token) / CHARS_PER_SEC
            end_at = int(spoken_sec / FRAME_SEC)
            if end_at > len(voiced):
                break
            start = float(voiced[min(start_at, len(voiced) - 1)])
            end = float(voiced[end_at - 1] + FRAME_SEC) if end_at > 0 else start + MIN_WORD_SEC
            times.append((start, end))
        return self._commit(tokens[: len(times)], times, [None] * len(times))

    def _commit(
        self, tokens: Sequence[Token], times: Sequence[tuple[float, float]], spans: Sequence[Span]
    ) -> list[WordTime]:
        out: list[WordTime] = []
        prev_end = self.words[-1].end if self.words else 0.0
        for token, (start, end), span in zip(tokens, times, spans, strict=False):
            start = max(start, prev_end)
            end = max(end, start + MIN_WORD_SEC)
            word = WordTime(
                token.word, round(start, 3), round(end, 3), () if span is not None else (INTERPOLATED,),
                token.written, (token.start, token.end),
            )  # fmt: skip
            out.append(word)
            prev_end = word.end
        if out:
            self.words += out
            self._chars_done = max(self._chars_done, tokens[len(out) - 1].end)
            self._anchor = out[-1].end
            self._trim()
        return out

    def _trim(self) -> None:
        """Audio before the anchor is never aligned again."""
        drop = int((self._anchor - self._origin) * self.sample_rate)
        if drop > 0:
            self._audio = self._audio[drop:]
            self._origin += drop / self.sample_rate
