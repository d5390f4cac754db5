"""Take downloads in another format (``?format=`` / ``?sample_rate=``): the take's PCM through an encoder.

A layer over the WAV download: the same stored PCM (held streamed audio, or a render of the
codes, read through :func:`~moss_rt.web.downloads.take_pcm`) is read in pieces, each piece is
encoded in a worker thread (:class:`~moss_rt.formats.async_encoder.AsyncEncoder`) and written as soon
as it is encoded, so nothing but one piece and its encoded bytes is built per client. Each write
must go out within the send-stall timeout, as for every stream.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from moss_rt.engine.base import EngineBusy
from moss_rt.formats import AudioFormat
from moss_rt.formats.async_encoder import AsyncEncoder
from moss_rt.protocol import FRAME_SAMPLES, SAMPLE_RATE, ProtocolError
from moss_rt.session import TakeRecord
from moss_rt.web.downloads import ReadPiece

log = logging.getLogger(__name__)

FRAMES_PER_PIECE = 25  # 2 s of audio per encoder call: few thread hops, little held per client

Write = Callable[[web.StreamResponse, bytes], Awaitable[None]]


def wants_other_format(query: dict[str, str] | object) -> bool:
    """True when a download asks for anything but the default 48 kHz WAV."""
    get = getattr(query, "get", None)
    return get is not None and (get("format") is not None or get("sample_rate") is not None)


async def send_encoded(
    request: web.Request, take: TakeRecord, read: ReadPiece, fmt: AudioFormat, write: Write
) -> web.StreamResponse:
    """Stream the take's ``take.n_frames`` frames, read piece by piece, encoded as ``fmt`` (an attachment)."""
    channels = take.request.channels
    piece = FRAMES_PER_PIECE * FRAME_SAMPLES * 2 * channels
    total = take.n_frames * FRAME_SAMPLES * 2 * channels
    response = web.StreamResponse(
        headers={
            "Content-Type": fmt.media_type,
            "Content-Disposition": f'attachment; filename="{take.take_id}.{fmt.extension}"',
            "Cache-Control": "no-store",
            "X-Sample-Rate": str(fmt.sample_rate),
            "X-Channels": str(channels),
        }
    )
    # The whole take is known before the first byte: a FLAC header states its length (soundfile needs it).
    length = take.n_frames * FRAME_SAMPLES * fmt.sample_rate // SAMPLE_RATE if fmt.name == "flac" else None
    encoder = AsyncEncoder(fmt, channels, total_samples=length)
    try:
        await response.prepare(request)
        for offset in range(0, total, piece):
            data = await encoder.encode(await read(offset, min(piece, total - offset)))
            if data:
                await write(response, data)
        tail = await encoder.finish()
        if tail:
            await write(response, tail)
        await response.write_eof()
    except ConnectionResetError:
        log.info("download of take %s as %s: client %s left or stopped reading", take.take_id, fmt.name, request.remote)
    except (EngineBusy, ProtocolError):
        # Evicted mid-download and no render possible now: a cut file must not look whole.
        log.warning("download of take %s cut short: its audio was evicted and the engine is busy", take.take_id)
        if request.transport is not None:
            request.transport.abort()
    finally:
        encoder.close()
    return response
