"""The frame codec shared by the HTTP stream and the WebSocket channel.

One frame is ``[u8 tag][u32 big-endian length][payload]``. Tag 0 carries a UTF-8 JSON object,
tag 1 raw little-endian int16 PCM at 48 kHz, tag 2 the next bytes of a take's audio in the format its
``start`` asked for (sent only to a client that asked for one). This module is pure: bytes in, frames out.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from moss_rt.protocol.errors import ErrorCode, ProtocolError

TAG_JSON = 0
TAG_PCM = 1
TAG_AUDIO = 2  # encoded audio (mp3, opus, ...): a take's tag-2 payloads in order form one file
KNOWN_TAGS = frozenset({TAG_JSON, TAG_PCM, TAG_AUDIO})

HEADER = struct.Struct(">BI")
HEADER_SIZE = HEADER.size
MAX_PAYLOAD_BYTES = 2**32 - 1  # what the u32 length can express

# 8 MiB is ~87 s of mono 48 kHz PCM in one frame: far above any chunk we emit, small enough
# that a corrupt length field cannot make a reader allocate gigabytes.
DEFAULT_MAX_FRAME_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Frame:
    tag: int
    payload: bytes

    def json(self) -> dict[str, Any]:
        """Decode a tag-0 payload; raises ProtocolError if it is not a JSON object."""
        if self.tag != TAG_JSON:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"frame tag {self.tag} is not JSON")
        return decode_json_object(self.payload)

    def encode(self) -> bytes:
        return encode_frame(self.tag, self.payload)


def encode_frame(tag: int, payload: bytes) -> bytes:
    if isinstance(tag, bool) or tag not in KNOWN_TAGS:
        raise ValueError(f"unknown frame tag {tag!r}")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload of {len(payload)} bytes does not fit a u32 length")
    return HEADER.pack(tag, len(payload)) + bytes(payload)


def _finite(obj: Any) -> Any:
    """A copy of a JSON-able structure with NaN/inf floats replaced by None (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps_json(obj: Any) -> str:
    """Compact, strictly valid JSON text for anything the server sends.

    Non-finite floats (e.g. an ``rtf`` of a zero-length take) become ``null`` instead of the
    non-standard ``NaN`` that browsers refuse. Strings are emitted as UTF-8 text; a string with a
    lone surrogate falls back to ``\\u`` escapes so that encoding never fails.
    """
    try:
        text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(obj), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=True)
    return text


def encode_json_frame(obj: dict[str, Any]) -> bytes:
    return encode_frame(TAG_JSON, dumps_json(obj).encode("utf-8"))


def encode_pcm_frame(pcm: bytes) -> bytes:
    return encode_frame(TAG_PCM, pcm)


def encode_audio_frame(data: bytes) -> bytes:
    """A tag-2 frame: the next bytes of a take's audio in its delivery format."""
    return encode_frame(TAG_AUDIO, data)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def decode_json_object(payload: bytes | bytearray | memoryview | str) -> dict[str, Any]:
    """Strict JSON (RFC 8259, UTF-8, no NaN/Infinity) holding an object, or ProtocolError.

    ``bad_json`` when the text is not JSON at all (including invalid UTF-8, nesting too deep,
    integers longer than Python's 4300-digit limit); ``bad_message`` when it is JSON but not an object.
    """
    if not isinstance(payload, str):
        try:
            payload = bytes(payload).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(ErrorCode.BAD_JSON, f"invalid UTF-8 at byte {exc.start}") from None
    try:
        obj = json.loads(payload, parse_constant=_reject_constant)
    except RecursionError:
        raise ProtocolError(ErrorCode.BAD_JSON, "invalid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, the int digit limit
        raise ProtocolError(ErrorCode.BAD_JSON, f"invalid JSON: {str(exc)[:120]}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"a JSON object is expected, got {type(obj).__name__}")
    return obj


def decode_frame(data: bytes | bytearray | memoryview, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Frame:
    """Decode exactly one frame (a WebSocket binary message holds exactly one)."""
    data = bytes(data)
    if len(data) < HEADER_SIZE:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"a frame needs a {HEADER_SIZE}-byte header, got {len(data)} bytes")
    tag, length = HEADER.unpack_from(data)
    if tag not in KNOWN_TAGS:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"unknown frame tag {tag}")
    if length > max_frame_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"frame of {length} bytes exceeds {max_frame_bytes}")
    if HEADER_SIZE + length != len(data):
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE,
            f"a message must hold exactly one whole frame (header says {length} payload bytes, "
            f"message has {len(data) - HEADER_SIZE})",
        )
    return Frame(tag, data[HEADER_SIZE:])


class FrameReader:
    """Incremental parser: feed bytes split anywhere, get whole frames back in order.

    ``feed`` is eager: it buffers the bytes and returns (as a list) every frame they complete,
    whether or not the caller iterates the result. A corrupt header (unknown tag, length over
    ``max_frame_bytes``) is fatal for the stream: the frames that preceded it in the same call are
    still returned, and the error (``fatal=True``) is raised by that call if it has nothing to
    return, otherwise by the next ``feed``/``close``. After that the reader stays failed.
    """

    def __init__(self, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        if not 0 <= max_frame_bytes <= MAX_PAYLOAD_BYTES:
            raise ValueError(f"max_frame_bytes must be in [0, {MAX_PAYLOAD_BYTES}]")
        self._buf = bytearray()
        self._max = max_frame_bytes
        self._failed: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held that do not yet form a whole frame."""
        return len(self._buf)

    @property
    def failed(self) -> ProtocolError | None:
        """The fatal error this stream hit, if any."""
        return self._failed

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        if self._failed is not None:
            raise self._failed
        buf = self._buf
        buf += data
        frames: list[Frame] = []
        pos, size = 0, len(buf)
        try:
            while pos < size:
                tag = buf[pos]
                if tag not in KNOWN_TAGS:  # checked on the first byte: fail as early as possible
                    raise ProtocolError(ErrorCode.BAD_MESSAGE, f"unknown frame tag {tag}", fatal=True)
                if size - pos < HEADER_SIZE:
                    break
                _, length = HEADER.unpack_from(buf, pos)
                if length > self._max:
                    raise ProtocolError(ErrorCode.TOO_LARGE, f"frame of {length} bytes exceeds {self._max}", fatal=True)
                end = pos + HEADER_SIZE + length
                if end > size:
                    break
                frames.append(Frame(tag, bytes(buf[pos + HEADER_SIZE : end])))
                pos = end
        except ProtocolError as err:
            self._failed = err
            if not frames:
                del buf[:pos]
                raise
        del buf[:pos]
        return frames

    def close(self) -> None:
        """Declare end of input; a partial frame left over is an error."""
        if self._failed is not None:
            raise self._failed
        if self._buf:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"stream ended inside a frame ({len(self._buf)} bytes left)")
