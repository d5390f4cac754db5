"""The frame codec shared by the HTTP stream and the WebSocket channel.

One frame is ``[u8 tag][u32 big-endian length][payload]``. Tag 0 carries a UTF-8 JSON object,
tag 1 raw little-endian int16 PCM. This module is pure: bytes in, frames out.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from moss_rt.protocol.errors import ErrorCode, ProtocolError

TAG_JSON = 0
TAG_PCM = 1
KNOWN_TAGS = frozenset({TAG_JSON, TAG_PCM})

HEADER = struct.Struct(">BI")
HEADER_SIZE = HEADER.size

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


def encode_frame(tag: int, payload: bytes) -> bytes:
    if tag not in KNOWN_TAGS:
        raise ValueError(f"unknown frame tag {tag}")
    return HEADER.pack(tag, len(payload)) + payload


def encode_json_frame(obj: dict[str, Any]) -> bytes:
    # Compact separators keep the legacy stream byte-compatible with json.dumps defaults
    # being irrelevant to parsers; ensure_ascii=False keeps UTF-8 text readable.
    return encode_frame(TAG_JSON, json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode())


def encode_pcm_frame(pcm: bytes) -> bytes:
    return encode_frame(TAG_PCM, pcm)


def decode_json_object(payload: bytes | str) -> dict[str, Any]:
    try:
        obj = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ProtocolError(ErrorCode.BAD_JSON, f"invalid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "a JSON object is expected")
    return obj


def decode_frame(data: bytes, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Frame:
    """Decode exactly one frame (a WebSocket binary message holds exactly one)."""
    reader = FrameReader(max_frame_bytes=max_frame_bytes)
    frames = list(reader.feed(data))
    if len(frames) != 1 or reader.buffered:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "a message must hold exactly one whole frame")
    return frames[0]


class FrameReader:
    """Incremental parser: feed bytes split anywhere, get whole frames back in order.

    After a ProtocolError the stream is unusable (its framing is lost); create a new reader.
    """

    def __init__(self, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_frame_bytes
        self._failed: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held that do not yet form a whole frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> Iterator[Frame]:
        if self._failed is not None:
            raise self._failed
        self._buf += data
        while len(self._buf) >= HEADER_SIZE:
            tag, length = HEADER.unpack_from(self._buf)
            if tag not in KNOWN_TAGS:
                self._failed = ProtocolError(ErrorCode.BAD_MESSAGE, f"unknown frame tag {tag}", fatal=True)
                raise self._failed
            if length > self._max:
                self._failed = ProtocolError(
                    ErrorCode.TOO_LARGE, f"frame of {length} bytes exceeds {self._max}", fatal=True
                )
                raise self._failed
            end = HEADER_SIZE + length
            if len(self._buf) < end:
                return
            payload = bytes(self._buf[HEADER_SIZE:end])
            del self._buf[:end]
            yield Frame(tag, payload)

    def close(self) -> None:
        """Declare end of input; a partial frame left over is an error."""
        if self._buf:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"stream ended inside a frame ({len(self._buf)} bytes left)")
