"""Word timing on the transports: a take's ``words`` while it streams, and any take's words on demand.

:class:`TakeWords` follows one take that asked for ``words``: the connection hands it the take's PCM as it is sent
(:meth:`TakeWords.audio`); its task aligns the audio heard so far on the aligner's workers
(:class:`~moss_rt.align.service.AlignService`, never on the loop), settles the words safely behind the audio edge
(:class:`~moss_rt.align.track.WordTrack`) and sends them as ``words`` messages. :meth:`TakeWords.finish` aligns
the rest and sends the last batch (``final``) before the take's ``end``. One alignment per take at a time, and a
streaming one is skipped (not queued) when the aligner's queue is full, so the work stays bounded.

:func:`take_words` aligns a finished take that has no words yet (downloads, ``seek`` by word), once per take even
when several ask at the same time. :func:`stored_take_words` does the same for a take of a stored session (its
session routes, a script's lines): from the audio stored with it, and keeps the words with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from moss_rt.align.base import AlignResult, WordTime, kept_words
from moss_rt.align.service import AlignerBusy, AlignerUnavailable, AlignService
from moss_rt.align.track import WordTrack
from moss_rt.engine.base import EngineBusy
from moss_rt.protocol import FRAME_RATE, SAMPLE_RATE, UNSET, ErrorCode, ProtocolError, Words, encode_json_frame
from moss_rt.session import TakeRecord, TakeStatus, bytes_per_frame
from moss_rt.session_records import StoredTake
from moss_rt.session_store import SessionStore
from moss_rt.web.state import ServiceState
from moss_rt.web.takes import held_take_audio

log = logging.getLogger(__name__)

STORED_PIECE_BYTES = 2 * SAMPLE_RATE * 2  # a stored take's audio is read for alignment 1 s (stereo) to 2 s at a time

SendFrame = Callable[[bytes], Awaitable[None]]


def require_aligner(state: ServiceState) -> AlignService:
    if state.aligner is None:
        raise ProtocolError(
            ErrorCode.INVALID_FIELD, "this server runs without a word aligner (--aligner none)", field="words"
        )
    aligner: AlignService = state.aligner
    return aligner


async def run_final(service: AlignService, track: WordTrack, *, complete: bool) -> None:
    """Align what is left of a finished take (checkpoints first) until every word it said is settled."""
    while (due := track.next_job(final=True, complete=complete)) is not None:
        job, pending = due
        try:
            result = await service.align(job, wait=True)
        except AlignerUnavailable:
            result = AlignResult()  # estimated instead: the aligner never fails a take
        track.apply(pending, result)


async def align_take(state: ServiceState, take: TakeRecord) -> list[WordTime]:
    """The words of a take that has ended, aligned now from its audio (as heard, else rendered from its codes)."""
    service = require_aligner(state)
    parent = state.takes.get(take.parent) if take.parent else None
    kept = (
        kept_words(parent.words, take.request.text, take.branch_frame / FRAME_RATE)
        if parent is not None and parent.words is not None
        else []
    )  # a retake keeps its parent's words before the branch point
    track = WordTrack(
        take.request.text, sample_rate=service.aligner.sample_rate, input_rate=SAMPLE_RATE, kept=kept
    )
    async with held_take_audio(state, take) as pcm:  # a render, when needed, within the renders' budget
        track.add_pcm(pcm, take.request.channels)
    await run_final(service, track, complete=take.reason == "done")
    return track.words


async def take_words(state: ServiceState, take: TakeRecord) -> list[WordTime]:
    """The take's words: as streamed or aligned before, else aligned now (once, however many ask at once).
    A take still running answers the words settled so far."""
    if take.words is not None:
        return list(take.words)
    if take.status is TakeStatus.RUNNING:
        return []
    task = state.words_inflight.get(take.take_id)
    if task is None:
        task = asyncio.create_task(align_take(state, take), name=f"words-{take.take_id}")
        state.words_inflight[take.take_id] = task
        task.add_done_callback(lambda _t: state.words_inflight.pop(take.take_id, None))
    words = await asyncio.shield(task)
    take.words = words
    return list(words)


# --------------------------------------------------------------------------- takes of stored sessions


def read_stored_words(store: SessionStore, session_id: str, take_id: str) -> list[WordTime] | None:
    """A stored take's words as kept with it (blocking: call it in a worker thread); None when they never were, or
    their row is unreadable (then they are aligned again). ``not_found`` when the take is not in the session."""
    records = store.words(session_id, take_id)
    if records is None:
        return None
    try:
        return [WordTime.from_record(r) for r in records]
    except (KeyError, TypeError, ValueError):
        log.warning("the stored words of take %s are unreadable; aligning it again", take_id)
        return None


async def stored_take_words(state: ServiceState, session_id: str, take: StoredTake) -> list[WordTime]:
    """The words of ``take`` of a stored session: as kept with it, else aligned now and kept with it.

    The alignment reads the take's stored audio (what its downloads and a script's export play) in pieces, keeps
    its parent's stored words that end before its branch frame (the frames it kept are its parent's), and runs on
    the aligner's workers. One alignment per take however many ask at once; it finishes and keeps its words even
    when the caller stops waiting (an export that waited long enough), unless the service shuts down.
    ``invalid_field`` (field ``words``) without an aligner, ``not_found`` when the take or its session is gone."""
    store = state.sessions
    if store is None:
        raise ProtocolError(ErrorCode.NOT_FOUND, "this service keeps no sessions", field="session")
    words = await asyncio.to_thread(read_stored_words, store, session_id, take.take_id)
    if words is not None:
        return words
    service = require_aligner(state)
    key = f"stored:{session_id}:{take.take_id}"
    task = state.words_inflight.get(key)
    if task is None:
        task = asyncio.create_task(_align_stored(service, store, session_id, take), name=f"words-{take.take_id}")
        state.words_inflight[key] = task  # cancelled at shutdown (moss_rt/web/app.py)
        task.add_done_callback(lambda _t: state.words_inflight.pop(key, None))
    return list(await asyncio.shield(task))


async def _align_stored(
    service: AlignService, store: SessionStore, session_id: str, take: StoredTake
) -> list[WordTime]:
    text = str(take.request.get("text", ""))
    kept: list[WordTime] = []
    if take.parent and take.branch_frame > 0:
        try:
            parent = await asyncio.to_thread(read_stored_words, store, session_id, take.parent)
        except ProtocolError:  # the parent was deleted since: its words are aligned again with the rest
            parent = None
        if parent is not None:
            kept = kept_words(parent, text, take.branch_frame / FRAME_RATE)
    track = WordTrack(text, sample_rate=service.aligner.sample_rate, input_rate=SAMPLE_RATE, kept=kept)
    # Reading and resampling are real work: off the loop, and the stored file in pieces rather than whole.
    try:
        await asyncio.to_thread(_feed_stored, track, store, session_id, take)
    except OSError:
        log.exception("the stored audio of take %s could not be read for its words", take.take_id)
        raise ProtocolError(
            ErrorCode.NOT_FOUND, f"the stored audio of take {take.take_id!r} could not be read", field="take"
        ) from None
    await run_final(service, track, complete=take.reason == "done")
    words = list(track.words)
    await asyncio.to_thread(store.put_words, session_id, take.take_id, [w.to_record() for w in words], service.name)
    return words


def _feed_stored(track: WordTrack, store: SessionStore, session_id: str, take: StoredTake) -> None:
    with store.open_pcm(session_id, take.take_id) as f:
        while piece := f.read(STORED_PIECE_BYTES):
            track.add_pcm(piece, take.channels)


class TakeWords:
    """The words of one take as it streams on one connection (see the module docstring)."""

    def __init__(self, state: ServiceState, service: AlignService, take: TakeRecord, send: SendFrame) -> None:
        self._state = state
        self._service = service
        self.take = take
        self._send = send
        self._track = WordTrack(
            take.request.text, sample_rate=service.aligner.sample_rate, input_rate=SAMPLE_RATE, kept=take.words or (),
            window_sec=service.window_sec,
        )  # fmt: skip
        self._queued: list[bytes] = []  # PCM that came before the retake's kept audio was in the track
        self._seeded = take.branch_frame == 0
        self._sent = 0  # words sent so far
        self._audio_started = False
        self._wake = asyncio.Event()
        self._sending = asyncio.Lock()  # a batch is never cut in half by finish() cancelling the task
        self._task = asyncio.create_task(self._run(), name=f"words-{take.take_id}")

    # -- what the connection reports ------------------------------------------------------

    def audio(self, pcm: bytes) -> None:
        """The take's next PCM, as just sent to the client."""
        self._audio_started = True
        if self._seeded:
            self._track.add_pcm(pcm, self.take.request.channels)
        else:
            self._queued.append(pcm)
        self._wake.set()

    def checkpoint(self, text: str) -> None:
        """A continuation of a take fed with text ended: ``text`` is all in the audio so far."""
        self._drain()
        self._track.set_text(text)
        self._track.checkpoint()
        self._wake.set()

    async def finish(self, *, complete: bool) -> None:
        """The take is over: settle the rest, send the last batch (``final``), keep the words on the take."""
        await self._stop_task()
        await self._seed()
        self._drain()
        self._track.set_text(self.take.request.text)
        await run_final(self._service, self._track, complete=complete)
        self.take.words = list(self._track.words)
        await self._flush(final=True)

    async def close(self) -> None:
        """The connection is gone: stop without sending anything."""
        await self._stop_task()

    # -- the task -----------------------------------------------------------------------

    async def _stop_task(self) -> None:
        async with self._sending:
            self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        await self._seed()
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._tick()
            except (ConnectionResetError, asyncio.CancelledError):
                raise
            except Exception:  # never let words break the take: the final pass settles what is left
                log.exception("words of take %s: alignment step failed", self.take.take_id)

    async def _tick(self) -> None:
        self._drain()
        self._track.set_text(self.take.request.text)
        due = self._track.next_job()  # (words unsettled for longer than the track's window are settled by age here)
        if due is not None:
            job, pending = due
            try:
                result: AlignResult | None = await self._service.align(job, wait=False)
            except AlignerBusy:
                result = None  # the next audio tries again
            except AlignerUnavailable:
                result = AlignResult()
            if result is not None:
                self._track.apply(pending, result)
                self._wake.set()  # more audio may have come meanwhile
        if len(self._track.words) > len(self.take.words or ()):
            self.take.words = list(self._track.words)
        if self._audio_started:
            await self._flush(final=False)

    async def _seed(self) -> None:
        """A retake's track starts with the audio of the frames it kept (its parent's, as heard)."""
        if self._seeded:
            return
        frame_bytes = bytes_per_frame(self.take)
        prefix_bytes = self.take.branch_frame * frame_bytes
        parent = self._state.takes.get(self.take.parent or "")
        pcm = b""
        if parent is not None:
            try:
                async with held_take_audio(self._state, parent) as held:
                    pcm = held[:prefix_bytes]
            except (EngineBusy, ProtocolError):
                log.warning("words of retake %s: its kept audio is unavailable; estimating", self.take.take_id)
        self._track.add_pcm(pcm.ljust(prefix_bytes, b"\0"), self.take.request.channels)
        self._seeded = True
        self._drain()

    def _drain(self) -> None:
        if not self._seeded:
            return
        for pcm in self._queued:
            self._track.add_pcm(pcm, self.take.request.channels)
        self._queued.clear()

    async def _flush(self, *, final: bool) -> None:
        async with self._sending:
            words = self._track.words[self._sent :]
            if not words and not final:
                return
            message = Words(
                take=self.take.take_id, words=[w.to_dict() for w in words], index=self._sent,
                final=True if final else UNSET,
            )  # fmt: skip
            await self._send(encode_json_frame(message.to_dict()))
            self._sent += len(words)
