"""The offline aligner: PocketSphinx's forced alignment with the US English acoustic model its wheel ships.

Nothing to download and no GPU: it runs on a CPU core, about 0.2 s of CPU per 10 s of speech. The text's words are
looked up in the CMU pronouncing dictionary that comes with the model; a word it lacks is spelled letter by letter
when it looks like an acronym (``GPU``, ``MP``), else it is left unplaced (the caller interpolates it). Only English
is modelled: other languages leave most words unplaced.

Silence between words is made likely (``silprob`` 1.0, PocketSphinx's default is 0.005): without it the aligner
stretches a word over the pause next to it, and a word's start can land half a second early; a phone insertion
penalty (``pip`` 0.5) keeps a short word from being squeezed into the breath after a long one. Both were chosen on
espeak-ng speech with known boundaries and checked on sentences held out from that choice: see docs/words.md.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np

from moss_rt.align.base import AlignJob, AlignResult, Span

log = logging.getLogger(__name__)

FRAME_RATE = 100  # PocketSphinx feature frames per second
SILENCE_PROB = 1.0
PHONE_PENALTY = 0.5
PAUSE_FRAMES = 35  # 0.35 s of silence after a word: the speaker has moved on (a shorter pause may be a breath the
# free end took for the next word; that word then moves to its real place once the audio reaches it)
MIN_SAMPLES = 1600
NOISE_FLOOR = 3e-4  # 0.1 s: shorter audio holds no word it could place
_ALT_PRON = re.compile(r"\(\d+\)$")
_LETTERS = re.compile(r"^[a-z]{1,6}$")


class PocketsphinxAligner:
    """Forced alignment with PocketSphinx; one decoder per worker (a decoder is not thread-safe).

    PocketSphinx holds Python's GIL while it decodes, so in the service (``processes=True``) each worker's
    decoding runs in a process of its own: the event loop and the engine's thread keep running meanwhile.
    ``processes=False`` decodes in the calling thread (tests, benchmarks, tools).
    """

    name = "pocketsphinx"
    sample_rate = 16000
    device = "cpu"
    max_batch = 1
    gather_sec = 0.0  # one job per decoder: nothing to gather
    demo = False

    def __init__(self, *, workers: int = 2, processes: bool = False) -> None:
        self.workers = workers
        self._local = threading.local()
        self._processes = processes
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def load(self) -> None:
        if not self._processes:
            self._decoder()  # fails here, at start, if the package or its model is missing
            return
        # The worker processes start with the first alignment (a server that is never asked for words spends
        # nothing on them); here only that the package and its model are there.
        import pocketsphinx

        model = Path(pocketsphinx.get_model_path()) / "en-us"
        missing = [n for n in ("en-us", "cmudict-en-us.dict") if not (model / n).exists()]
        if missing:
            raise FileNotFoundError(f"pocketsphinx's English model lacks {missing} in {model}")

    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                # spawn, not fork: the server has threads (the engine's, the loop's) a fork would copy mid-flight.
                context = multiprocessing.get_context("spawn")
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    self.workers, mp_context=context, initializer=_leave_with_parent, initargs=(os.getpid(),)
                )
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _decoder(self) -> Any:
        decoder = getattr(self._local, "decoder", None)
        if decoder is None:
            from pocketsphinx import Decoder

            # loglevel FATAL: a failed search logs an ERROR line per call; it is handled (interpolation) here.
            decoder = Decoder(lm=None, loglevel="FATAL", silprob=SILENCE_PROB, pip=PHONE_PENALTY)
            self._local.decoder = decoder
        return decoder

    def align_batch(self, jobs: Sequence[AlignJob]) -> list[AlignResult]:
        if not self._processes:
            return [self._align(job) for job in jobs]
        try:
            return self._new_pool().submit(_align_in_worker, list(jobs)).result()
        except BrokenProcessPool:  # a worker died (killed, out of memory): a new pool for the next jobs
            log.error("a pocketsphinx worker process died; starting new ones")
            with self._pool_lock:
                self._pool = None
            return [AlignResult([] if job.free_end else [None] * len(job.words)) for job in jobs]

    def _dictionary_words(self, decoder: Any, words: Sequence[str]) -> list[tuple[int, str]]:
        """(index of the take's word, dictionary word) for every word PocketSphinx can look for."""
        out: list[tuple[int, str]] = []
        for i, word in enumerate(words):
            if decoder.lookup_word(word) is not None:
                out.append((i, word))
            elif _LETTERS.match(word) and all(decoder.lookup_word(c) is not None for c in word):
                out += [(i, c) for c in word]  # an acronym: said letter by letter
        return out

    def _align(self, job: AlignJob) -> AlignResult:
        n = len(job.words)
        nothing = AlignResult([] if job.free_end else [None] * n)
        if n == 0 or len(job.audio) < MIN_SAMPLES:
            return nothing
        decoder = self._decoder()
        entries = self._dictionary_words(decoder, job.words)
        if not entries:
            return nothing
        # A floor of faint noise (-70 dBFS, fixed seed): digital silence (exact zeros, as synthetic speech has between
        # words) makes PocketSphinx's features degenerate and its search lose the path.
        floor = np.random.default_rng(0).normal(0.0, NOISE_FLOOR, len(job.audio)).astype(np.float32)
        pcm = (np.clip(job.audio + floor, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
        segments = self._decode(decoder, entries, pcm, free_end=job.free_end)
        if segments is None and not job.free_end:
            # No path through all the words to the end: keep what a free end places (the rest is interpolated).
            segments = self._decode(decoder, entries, pcm, free_end=True)
        if segments is None:
            return nothing
        words, pause_after = segments
        spans = _spans(entries, words, n, free_end=job.free_end)
        settled = None
        if job.free_end and pause_after and spans:
            settled = len(spans)  # the path is in a pause after the last word reached: that word is over
        return AlignResult(spans, settled)

    @staticmethod
    def _decode(
        decoder: Any, entries: list[tuple[int, str]], pcm: bytes, *, free_end: bool
    ) -> tuple[list[tuple[str, float, float]], bool] | None:
        try:
            decoder.set_align_text(" ".join(word for _, word in entries))
            decoder.start_utt()
            decoder.process_raw(pcm, full_utt=True)
            if free_end:
                # A partial result: the best path so far, ending wherever the audio ends.
                segments = _segments(decoder)
                decoder.end_utt()
            else:
                decoder.end_utt()
                segments = _segments(decoder)
        except RuntimeError as exc:  # a text PocketSphinx refuses, a search that found nothing
            log.debug("pocketsphinx could not align: %s", exc)
            return None
        return segments


_WORKER: PocketsphinxAligner | None = None  # the aligner of this worker process (its own decoder)
PARENT_CHECK_SEC = 1.0


def _leave_with_parent(parent: int) -> None:
    """(In a worker process.) Exit once the server that started this worker is gone: a server killed with SIGKILL
    never shuts its pool down, and its workers would otherwise live on, orphaned, holding their memory."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_SEC)
        os._exit(0)

    threading.Thread(target=watch, name="moss-rt-parent-watch", daemon=True).start()


def _worker_aligner() -> PocketsphinxAligner:
    global _WORKER
    if _WORKER is None:
        _WORKER = PocketsphinxAligner(workers=1)
        _WORKER.load()
    return _WORKER


def _align_in_worker(jobs: list[AlignJob]) -> list[AlignResult]:
    return _worker_aligner().align_batch(jobs)


def _segments(decoder: Any) -> tuple[list[tuple[str, float, float]], bool] | None:
    """The words on the decoder's best path (fillers left out), and whether the path ends in a pause
    (at least ``PAUSE_FRAMES`` of silence or filler after the last word)."""
    if decoder.hyp() is None:
        return None
    out = []
    pause = 0
    for seg in decoder.seg():
        word = _ALT_PRON.sub("", seg.word)
        if word.startswith(("<", "[", "+")):  # <sil>, <s>, </s>, [NOISE], +filler+
            pause += seg.end_frame + 1 - seg.start_frame
            continue
        out.append((word, seg.start_frame / FRAME_RATE, (seg.end_frame + 1) / FRAME_RATE))
        pause = 0
    return out, pause >= PAUSE_FRAMES


def _spans(
    entries: list[tuple[int, str]], segments: list[tuple[str, float, float]], n: int, *, free_end: bool
) -> list[Span]:
    """Per take word: from the first to the last of its dictionary words' segments (in order)."""
    spans: list[Span] = [None] * n
    reached = -1
    for (index, word), (seg_word, start, end) in zip(entries, segments, strict=False):
        if seg_word != word:
            break  # the decoder's path and the text disagree from here: trust nothing after it
        held = spans[index]
        spans[index] = (start, end) if held is None else (held[0], end)
        reached = index
    if free_end:
        # Words after the last one reached are not in the audio yet; unplaced ones before it are gaps.
        return spans[: reached + 1]
    return spans
