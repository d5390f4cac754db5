"""Downloads, exports and replays stay within bounded memory and are rate-limited (issue 23, finding 2).

Before: one GET of a long imported take's WAV cost its whole audio twice over in RSS, an export the whole zip,
a replay a render outside the render budget, and none of these GETs counted against the client's rate. Now a
stored take streams from its file in pieces, an export is packed while it is sent, a replay's render is reserved
within ``render_buffer_mb`` (the client's share of it), and all of them cost a request of the client's rate.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import requests

from tests.helpers import OwnerJar, error_of, run
from tests.reliability.archives import valid_archive
from tests.reliability.conftest import raw_http

LONG_FRAMES = 5120  # the longest take a session keeps: 5120 frames of stereo are 78.6 MB of audio


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_long_take_downloads_and_exports_hold_a_few_pieces_each(server_process) -> None:
    server = server_process()
    assert server.proc is not None
    jar = OwnerJar()
    body = jar.request(
        "POST", f"{server.url}/api/sessions/import", data=valid_archive(1, LONG_FRAMES, 2, silent=True), timeout=120
    ).json()
    sid, tid = body["session"], body["takes"][0]["take_id"]
    base = f"/api/sessions/{sid}"
    before = rss_mb(server.proc.pid)
    # Three downloads of the take and one export, none of which reads: each must hold a piece, not the take.
    heads = [f"GET {base}/takes/{tid}.wav", f"GET {base}/takes/{tid}.wav", f"GET {base}/takes/{tid}.wav"]
    heads.append(f"GET {base}/archive")
    socks: list[socket.socket] = []
    try:
        for head in heads:
            socks.append(
                raw_http(
                    server.port,
                    f"{head} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nCookie: moss_rt_owner={jar.cookie}\r\n\r\n",
                    rcvbuf=4096,
                )
            )
        for sock in socks:
            assert sock.recv(12).startswith(b"HTTP/1.1 200")  # each one is streaming
        peak = before
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            peak = max(peak, rss_mb(server.proc.pid))
            time.sleep(0.05)
    finally:
        for sock in socks:
            sock.close()
    # The take is 78.6 MB; held whole per request it would be well over 300 MB here.
    assert peak - before < 48, (before, peak)
    # And a reader gets the take whole.
    r = jar.request("GET", f"{server.url}{base}/takes/{tid}.wav", timeout=60)
    assert r.status_code == 200 and len(r.content) == 44 + LONG_FRAMES * 3840 * 4


def test_replays_render_within_the_render_budget(fast_server) -> None:
    # Nothing streamed is kept, so a replay renders its take's codes; a client may reserve half of 1 MB.
    srv = fast_server(heard_audio_mb=0, render_buffer_mb=1)
    jar = OwnerJar()
    body = jar.request("POST", f"{srv.url}/api/sessions/import", data=valid_archive(1, 100)).json()  # 0.77 MB
    short = jar.request("POST", f"{srv.url}/api/sessions/import", data=valid_archive(1, 40)).json()  # 0.31 MB

    async def replay(session: str, take: str) -> list[dict[str, object]]:
        ws = await jar.connect(srv.ws_url, max_size=None)
        msgs: list[dict[str, object]] = []
        try:
            await ws.send(json.dumps({"type": "resume", "session": session}))
            await ws.send(json.dumps({"type": "seek", "take": take, "frame": 0, "mode": "replay"}))
            async with asyncio.timeout(20):
                # A replay ends with its end, or with a take-level error instead (docs/protocol.md).
                while not msgs or not (
                    msgs[-1]["type"] == "end" or (msgs[-1]["type"] == "error" and msgs[-1].get("take"))
                ):
                    data = await ws.recv()
                    if data[0] == 0:
                        msgs.append(json.loads(data[5:]))
        finally:
            await ws.close()
        return msgs

    msgs = run(replay(body["session"], body["takes"][0]["take_id"]))
    errors = [m for m in msgs if m["type"] == "error"]
    assert errors and errors[0]["code"] == "busy" and errors[0]["take"], msgs  # refused with a clear error
    msgs = run(replay(short["session"], short["takes"][0]["take_id"]))
    assert not [m for m in msgs if m["type"] == "error"] and msgs[-1]["type"] == "end", msgs
    assert srv.state.renders.nbytes == 0  # released when the replay ended


def test_take_downloads_and_exports_count_against_the_request_rate(fast_server) -> None:
    srv = fast_server(http_requests_per_sec=0.01, http_request_burst=4)
    jar = OwnerJar()
    body = jar.request("POST", f"{srv.url}/api/sessions/import", data=valid_archive(1, 2)).json()  # 1 of the 4
    base = f"{srv.url}/api/sessions/{body['session']}"
    assert jar.request("GET", f"{base}/takes/{body['takes'][0]['take_id']}.wav").status_code == 200
    assert jar.request("GET", f"{base}/archive").status_code == 200
    assert jar.request("GET", f"{base}/takes/{body['takes'][0]['take_id']}.wav").status_code == 200
    r = jar.request("GET", f"{base}/archive")
    assert r.status_code == 429 and error_of(r)["code"] == "rate_limited" and r.headers["Retry-After"]
    assert jar.request("GET", base).status_code == 200  # listings stay free
    assert requests.get(f"{srv.url}/healthz", timeout=5).status_code == 200
