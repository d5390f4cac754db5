"""Slow, stalled, dead and departed clients: takes pause, slots are freed, sockets are closed."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import requests
import websockets

from tests.helpers import hello, next_json, run, wait_until
from tests.reliability.conftest import raw_http, raw_ws_connect, read_head, ws_client_frame


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def post_stream_head(body: str) -> str:
    """A complete raw ``POST /api/stream`` request with a JSON body."""
    headers = f"Host: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return f"POST /api/stream HTTP/1.1\r\n{headers}\r\n{body}"


def drained_until_closed(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Read what the server had sent; True once the server closed (EOF or reset)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def test_ws_reader_that_stops_is_paused_then_dropped_and_slot_freed(fast_server) -> None:
    srv = fast_server(frame_ms=2.0, send_stall_timeout_sec=1.5)
    state = srv.state
    sock = raw_ws_connect(port_of(srv.url), rcvbuf=4096)
    start = {"type": "start", "text": "stall " * 400, "channels": 2, "chunk_frames": 4}
    sock.sendall(ws_client_frame(json.dumps(start).encode()))

    async def scenario() -> None:
        await wait_until(lambda: srv.engine.active_count == 1, 5)
        conn = next(iter(state.connections))
        # Nothing is read: the socket buffers fill, the send blocks, the engine stops stepping the take.
        await wait_until(lambda: conn.current_handle is not None and conn.current_handle.paused, 5)
        # ... and after the stall timeout the client is dropped and its slot freed.
        # (The connection leaves state.connections before its close handshake, which a client that does
        # not read may hold for CLOSE_TIMEOUT_SEC; its admission slot is given back after that.)
        waited = await wait_until(
            lambda: srv.engine.active_count == 0 and not state.connections and state.ws_slots == 0, 6
        )
        assert waited < 5
        assert state.client_takes.running("127.0.0.1") == 0

    run(scenario())
    assert drained_until_closed(sock)
    sock.close()
    # The server still serves everyone else.
    r = requests.post(f"{srv.url}/api/stream", json={"text": "next", "tokens": 2})
    assert r.status_code == 200


def test_http_stream_reader_that_stops_is_dropped_and_slot_freed(fast_server) -> None:
    srv = fast_server(frame_ms=2.0, send_stall_timeout_sec=1.0)
    body = json.dumps({"text": "stall " * 400, "chunk_frames": 4})
    sock = raw_http(
        port_of(srv.url),
        post_stream_head(body),
        rcvbuf=4096,
    )

    async def scenario() -> None:
        await wait_until(lambda: srv.engine.active_count == 1, 5)
        waited = await wait_until(lambda: srv.engine.active_count == 0 and not srv.state.http_takes, 6)
        assert waited < 5

    run(scenario())
    assert drained_until_closed(sock)
    sock.close()


# The next two tests use long frames (2 s), and their takes would run 360 of them (12 minutes).
# A vanished client is usually noticed at once (the socket reports the reset), but sometimes only
# when the next frame's write fails, i.e. at the next frame boundary: "within one frame" is
# checked as "before 1.5 frames", which no loaded CI machine blurs and a take left running fails.
SLOW_FRAME_MS = 2000.0
AT_THE_NEXT_FRAME = 1.5


def test_ws_disconnect_mid_take_frees_the_slot_within_one_frame(fast_server) -> None:
    frame_ms = SLOW_FRAME_MS
    srv = fast_server(frame_ms=frame_ms)

    async def scenario() -> None:
        ws = await websockets.connect(srv.ws_url)
        await hello(ws)
        await ws.send(json.dumps({"type": "start", "text": "bye " * 100, "chunk_frames": 1}))
        await next_json(ws, "start")
        assert srv.engine.active_count == 1
        ws.transport.abort()  # vanish without a close handshake (cable pulled, tab killed)
        waited = await wait_until(lambda: srv.engine.active_count == 0, 3 * frame_ms / 1000.0)
        assert waited < AT_THE_NEXT_FRAME * frame_ms / 1000.0, waited

    run(scenario())


def test_http_disconnect_mid_take_frees_the_slot_within_one_frame(fast_server) -> None:
    frame_ms = SLOW_FRAME_MS
    srv = fast_server(frame_ms=frame_ms)
    body = json.dumps({"text": "bye " * 100, "chunk_frames": 1})
    sock = raw_http(
        port_of(srv.url),
        post_stream_head(body),
    )
    status, _ = read_head(sock)
    assert status == 200
    sock.recv(100)  # the start frame is out: the take is running

    async def scenario() -> None:
        assert srv.engine.active_count == 1
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()  # RST
        waited = await wait_until(lambda: srv.engine.active_count == 0, 3 * frame_ms / 1000.0)
        assert waited < AT_THE_NEXT_FRAME * frame_ms / 1000.0, waited

    run(scenario())


def test_idle_websocket_is_closed_but_not_while_a_take_plays(fast_server) -> None:
    srv = fast_server(ws_idle_timeout_sec=0.5, frame_ms=20.0)

    async def scenario() -> None:
        # The server's idle clock starts when the socket opens, so ours does too (a hello held up by a slow event
        # loop would otherwise shorten the idle time this test sees).
        t0 = time.monotonic()
        async with websockets.connect(srv.ws_url) as ws:
            await hello(ws)
            try:
                await asyncio.wait_for(ws.recv(), 5)
            except websockets.ConnectionClosed:
                pass
            # Closed by the idle timer (its reason says so) at 0.5 s: never sooner, and not much later even while
            # other tests load the machine.
            assert 0.4 < time.monotonic() - t0 < 4.0
            assert ws.close_code == 1000 and ws.close_reason == "idle timeout"
        # A take longer than the idle timeout (1.2 s) plays to its end without the client sending anything.
        async with websockets.connect(srv.ws_url) as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "start", "text": "listen", "tokens": 60}))
            end = await next_json(ws, "end", within=5)
            assert end["reason"] == "done" and end["n_frames"] == 60

    run(scenario())
    assert not srv.state.connections


def test_dead_peer_that_never_answers_pings_is_dropped(fast_server) -> None:
    srv = fast_server(ws_heartbeat_sec=0.4)
    sock = raw_ws_connect(port_of(srv.url))  # never reads, so never answers a ping

    async def scenario() -> None:
        await wait_until(lambda: len(srv.state.connections) == 1, 2)
        # A ping at 0.4 s left unanswered for 0.2 s drops it: far sooner than any other timeout would.
        waited = await wait_until(lambda: not srv.state.connections and srv.state.ws_slots == 0, 10)
        assert waited < 5.0

    run(scenario())
    sock.close()


def test_live_client_answering_pings_stays_connected(fast_server) -> None:
    srv = fast_server(ws_heartbeat_sec=0.2)

    async def scenario() -> None:
        async with websockets.connect(srv.ws_url) as ws:  # the library answers pings by itself
            await hello(ws)
            await asyncio.sleep(1.0)
            await ws.send(json.dumps({"type": "ping", "t": 1}))
            assert (await next_json(ws, "pong"))["t"] == 1

    run(scenario())
