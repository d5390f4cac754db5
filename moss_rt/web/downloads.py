"""Take downloads: a WAV written header first, then its samples piece by piece from the stored audio.

Nothing is assembled per client. The samples come from the take's streamed PCM when it is still
held (:class:`~moss_rt.heard_audio.HeardAudio`, shared by every reader, never copied whole), else
from one render of its codes that all concurrent downloaders of the take share. Each piece is
one write that must go out within ``send_stall_timeout_sec`` (as for streams), so a client that
never reads holds one piece plus the socket buffers until it is dropped.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from aiohttp import web

from moss_rt.audio import wav_header
from moss_rt.engine.base import EngineBusy
from moss_rt.protocol import SAMPLE_RATE, ProtocolError
from moss_rt.session import TakeRecord, bytes_per_frame
from moss_rt.web.state import ServiceState

log = logging.getLogger(__name__)

# Bytes per write: large enough to keep a fast reader's socket full, small enough that a stalled
# one holds little (aiohttp waits for the socket to drain past 64 KiB buffered).
WRITE_CHUNK = 64 * 1024

# Copies out [offset, offset + size) of the take's PCM (may raise ``EngineBusy`` when it must render).
ReadPiece = Callable[[int, int], Awaitable[bytes]]


@asynccontextmanager
async def take_pcm(state: ServiceState, take: TakeRecord, *, client: str | None = None) -> AsyncIterator[ReadPiece]:
    """A reader of the take's int16 PCM while inside: pieces of its held streamed audio when that
    is complete, else of a render of its codes shared with its other readers (``EngineBusy`` on
    entry when the renders' budget, ``client``'s share of it or the engine's job queue is full).

    The streamed audio is looked up again for every piece rather than held, so a reader never
    keeps an evicted take alive; if it is evicted meanwhile, the rest comes from a render.
    """
    frame_bytes = bytes_per_frame(take)
    take_id, n_frames = take.take_id, take.n_frames
    codes, channels = take.codes, take.request.channels
    async with contextlib.AsyncExitStack() as stack:
        rendered: list[bytes] = []

        async def render() -> bytes:
            if not rendered:
                hold = state.renders.hold(
                    take_id, n_frames * frame_bytes, lambda: state.engine.render(codes, channels), client=client
                )
                rendered.append(await stack.enter_async_context(hold))
            return rendered[0]

        if state.heard.buffer(take_id, n_frames, frame_bytes) is None:
            await render()  # refused (busy) now, before anything is sent

        async def read(offset: int, size: int) -> bytes:
            if not rendered:
                held = state.heard.buffer(take_id, n_frames, frame_bytes)
                if held is not None:
                    # A slice copies one piece: the shared buffer itself never reaches the socket.
                    return bytes(held[offset : offset + size])
            return (await render())[offset : offset + size]

        yield read


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
            await write(response, await read(offset, min(WRITE_CHUNK, n_bytes - offset)))
        await response.write_eof()
    except ConnectionResetError:
        log.info("download of take %s: client %s left or stopped reading", take.take_id, request.remote)
    except (EngineBusy, ProtocolError):
        # Evicted mid-download and no render possible now (busy, or codes it cannot render); the headers are out,
        # so only a cut is left.
        log.warning("download of take %s cut short: its audio was evicted and cannot be rendered", take.take_id)
        if request.transport is not None:
            request.transport.abort()  # the client sees fewer bytes than Content-Length
    return response
