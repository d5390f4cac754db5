"""Python clients for moss_rt: the WebSocket directing channel and the legacy HTTP stream.

Both speak wire protocol v1 and return the same :class:`TakeAudio`. Example::

    async with DirectingClient.connect("ws://127.0.0.1:8770/api/ws") as client:
        take = await client.speak("Hello there.", instruction="warm, unhurried")
        take.write_wav("hello.wav")
"""

from __future__ import annotations

import asyncio
import json
import wave
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import websockets

from moss_rt.protocol import (
    TAG_AUDIO,
    TAG_JSON,
    TAG_PCM,
    ErrorMessage,
    FrameReader,
    Hello,
    Pong,
    ServerMessage,
    TakeEnded,
    TakeStarted,
    Words,
    decode_frame,
    parse_server_message,
)


class ServerError(Exception):
    def __init__(self, message: ErrorMessage) -> None:
        super().__init__(f"{message.get('code')}: {message.get('message')}")
        self.code = message.get("code")
        self.message = message


@dataclass
class TakeAudio:
    """One take as a client saw it: metadata frames and the PCM that arrived."""

    sr: int = 48000
    channels: int = 1
    start: dict[str, Any] = field(default_factory=dict)
    end: dict[str, Any] = field(default_factory=dict)
    pcm: bytearray = field(default_factory=bytearray)
    events: list[dict[str, Any]] = field(default_factory=list)
    # A take started with a "format" arrives as tag-2 frames: the bytes of one file in that format.
    encoded: bytearray = field(default_factory=bytearray)
    # A take started with "words": true: its words in order, {"word", "start", "end", "flags"?} (seconds).
    words: list[dict[str, Any]] = field(default_factory=list)

    @property
    def take_id(self) -> str | None:
        return self.start.get("take") or self.end.get("take")

    @property
    def duration_sec(self) -> float:
        return len(self.pcm) / (2 * self.channels * self.sr)

    def write_wav(self, path: str | Path) -> None:
        with wave.open(str(path), "wb") as w:
            w.setnchannels(self.channels)
            w.setsampwidth(2)
            w.setframerate(self.sr)
            w.writeframes(bytes(self.pcm))


@dataclass(frozen=True)
class EncodedAudio:
    """A tag-2 frame: the next bytes of the take's audio in the format its ``start`` asked for."""

    data: bytes


Item = ServerMessage | bytes | EncodedAudio


