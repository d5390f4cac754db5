"""One test per documented limit (docs/limits.md): each is enforced with its stable code."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import requests
import websockets

from moss_rt.protocol import Limits
from tests.conftest import sine_wav
from tests.helpers import error_of, hello, next_json, run
from tests.reliability.conftest import raw_http, read_head


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"text": "x" * 5001}, "text"),
        ({"text": "x", "instruction": "y" * 5001}, "instruction"),
        ({"text": "x", "max_new_tokens": 0}, "max_new_tokens"),
        ({"text": "x", "max_new_tokens": 4097}, "max_new_tokens"),
        ({"text": "x", "chunk_frames": 0}, "chunk_frames"),
        ({"text": "x", "chunk_frames": 101}, "chunk_frames"),
        ({"text": "x", "tokens": 4097}, "tokens"),
        ({"text": "x", "channels": 3}, "channels"),
        ({"text": "x", "language": "l" * 65}, "language"),
        ({"text": "x", "reference": "r" * 129}, "reference"),
    ],
)
def test_field_limits_are_422_on_http_and_invalid_field_on_ws(fast_server, body: dict, field: str) -> None:
    srv = fast_server()
    r = requests.post(f"{srv.url}/api/stream", json=body)
    assert r.status_code == 422
    assert error_of(r)["code"] == "invalid_field" and error_of(r)["field"] == field

    async def scenario() -> None:
        async with websockets.connect(srv.ws_url) as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "start", **body}))
            err = await next_json(ws, "error")
            assert err["code"] == "invalid_field" and err["field"] == field and err["fatal"] is False

    run(scenario())


def test_hello_and_info_advertise_the_limits(fast_server) -> None:
    srv = fast_server()
    info = requests.get(f"{srv.url}/api/info").json()
    for name in ("max_text_chars", "max_upload_bytes", "ws_messages_per_sec", "max_upload_samples"):
        assert name in info["limits"]

    async def scenario() -> None:
        async with websockets.connect(srv.ws_url) as ws:
            assert (await hello(ws))["limits"] == info["limits"]

    run(scenario())


def test_stream_body_refused_from_content_length_before_reading(fast_server) -> None:
    srv = fast_server()
    # Only the headers are sent: the answer comes without the server waiting for a body.
    sock = raw_http(
        int(srv.url.rsplit(":", 1)[1]),
        "POST /api/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000000000\r\n\r\n",
    )
    status, head = read_head(sock)
    sock.close()
    assert status == 413, head


def test_chunked_stream_body_cut_off_past_the_limit(fast_server) -> None:
    srv = fast_server()
    limit = Limits().max_request_bytes

    def body():  # chunked: no Content-Length to check up front
        for _ in range(limit // 4096 + 10):
            yield b" " * 4096

    r = requests.post(f"{srv.url}/api/stream", data=body(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and error_of(r)["code"] == "too_large"


def test_upload_refused_from_content_length_before_reading(fast_server) -> None:
    srv = fast_server(limits=Limits(max_upload_bytes=100_000))
    port = int(srv.url.rsplit(":", 1)[1])
    sock = raw_http(port, "POST /api/upload_ref?ext=wav HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100001\r\n\r\n")
    status, _ = read_head(sock)
    sock.close()
    assert status == 413
    # With Expect: 100-continue the client is told before it sends a byte of the body.
    sock = raw_http(
        port,
        "POST /api/upload_ref?ext=wav HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5000000\r\n"
        "Expect: 100-continue\r\n\r\n",
    )
    status, _ = read_head(sock)
    sock.close()
    assert status == 413
    # A chunked upload is cut off while streaming.
    big = sine_wav(seconds=5.0, sr=24000)
    r = requests.post(
        f"{srv.url}/api/upload_ref?ext=wav", data=iter([big[i : i + 8192] for i in range(0, len(big), 8192)])
    )
    assert r.status_code == 413 and error_of(r)["code"] == "too_large"
    # Under the limit, with Expect: 100-continue, the upload goes through.
    ok = sine_wav(seconds=1.0, sr=16000)
    r = requests.post(f"{srv.url}/api/upload_ref?ext=wav", data=ok, headers={"Expect": "100-continue"})
    assert r.status_code == 200, r.text


def test_ws_message_size_limit(fast_server) -> None:
    srv = fast_server()
    limit = Limits().max_message_bytes

    async def scenario() -> None:
        async with websockets.connect(srv.ws_url, max_size=None) as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "ping", "t": 1, "pad": "x" * limit}))
            err = await next_json(ws, "error")
            assert err["code"] == "too_large" and err["fatal"] is False
            await ws.send(json.dumps({"type": "ping", "t": 2}))
            assert (await next_json(ws, "pong"))["t"] == 2
        # An absurd message is cut off by the transport without being buffered: close 1009.
        async with websockets.connect(srv.ws_url, max_size=None) as ws:
            await hello(ws)
            await ws.send(b"\x80" * (4 * limit + 1))
            with pytest.raises(websockets.ConnectionClosed):
                await next_json(ws)
            assert ws.close_code == 1009

    run(scenario())


def test_ws_message_rate_limit_then_recovery(fast_server) -> None:
    srv = fast_server(limits=Limits(ws_messages_per_sec=5.0, ws_message_burst=5))

    async def scenario() -> None:
        async with websockets.connect(srv.ws_url) as ws:
            await hello(ws)
            for i in range(20):
                await ws.send(json.dumps({"type": "ping", "t": i}))
            got: list[dict] = []
            while len(got) < 6:
                got.append(await next_json(ws))
            pongs = [m for m in got if m["type"] == "pong"]
            errors = [m for m in got if m["type"] == "error"]
            assert len(pongs) == 5 and [p["t"] for p in pongs] == [0, 1, 2, 3, 4]
            assert len(errors) == 1 and errors[0]["code"] == "rate_limited" and errors[0]["fatal"] is False
            await asyncio.sleep(0.5)  # the bucket refills at 5/s
            await ws.send(json.dumps({"type": "ping", "t": 99}))
            assert (await next_json(ws, "pong"))["t"] == 99

    run(scenario())


def test_ws_message_flood_is_closed_1008(fast_server) -> None:
    srv = fast_server(limits=Limits(ws_messages_per_sec=1.0, ws_message_burst=2))

    async def scenario() -> None:
        async with websockets.connect(srv.ws_url) as ws:
            await hello(ws)
            for i in range(400):
                await ws.send(json.dumps({"type": "ping", "t": i}))
            fatal = None
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    msg = await next_json(ws)
                    if msg["type"] == "error" and msg["fatal"]:
                        fatal = msg
            assert fatal is not None and fatal["code"] == "rate_limited"
            assert ws.close_code == 1008

    run(scenario())
    assert requests.get(f"{srv.url}/healthz").status_code == 200


def test_max_connections_refused_with_503_before_upgrade(fast_server) -> None:
    srv = fast_server(max_connections=2)

    async def scenario() -> None:
        async with websockets.connect(srv.ws_url) as a, websockets.connect(srv.ws_url) as b:
            await hello(a)
            await hello(b)
            with pytest.raises(websockets.InvalidStatus) as info:
                async with websockets.connect(srv.ws_url):
                    pass
            response = info.value.response
            assert response.status_code == 503
            assert json.loads(response.body)["error"]["code"] == "busy"
            assert int(response.headers["Retry-After"]) >= 1
        # The slots are given back when sockets close.
        await asyncio.sleep(0.2)
        async with websockets.connect(srv.ws_url) as c:
            await hello(c)

    run(scenario())


async def start_once_the_cap_allows(ws: websockets.ClientConnection) -> dict:
    """Start a short take; the server releases an ended take's place right after sending its end,
    so a start racing that release may still be refused: retry it for a while. Returns the end."""
    for _ in range(200):
        await ws.send(json.dumps({"type": "start", "text": "second", "tokens": 3}))
        message = await next_json(ws)
        if message["type"] == "error" and message["code"] == "rate_limited":
            await asyncio.sleep(0.05)
            continue
        return message if message["type"] == "end" else await next_json(ws, "end")
    raise AssertionError("the take's place was never given back")


def test_takes_per_client_across_connections_and_transports(fast_server) -> None:
    srv = fast_server(max_takes_per_client=1, frame_ms=20.0)

    async def scenario() -> None:
        async with websockets.connect(srv.ws_url) as a, websockets.connect(srv.ws_url) as b:
            await hello(a)
            await hello(b)
            await a.send(json.dumps({"type": "start", "text": "long " * 100}))
            await next_json(a, "start")
            await b.send(json.dumps({"type": "start", "text": "second"}))
            err = await next_json(b, "error")
            assert err["code"] == "rate_limited" and err["take"]
            r = await asyncio.to_thread(requests.post, f"{srv.url}/api/stream", json={"text": "third"})
            assert r.status_code == 429 and error_of(r)["code"] == "rate_limited"
            assert r.headers["Retry-After"] == "1"
            # Once the first take ends, the client may start another.
            await a.send(json.dumps({"type": "cancel"}))
            assert (await next_json(a, "end"))["reason"] == "cancelled"
            assert (await start_once_the_cap_allows(b))["reason"] == "done"

    run(scenario())


def test_a_replay_counts_toward_the_takes_per_client(fast_server) -> None:
    # Paced to 0.5 s ahead of real time, replaying 100 frames (8 s) keeps running while b tries.
    srv = fast_server(max_takes_per_client=1, frame_ms=1.0, max_lead_sec=0.5)

    async def scenario() -> None:
        async with websockets.connect(srv.ws_url) as a, websockets.connect(srv.ws_url) as b:
            await hello(a)
            await hello(b)
            await a.send(json.dumps({"type": "start", "text": "to replay", "tokens": 100}))
            take = (await next_json(a, "end", within=10))["take"]
            await a.send(json.dumps({"type": "seek", "take": take, "frame": 0, "mode": "replay"}))
            assert (await next_json(a, "start"))["replay"] is True
            await b.send(json.dumps({"type": "start", "text": "second"}))
            err = await next_json(b, "error")
            assert err["code"] == "rate_limited", err
            await a.send(json.dumps({"type": "cancel"}))
            assert (await next_json(a, "end"))["reason"] == "cancelled"
            assert (await start_once_the_cap_allows(b))["reason"] == "done"

    run(scenario())


def test_takes_kept_per_connection_is_bounded(fast_server) -> None:
    srv = fast_server(limits=Limits(max_takes_kept=2))

    async def scenario() -> None:
        async with websockets.connect(srv.ws_url) as ws:
            await hello(ws)
            ids = []
            for i in range(3):
                await ws.send(json.dumps({"type": "start", "text": f"take {i}", "tokens": 3}))
                ids.append((await next_json(ws, "end"))["take"])
            await ws.send(json.dumps({"type": "seek", "take": ids[0], "frame": 1, "mode": "replay"}))
            err = await next_json(ws, "error")
            assert err["code"] == "not_found" and err["field"] == "take"
            await ws.send(json.dumps({"type": "seek", "take": ids[2], "frame": 1, "mode": "replay"}))
            assert (await next_json(ws, "end"))["reason"] == "done"

    run(scenario())


def test_engine_queue_full_is_503_busy_on_ws(fast_server) -> None:
    """One slot and a queue of one: of three takes at once, one runs, at most one waits, the rest are busy."""
    srv = fast_server(max_slots=1, max_queue=1, frame_ms=50.0)

    async def first_outcome(ws: websockets.ClientConnection) -> str:
        # A queued take says nothing until the running one ends, so silence counts as "queued".
        try:
            while True:
                msg = await next_json(ws, within=3)
                if msg["type"] in ("start", "error"):
                    return str(msg.get("code", "started"))
        except TimeoutError:
            return "queued"

    async def scenario() -> None:
        sockets = [await websockets.connect(srv.ws_url) for _ in range(3)]
        try:
            for ws in sockets:
                await hello(ws)
                await ws.send(json.dumps({"type": "start", "text": "busy " * 40}))
            outcomes = await asyncio.gather(*(first_outcome(ws) for ws in sockets))
            assert outcomes.count("started") == 1, outcomes
            assert outcomes.count("busy") >= 1 and outcomes.count("queued") <= 1, outcomes
        finally:
            for ws in sockets:
                await ws.close()

    run(scenario())


def test_limits_hold_under_parallel_abuse_and_server_keeps_serving(fast_server) -> None:
    """Many oversize and malformed requests in parallel: all 4xx, then a normal take works."""
    srv = fast_server()
    statuses: list[int] = []
    lock = threading.Lock()

    def abuse(i: int) -> None:
        bodies = [b"{", b"[]", json.dumps({"text": "x" * 6000}).encode(), b"x" * (300 * 1024)]
        r = requests.post(f"{srv.url}/api/stream", data=bodies[i % len(bodies)])
        with lock:
            statuses.append(r.status_code)

    threads = [threading.Thread(target=abuse, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(400 <= s < 500 for s in statuses), statuses
    r = requests.post(f"{srv.url}/api/stream", json={"text": "still here", "tokens": 2})
    assert r.status_code == 200


def test_an_unexpected_failure_before_streaming_gives_the_clients_take_back(fast_server) -> None:
    srv = fast_server(max_takes_per_client=1)
    real_submit = srv.engine.submit
    failures = {"left": 1}

    async def submit_failing_once(spec):  # noqa: ANN001, ANN202 - stands in for Engine.submit
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("engine fell over")
        return await real_submit(spec)

    srv.engine.submit = submit_failing_once
    r = requests.post(f"{srv.url}/api/stream", json={"text": "first", "tokens": 2}, timeout=30)
    assert r.status_code == 500 and error_of(r)["code"] == "internal"
    assert "fell over" not in r.text  # no internals in the answer
    # With a cap of one take per client, this is refused (429) if the failed request kept its take.
    r = requests.post(f"{srv.url}/api/stream", json={"text": "second", "tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
