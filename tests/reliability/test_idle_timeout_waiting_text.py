"""Issue 23, finding 11: a take fed with text (``stream_text``) that waits for text forever bypassed the idle
timeout: the socket counted as busy, so a client that opened such a take and then sent nothing held its
connection (and its slot) for ever. A take waiting for text is idle now: at the idle timeout it ends with
reason ``timeout``, then the socket closes 1000 "idle timeout".
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import websockets

from tests.helpers import RunningServer, decode, hello, run

IDLE_SEC = 0.5


def test_a_take_waiting_for_text_ends_at_the_idle_timeout(fast_server: Callable[..., RunningServer]) -> None:
    server = fast_server(ws_idle_timeout_sec=IDLE_SEC)

    async def scenario() -> tuple[list[dict[str, object]], int, int | None, str | None]:
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "start", "stream_text": True, "text": "Hello there. ", "tokens": 4}))
            messages: list[dict[str, object]] = []
            frames = 0
            try:
                while True:  # it speaks its sentence, then waits for text that never comes
                    tag, obj = decode(await asyncio.wait_for(ws.recv(), 10 * IDLE_SEC + 5))
                    if tag == 0:
                        messages.append(obj)
                    else:
                        frames += len(obj) // 7680
            except websockets.ConnectionClosed:
                pass
            return messages, frames, ws.close_code, ws.close_reason

    messages, frames, code, reason = run(scenario())
    kinds = [(m["type"], m.get("reason")) for m in messages]
    assert kinds == [("start", None), ("end", "timeout")], messages
    assert messages[1]["n_frames"] == frames == 4  # what it spoke stays its audio
    assert (code, reason) == (1000, "idle timeout")
