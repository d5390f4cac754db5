"""A script's export as one zip, streamed: every line, the mix, the cue sheets and the captions.

    mix.<ext>                     the lines in order with their gaps and pauses, mono, joined to the sample
    lines/001-KEEPER.<ext>        each line's accepted take, named by its number and character
    cues.csv, cues.json           the cue sheet: line, scene, character, start, end, take, seed (and samples)
    captions/lines.srt, .vtt      captions by line (speaker named)
    captions/words.srt, .vtt      by word where a line's take has word timing, else by line
    script.json                   the script as rendered (the canonical JSON form)

Nothing is assembled whole: the zip is written to a sink that is drained to the client after every piece
(entries carry data descriptors, ZIP64 where needed, so no seek is ever required), audio entries are stored, not
deflated (they are audio), and a take's audio is read from its file in the session store
(:meth:`~moss_rt.session_store.SessionStore.open_pcm`) in 2-second pieces, each sent before the next is read,
encoded in worker threads (:class:`~moss_rt.formats.async_encoder.AsyncEncoder`) for a ``?format=`` other than
48 kHz WAV. What one export holds is one piece and its encoding, however long the takes or the script; the number
of exports at once is bounded (``max_script_exports``). Each write must go out within the send-stall timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import zipfile
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiohttp import web

from moss_rt.align.base import WordTime
from moss_rt.audio import wav_header
from moss_rt.captions import to_srt, to_vtt
from moss_rt.formats import AudioFormat
from moss_rt.generation import FRAME_SAMPLES, SAMPLE_RATE
from moss_rt.protocol import ErrorCode, ProtocolError
from moss_rt.scripts.job import Job
from moss_rt.scripts.timeline import (
    Placed,
    Silence,
    Timeline,
    cue_sheet_csv,
    cue_sheet_json,
    layout,
    line_captions,
    line_file_stem,
    word_captions,
)
from moss_rt.session_store import SessionStore

log = logging.getLogger(__name__)

PIECE_BYTES = 25 * FRAME_SAMPLES * 2  # 2 s of mono int16 per write / encoder call
_ZEROS = bytes(PIECE_BYTES)

Write = Callable[[web.StreamResponse, bytes], Awaitable[None]]


class _Sink:
    """Where zipfile writes: collected until drained to the client. No ``seek``/``tell``: zipfile then writes a
    streamable archive (data descriptors after each entry)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes | memoryview) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None

    def drain(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


def archive_name(job: Job) -> str:
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", job.script.title).strip("-")[:60]
    return f"{slug or job.script_id}.zip"


class ZipStream:
    """A zip written entry by entry into a sink that the caller drains to the client after every write."""

    def __init__(self, send: Callable[[bytes], Awaitable[None]]) -> None:
        self._sink = _Sink()
        self._zip = zipfile.ZipFile(self._sink, "w")
        self._send = send

    async def flush(self) -> None:
        data = self._sink.drain()
        if data:
            await self._send(data)

    async def text(self, name: str, body: str) -> None:
        info = self._info(name, zipfile.ZIP_DEFLATED)
        await asyncio.to_thread(self._zip.writestr, info, body.encode())
        await self.flush()

    @contextlib.asynccontextmanager
    async def entry(self, name: str) -> AsyncIterator[Callable[[bytes], Awaitable[None]]]:
        """A stored (uncompressed) entry written piece by piece; CRCs run in a worker thread."""
        handle = self._zip.open(self._info(name, zipfile.ZIP_STORED), "w", force_zip64=True)

        async def write(data: bytes) -> None:
            if data:
                await asyncio.to_thread(handle.write, data)
                await self.flush()

        try:
            yield write
        finally:
            await asyncio.to_thread(handle.close)  # the data descriptor
        await self.flush()

    async def close(self) -> None:
        await asyncio.to_thread(self._zip.close)  # the central directory
        await self.flush()

    @staticmethod
    def _info(name: str, compression: int) -> zipfile.ZipInfo:
        info = zipfile.ZipInfo(name, date_time=time.localtime()[:6])
        info.compress_type = compression
        info.external_attr = 0o644 << 16
        return info


async def _write_audio(
    write: Callable[[bytes], Awaitable[None]],
    pieces: AsyncGenerator[bytes, None],
    n_bytes: int,
    fmt: AudioFormat | None,
) -> None:
    """Mono 48 kHz int16 pieces (``n_bytes`` in all) as a WAV (``fmt`` None) or through an encoder; ``pieces`` is
    closed (its files with it) however this ends."""
    async with contextlib.aclosing(pieces):
        if fmt is None:
            await write(wav_header(n_bytes, SAMPLE_RATE, 1))
            async for piece in pieces:
                await write(piece)
            return
        from moss_rt.formats.async_encoder import AsyncEncoder

        encoder = AsyncEncoder(fmt, 1)
        try:
            async for piece in pieces:
                await write(await encoder.encode(piece))
            await write(await encoder.finish())
        finally:
            encoder.close()


async def _silence(n_bytes: int) -> AsyncGenerator[bytes, None]:
    for offset in range(0, n_bytes, PIECE_BYTES):
        yield _ZEROS[: min(PIECE_BYTES, n_bytes - offset)]


class ScriptExport:
    """One export of ``job``: its timeline fixed when made (later retakes go into the next export). ``words``: the
    placed lines' words by line number (:meth:`~moss_rt.scripts.service.ScriptService.words_of`), set before
    :meth:`stream`."""

    def __init__(
        self,
        job: Job,
        sessions: SessionStore,
        fmt: AudioFormat | None,
        words: Mapping[int, Sequence[WordTime]] | None = None,
    ) -> None:
        self.job = job
        self.session_id = job.session_id
        self.sessions = sessions
        self.fmt = fmt
        self.words: Mapping[int, Sequence[WordTime]] = dict(words or {})
        self.timeline: Timeline = layout(job.spoken_script(), job.audio())
        self.extension = fmt.extension if fmt is not None else "wav"

    async def check(self) -> None:
        """Every take the export needs is still in the session (ProtocolError not_found naming the line if not),
        before anything is sent."""
        for placed in self.timeline.placed:
            try:
                take = await asyncio.to_thread(self.sessions.get_take, self.session_id, placed.audio.take_id)
            except ProtocolError as err:
                if err.field == "session":
                    raise
                raise ProtocolError(
                    ErrorCode.NOT_FOUND,
                    f"line {placed.cue.number}'s take {placed.audio.take_id} is no longer in the session; retake the"
                    " line or accept another take for it",
                    field="take",
                ) from None
            if take.n_frames * FRAME_SAMPLES != placed.audio.samples or take.channels != 1:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"line {placed.cue.number}'s take changed", field="take")

    async def _take_pieces(self, placed: Placed) -> AsyncGenerator[bytes, None]:
        """The line's take as stored, in pieces read from its file one at a time (``placed.audio.samples`` of it,
        which :meth:`check` found to be the take's length). A file that is gone or cut since is an error: the
        export is cut rather than made to look whole."""
        take_id = placed.audio.take_id
        source = await asyncio.to_thread(self.sessions.open_pcm, self.session_id, take_id)
        try:
            left = placed.audio.samples * 2
            while left > 0:
                piece = await asyncio.to_thread(source.read, min(PIECE_BYTES, left))
                if not piece:
                    raise OSError(f"the stored audio of take {take_id} ended {left} bytes early")
                left -= len(piece)
                yield piece
        finally:
            await asyncio.to_thread(source.close)

    async def stream(self, request: web.Request, write: Write) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "application/zip",
                "Content-Disposition": f'attachment; filename="{archive_name(self.job)}"',
                "Cache-Control": "no-store",
            }
        )
        await response.prepare(request)

        async def send(data: bytes) -> None:
            await write(response, data)

        archive = ZipStream(send)
        try:
            await self._write(archive)
            await response.write_eof()
        except ConnectionResetError:
            log.info("export of script %s: client %s left or stopped reading", self.job.log_id, request.remote)
        except Exception:
            # The headers are out: a cut archive must not look whole.
            log.exception("export of script %s failed midway", self.job.log_id)
            if request.transport is not None:
                request.transport.abort()
        return response

    async def _write(self, archive: ZipStream) -> None:
        timeline, fmt, ext = self.timeline, self.fmt, self.extension
        for placed in timeline.placed:
            async with archive.entry(f"lines/{line_file_stem(placed.cue)}.{ext}") as write:
                await _write_audio(write, self._take_pieces(placed), placed.audio.samples * 2, fmt)
        async with archive.entry(f"mix.{ext}") as write:
            await _write_audio(write, self._mix_pieces(), timeline.total_samples * 2, fmt)
        await archive.text("cues.csv", cue_sheet_csv(timeline, ext))
        await archive.text("cues.json", cue_sheet_json(timeline, ext, mix_file=f"mix.{ext}"))
        by_line, by_word = line_captions(timeline), word_captions(timeline, self.words)
        await archive.text("captions/lines.srt", to_srt(by_line))
        await archive.text("captions/lines.vtt", to_vtt(by_line))
        await archive.text("captions/words.srt", to_srt(by_word))
        await archive.text("captions/words.vtt", to_vtt(by_word))
        await archive.text("script.json", json.dumps(self._script_json(), indent=1, ensure_ascii=False))
        await archive.close()

    async def _mix_pieces(self) -> AsyncGenerator[bytes, None]:
        for segment in self.timeline.segments:
            if isinstance(segment, Silence):
                async for piece in _silence(segment.samples * 2):
                    yield piece
            else:
                async with contextlib.aclosing(self._take_pieces(segment)) as pieces:
                    async for piece in pieces:
                        yield piece

    def _script_json(self) -> dict[str, Any]:
        job = self.job
        return {
            **job.script.to_dict(),
            "script": job.script_id,
            "session": job.session_id,
            "rendered": [job.line_view(n) for n in sorted(job.lines)],
        }
