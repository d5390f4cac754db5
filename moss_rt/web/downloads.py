"""Take downloads: a WAV written header first, then its samples piece by piece from the stored audio.

Nothing is assembled per client. The samples come from the take's streamed PCM when it is still
held (:class:`~moss_rt.heard_audio.HeardAudio`, shared by every reader, never copied whole), else
from one render of its codes that all concurrent downloaders of the take share. Each piece is
one write that must go out within ``send_stall_timeout_sec`` (as for streams), so a client that
never reads holds one piece plus the socket buffers until it is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from aiohttp import web

from moss_rt.audio import wav_header
from moss_rt.protocol import SAMPLE_RATE
from moss_rt.session import TakeRecord
from moss_rt.web.state import ServiceState
from moss_rt.web.takes import bytes_per_frame

log = logging.getLogger(__name__)

# Bytes per write: large enough to keep a fast reader's socket full, small enough that a stalled
# one holds little (aiohttp waits for the socket to drain past 64 KiB buffered).
WRITE_CHUNK = 64 * 1024

# Copies out [offset, offset + size) of the take's PCM; None when the audio is no longer held.
ReadPiece = Callable[[int, int], bytes | None]


@asynccontextmanager
async def take_pcm(state: ServiceState, take: TakeRecord) -> AsyncIterator[ReadPiece]:
    """A reader of the take's int16 PCM while inside: pieces of its held streamed audio when that
    is complete, else of a render of its codes shared with its other readers (``EngineBusy`` when
    the renders' budget or the engine's job queue is full).

    The streamed audio is looked up again for every piece rather than held: a take evicted from
    the heard-audio budget meanwhile is not kept alive by its readers (their downloads end early).
    """
    frame_bytes = bytes_per_frame(take)
    take_id, n_frames = take.take_id, take.n_frames
    if state.heard.buffer(take_id, n_frames, frame_bytes) is not None:

        def read_heard(offset: int, size: int) -> bytes | None:
            held = state.heard.buffer(take_id, n_frames, frame_bytes)
            # A slice copies one piece: the shared buffer itself never reaches the socket.
            return None if held is None else bytes(held[offset : offset + size])

        yield read_heard
        return
    codes, channels = take.codes, take.request.channels
    async with state.renders.hold(take_id, n_frames * frame_bytes, lambda: state.engine.render(codes, channels)) as pcm:
        yield lambda offset, size: pcm[offset : offset + size]


async def send_wav(
    request: web.Request,
    take: TakeRecord,
    read: ReadPiece,
    write: Callable[[web.StreamResponse, bytes], Awaitable[None]],
) -> web.StreamResponse:
    """Stream the take's first ``take.n_frames`` frames as a WAV attachment, piece by piece."""
    n_bytes = take.n_frames * bytes_per_frame(take)
    header = wav_header(n_bytes, SAMPLE_RATE, take.request.channels)
    response = web.StreamResponse(
        headers={
            "Content-Type": "audio/wav",
            "Content-Disposition": f'attachment; filename="{take.take_id}.wav"',
            "Cache-Control": "no-store",
        }
    )
    response.content_length = len(header) + n_bytes
    try:
        await response.prepare(request)
        await write(response, header)
        for offset in range(0, n_bytes, WRITE_CHUNK):
            piece = read(offset, min(WRITE_CHUNK, n_bytes - offset))
            if piece is None:
                log.warning("download of take %s cut short: its audio was evicted meanwhile", take.take_id)
                if request.transport is not None:
                    request.transport.abort()  # the client sees fewer bytes than Content-Length
                return response
            await write(response, piece)
        await response.write_eof()
    except ConnectionResetError:
        log.info("download of take %s: client %s left or stopped reading", take.take_id, request.remote)
    return response
