"""Small client-side helpers shared by the reliability tests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any, TypeVar

import requests
import websockets

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def error_of(r: requests.Response) -> dict[str, Any]:
    assert r.headers["Content-Type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    return body["error"]


def decode(data: str | bytes) -> tuple[int, Any]:
    """(tag, JSON object or PCM bytes) of one server frame."""
    assert isinstance(data, bytes)
    tag, length = data[0], int.from_bytes(data[1:5], "big")
    payload = data[5 : 5 + length]
    return tag, (json.loads(payload) if tag == 0 else payload)


async def next_json(ws: websockets.ClientConnection, kind: str | None = None, within: float = 10.0) -> dict[str, Any]:
    """The next tag-0 message (of ``kind`` if given), skipping audio and other messages."""

    async def _wait() -> dict[str, Any]:
        while True:
            tag, obj = decode(await ws.recv())
            if tag == 0 and (kind is None or obj["type"] == kind):
                return obj

    return await asyncio.wait_for(_wait(), within)


async def hello(ws: websockets.ClientConnection) -> dict[str, Any]:
    return await next_json(ws, "hello")


def parse_frames(body: bytes) -> list[tuple[int, Any]]:
    frames, pos = [], 0
    while pos < len(body):
        length = int.from_bytes(body[pos + 1 : pos + 5], "big")
        frames.append(decode(body[pos : pos + 5 + length]))
        pos += 5 + length
    return frames


async def wait_until(pred: Any, within: float, interval: float = 0.005) -> float:
    """Seconds until ``pred()`` held; raises AssertionError on timeout."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not pred():
        if loop.time() - t0 > within:
            raise AssertionError(f"condition not met within {within} s")
        await asyncio.sleep(interval)
    return loop.time() - t0
