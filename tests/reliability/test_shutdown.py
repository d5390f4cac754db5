"""Graceful shutdown: a real server process gets SIGTERM/SIGINT in the middle of takes."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from typing import Any

import pytest
import requests
import websockets

from moss_rt.protocol import FrameReader
from tests.helpers import decode, error_of, hello, next_json, run

GRACE_SEC = 3.0
# on_shutdown waits at most the grace for end frames, aiohttp then waits at most the grace for
# handlers, the engine thread is joined for at most 5 s; plus interpreter start-up slack.
EXIT_BOUND_SEC = 2 * GRACE_SEC + 6.0


def http_stream_client(url: str, frames: list[tuple[int, Any]], started: threading.Event) -> None:
    with requests.post(f"{url}/api/stream", json={"text": "long", "tokens": 4000, "chunk_frames": 1}, stream=True) as r:
        assert r.status_code == 200
        reader = FrameReader()
        for chunk in r.raw.stream(4096, decode_content=False):
            for frame in reader.feed(chunk):
                frames.append((frame.tag, json.loads(frame.payload) if frame.tag == 0 else len(frame.payload)))
                if frame.tag == 0:
                    started.set()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_mid_take_ends_takes_with_shutdown_then_1001_and_exits(server_process, sig: int) -> None:
    proc = server_process("--frame-ms", "20", "--max-lead-sec", "0", "--shutdown-grace-sec", str(GRACE_SEC))
    http_frames: list[tuple[int, Any]] = []
    http_started = threading.Event()
    http_thread = threading.Thread(target=http_stream_client, args=(proc.url, http_frames, http_started))

    async def scenario() -> float:
        async with websockets.connect(proc.ws_url) as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "start", "text": "long", "tokens": 4000, "chunk_frames": 1}))
            await next_json(ws, "start")
            http_thread.start()
            assert await asyncio.to_thread(http_started.wait, 10)
            t_signal = time.monotonic()
            proc.signal(sig)
            messages: list[dict[str, Any]] = []
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    tag, obj = decode(await asyncio.wait_for(ws.recv(), 10))
                    if tag == 0:
                        messages.append(obj)
            assert messages and messages[-1]["type"] == "end", messages
            assert messages[-1]["reason"] == "shutdown"
            assert ws.close_code == 1001
            return t_signal

    t_signal = run(scenario())
    http_thread.join(15)
    assert not http_thread.is_alive()
    jsons = [obj for tag, obj in http_frames if tag == 0]
    assert jsons[0]["type"] == "start"
    assert jsons[-1]["type"] == "end" and jsons[-1]["reason"] == "shutdown", jsons[-3:]
    assert proc.wait(EXIT_BOUND_SEC) == 0
    assert time.monotonic() - t_signal < EXIT_BOUND_SEC


def test_shutdown_refuses_new_work_and_readyz_says_so(fast_server) -> None:
    """While shutting down (the flag on_shutdown sets first), nothing new is admitted."""
    srv = fast_server()

    async def scenario() -> None:
        async with websockets.connect(srv.ws_url) as ws:
            await hello(ws)
            srv.state.shutting_down = True
            r = await asyncio.to_thread(requests.get, f"{srv.url}/readyz")
            assert r.status_code == 503 and r.json()["status"] == "shutting_down"
            r = await asyncio.to_thread(requests.post, f"{srv.url}/api/stream", json={"text": "x"})
            assert r.status_code == 503 and error_of(r)["code"] == "busy" and r.headers["Retry-After"]
            with pytest.raises(websockets.InvalidStatus) as info:
                async with websockets.connect(srv.ws_url):
                    pass
            assert info.value.response.status_code == 503
            await ws.send(json.dumps({"type": "start", "text": "x"}))
            assert (await next_json(ws, "error"))["code"] == "busy"
            assert (await asyncio.to_thread(requests.get, f"{srv.url}/healthz")).status_code == 200
            srv.state.shutting_down = False

    run(scenario())
