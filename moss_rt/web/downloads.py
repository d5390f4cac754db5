"""Take downloads: a WAV written header first, then its samples piece by piece from the stored audio.

Nothing is assembled per client. The samples come from the take's streamed PCM when it is still
held (:class:`~moss_rt.heard_audio.HeardAudio`, shared by every reader, never copied whole), else
from one render of its codes that all concurrent downloaders of the take share. Each piece is
one write that must go out within ``send_stall_timeout_sec`` (as for streams), so a client that
never reads holds one piece plus the socket buffers until it is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

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

PcmBuffer = bytes | bytearray


async def take_pcm(state: ServiceState, take: TakeRecord) -> PcmBuffer:
    """The take's int16 PCM for reading (not for keeping): the held streamed buffer when complete,
    else a shared render of its codes (raises ``EngineBusy`` when the engine's job queue is full)."""
    held = state.heard.buffer(take.take_id, take.n_frames, bytes_per_frame(take))
    if held is not None:
        return held
    codes, channels = take.codes, take.request.channels
    return await state.renders.get(take.take_id, lambda: state.engine.render(codes, channels))


async def send_wav(
    request: web.Request,
    take: TakeRecord,
    pcm: PcmBuffer,
    write: Callable[[web.StreamResponse, bytes], Awaitable[None]],
) -> web.StreamResponse:
    """Stream ``pcm`` (its first ``take.n_frames`` frames) as a WAV attachment."""
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
            # A slice is a copy of one piece: the shared buffer itself is never handed to the socket.
            await write(response, bytes(pcm[offset : min(n_bytes, offset + WRITE_CHUNK)]))
        await response.write_eof()
    except ConnectionResetError:
        log.info("download of take %s: client %s left or stopped reading", take.take_id, request.remote)
    return response