class DirectingClient:
    """An async client of ``/api/ws``. Server frames are read by :meth:`receive`."""

    def __init__(self, ws: websockets.ClientConnection, hello: Hello) -> None:
        self.ws = ws
        self.hello = hello

    @classmethod
    @asynccontextmanager
    async def connect(cls, url: str, **kwargs: Any) -> AsyncIterator[DirectingClient]:
        async with websockets.connect(url, max_size=16 * 1024 * 1024, **kwargs) as ws:
            first = await cls._read(ws)
            if not isinstance(first, Hello):
                raise RuntimeError(f"expected hello, got {first!r}")
            yield cls(ws, first)

    @staticmethod
    async def _read(ws: websockets.ClientConnection) -> Item:
        data = await ws.recv()
        if isinstance(data, str):
            raise RuntimeError("the server sent a text message; protocol v1 sends frames only")
        frame = decode_frame(data)
        if frame.tag == TAG_JSON:
            return parse_server_message(frame.json())
        if frame.tag == TAG_AUDIO:
            return EncodedAudio(frame.payload)
        return frame.payload

    async def receive(self) -> Item:
        """Next server frame: a ServerMessage (tag 0), PCM bytes (tag 1) or EncodedAudio (tag 2)."""
        return await self._read(self.ws)

    async def send(self, message: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(message))

    async def start(self, text: str, **fields: Any) -> None:
        await self.send({"type": "start", "text": text, **fields})

    async def append(self, text: str) -> None:
        """More text for the take opened with ``start(..., stream_text=True)``."""
        await self.send({"type": "append", "text": text})

    async def end_of_text(self) -> None:
        """No more text: the streamed take ends once everything is spoken."""
        await self.send({"type": "end_of_text"})

    async def cancel(self, take: str | None = None) -> None:
        await self.send({"type": "cancel", **({"take": take} if take else {})})

    async def seek(
        self, take: str, frame: int | None = None, *, word: int | None = None, mode: str = "retake", **overrides: Any
    ) -> None:
        """Retake (or replay) ``take`` from ``frame``, or from where its ``word``-th word starts."""
        where = {"frame": frame} if word is None else {"word": word}
        await self.send({"type": "seek", "take": take, **where, "mode": mode, **overrides})

    async def ping(self) -> Pong:
        await self.send({"type": "ping", "t": asyncio.get_running_loop().time()})
        while True:
            item = await self.receive()
            if isinstance(item, Pong):
                return item

    async def collect(self, *, until_end: bool = True) -> TakeAudio:
        """Gather frames of the current take until its ``end`` (raises ServerError on error)."""
        take = TakeAudio(sr=self.hello.sr)
        while True:
            item = await self.receive()
            if isinstance(item, bytes):
                take.pcm += item
                continue
            if isinstance(item, EncodedAudio):
                take.encoded += item.data
                continue
            take.events.append(item.to_dict())
            if isinstance(item, Words):
                take.words += item.words
            elif isinstance(item, TakeStarted):
                take.start = item.to_dict()
                take.channels = item.channels if isinstance(item.channels, int) else 1
                take.sr = item.sr
            elif isinstance(item, ErrorMessage):
                if isinstance(item.take, str) or item.fatal is True:
                    raise ServerError(item)
            elif isinstance(item, TakeEnded) and until_end:
                take.end = item.to_dict()
                return take

    async def speak(self, text: str, **fields: Any) -> TakeAudio:
        await self.start(text, **fields)
        return await self.collect()


async def fetch_words(base_url: str, take_id: str, fmt: str = "words", timeout_sec: float = 300.0) -> Any:
    """A take's words from ``GET /api/takes/{id}/words`` (``fmt="words"``: the JSON answer's list) or its captions
    (``"srt"``, ``"vtt"``: the file's text); the server aligns them if the take streamed without them."""
    path = f"/api/takes/{take_id}/words" if fmt == "words" else f"/api/takes/{take_id}.{fmt}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_sec)) as http:
        async with http.get(base_url.rstrip("/") + path) as resp:
            if resp.status != 200:
                body = await resp.json(content_type=None)
                raise ServerError(ErrorMessage.from_dict({"code": None, "message": None, **body.get("error", {})}))
            if fmt == "words":
                return (await resp.json())["words"]
            return await resp.text()


async def http_stream(base_url: str, total_timeout_sec: float = 600.0, **fields: Any) -> TakeAudio:
    """The legacy transport: POST /api/stream and parse the frame stream as it arrives."""
    take = TakeAudio()
    reader = FrameReader()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=total_timeout_sec)) as http:
        async with http.post(base_url.rstrip("/") + "/api/stream", json=fields) as resp:
            if resp.status != 200:
                body = await resp.json(content_type=None)
                raise ServerError(ErrorMessage.from_dict({"code": None, "message": None, **body.get("error", {})}))
            async for data in resp.content.iter_any():
                for frame in reader.feed(data):
                    if frame.tag == TAG_PCM:
                        take.pcm += frame.payload
                        continue
                    if frame.tag == TAG_AUDIO:
                        take.encoded += frame.payload
                        continue
                    obj = frame.json()
                    take.events.append(obj)
                    if obj.get("type") == "start":
                        take.start = obj
                        take.sr = int(obj.get("sr", take.sr))
                        take.channels = int(obj.get("channels", 1))
                    elif obj.get("type") == "end":
                        take.end = obj
    reader.close()
    return take
