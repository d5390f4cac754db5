"""The red-team findings of issue 16: each attack as a hostile client would make it, on 127.0.0.1.

Slow and stalled clients are raw sockets with small receive windows; memory is the RSS of this
process (the server runs in a thread of it), with bounds far from both the fixed and the broken
behaviour so a busy machine cannot flip the outcome.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from pathlib import Path

import requests

from moss_rt.engine.base import EngineBusy
from tests.conftest import sine_wav
from tests.helpers import RunningServer, error_of, parse_frames, run, wait_until
from tests.reliability.conftest import raw_http, raw_ws_connect, read_head

KEY = "k" * 32
FRAME_BYTES = 3840 * 2  # one mono 80 ms frame of int16 PCM


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def long_take(srv: RunningServer, frames: int) -> str:
    body = {"text": "long " * 50, "tokens": frames, "max_new_tokens": frames, "chunk_frames": 100}
    r = requests.post(f"{srv.url}/api/stream", json=body, timeout=120)
    assert r.status_code == 200, r.text
    frames_out = parse_frames(r.content)
    end = frames_out[-1][1]
    assert end["type"] == "end" and end["n_frames"] == frames, end
    return frames_out[0][1]["take"]


def drain(sock: socket.socket, timeout: float = 20.0) -> tuple[int, bool]:
    """Bytes the server had sent before it closed; True when it did close (EOF or reset)."""
    sock.settimeout(timeout)
    received = 0
    try:
        while chunk := sock.recv(1 << 20):
            received += len(chunk)
    except ConnectionResetError:
        return received, True
    except TimeoutError:
        return received, False
    return received, True


# --------------------------------------------------------------------------- 1. unread downloads


def _unread_downloads_stay_small(srv: RunningServer, take: str, n: int) -> None:
    port = port_of(srv.url)
    total = 44 + 1920 * FRAME_BYTES
    before = rss_mb()
    socks = [
        raw_http(port, f"GET /api/takes/{take}.wav HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n", rcvbuf=4096)
        for _ in range(n)
    ]
    connections = srv.state.client_connections

    async def until(pred: Callable[[], object], within: float) -> None:
        await wait_until(pred, within)

    run(until(lambda: connections.open("127.0.0.1") == n, 10))  # every download has started
    # A moment for them to write what the sockets take (a shorter one only measures less: never a false failure).
    time.sleep(1.0)
    grown = rss_mb() - before
    # Whole files in memory were n x 14.7 MB (plus a copy each): 350 MB and more for 24 of them.
    assert grown < 120, f"RSS grew by {grown:.0f} MB for {n} unread downloads"
    # The stall timeout (2 s) drops every one of them, and their requests are released ...
    run(until(lambda: connections.open("127.0.0.1") == 0, 30))
    # ... with their files cut short.
    for sock in socks:
        received, closed = drain(sock)
        assert closed and received < total, (received, closed)
        sock.close()
    # A reader still gets the whole file, byte for byte what a take's stream sent.
    r = requests.get(f"{srv.url}/api/takes/{take}.wav", timeout=60)
    assert r.status_code == 200 and len(r.content) == total and r.headers["Content-Length"] == str(total)
    assert r.content[:4] == b"RIFF" and r.content[40:44] == (1920 * FRAME_BYTES).to_bytes(4, "little")
    # The render it shared is given back once its last reader is done (the server's side of the request ends
    # after the client has read the last byte).
    run(until(lambda: srv.state.renders.nbytes == 0, 10))


def test_unread_downloads_of_streamed_audio_hold_little_and_are_dropped(fast_server) -> None:
    srv = fast_server(frame_ms=1.0, send_stall_timeout_sec=2.0)
    _unread_downloads_stay_small(srv, long_take(srv, 1920), 24)


def test_unread_downloads_of_rendered_audio_share_one_render(fast_server) -> None:
    # No streamed audio is kept: every download renders the take's codes.
    srv = fast_server(frame_ms=1.0, send_stall_timeout_sec=2.0, heard_audio_mb=0)
    _unread_downloads_stay_small(srv, long_take(srv, 1920), 24)


def test_download_is_busy_when_renders_are_over_budget_or_the_engine_is_full(fast_server) -> None:
    srv = fast_server(frame_ms=1.0, heard_audio_mb=0, render_buffer_mb=1)
    take = long_take(srv, 200)  # 1.5 MB of audio: more than the renders' budget
    r = requests.get(f"{srv.url}/api/takes/{take}.wav")
    assert r.status_code == 503 and error_of(r)["code"] == "busy" and "Retry-After" in r.headers

    srv2 = fast_server(frame_ms=1.0, heard_audio_mb=0)
    take = long_take(srv2, 20)

    async def full(*_: object) -> bytes:
        raise EngineBusy(retry_after_sec=1.0)

    srv2.state.engine.render = full  # type: ignore[method-assign]
    r = requests.get(f"{srv2.url}/api/takes/{take}.wav")
    assert r.status_code == 503 and error_of(r)["code"] == "busy" and r.headers["Retry-After"] == "1"


# --------------------------------------------------------------------------- 3. cross-site requests


def test_cross_site_posts_are_refused_on_a_keyless_server(fast_server) -> None:
    srv = fast_server()
    evil = {"Origin": "https://evil.example", "Content-Type": "text/plain"}
    r = requests.post(f"{srv.url}/api/stream", data=b'{"text": "x"}', headers=evil)
    assert r.status_code == 403 and error_of(r) == {
        "code": "forbidden_origin",
        "message": error_of(r)["message"],
        "field": "Origin",
    }
    r = requests.post(f"{srv.url}/api/upload_ref?ext=wav", data=b"RIFF", headers=evil)
    assert r.status_code == 403 and error_of(r)["code"] == "forbidden_origin"
    # A text/plain body (what a page may send without a preflight) is not JSON, whatever the origin.
    r = requests.post(f"{srv.url}/api/stream", data=b'{"text": "x"}', headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and error_of(r)["code"] == "unsupported_media_type"
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    assert requests.post(f"{srv.url}/api/stream", data=b"text=x", headers=form).status_code == 415
    # The studio (same origin, JSON) and scripts (no Origin, bare or JSON bodies) are served.
    same = {"Origin": srv.url, "Content-Type": "application/json"}
    assert requests.post(f"{srv.url}/api/stream", data=b'{"text": "x", "tokens": 2}', headers=same).status_code == 200
    assert requests.post(f"{srv.url}/api/stream", data=b'{"text": "x", "tokens": 2}').status_code == 200
    assert requests.post(f"{srv.url}/api/stream", json={"text": "x", "tokens": 2}).status_code == 200


def test_listed_origins_may_post(fast_server) -> None:
    srv = fast_server(allowed_origins=("https://studio.example",), cors_origins=("https://app.example",))
    for origin in ("https://studio.example", "https://app.example"):
        r = requests.post(f"{srv.url}/api/stream", json={"text": "x", "tokens": 2}, headers={"Origin": origin})
        assert r.status_code == 200, (origin, r.text)
    r = requests.post(f"{srv.url}/api/stream", json={"text": "x"}, headers={"Origin": "null"})
    assert r.status_code == 403


def test_dns_rebinding_host_is_refused_without_a_key(fast_server) -> None:
    srv = fast_server()
    port = port_of(srv.url)
    # A rebinding page is "same origin" with itself: its Host and Origin both name it.
    rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
    for method, path in [("GET", "/api/voices"), ("POST", "/api/stream"), ("GET", "/api/info")]:
        r = requests.request(method, srv.url + path, headers=rebound, json={"text": "x"})
        assert r.status_code == 403, (path, r.text)
        assert error_of(r)["code"] == "forbidden_origin" and error_of(r)["field"] == "Host"
    sock = raw_http(
        port,
        f"GET /api/ws HTTP/1.1\r\nHost: evil.example:{port}\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n",
    )
    assert read_head(sock)[0] == 403
    sock.close()
    # Probes answer whatever the Host; localhost names and loopback addresses are served.
    assert requests.get(srv.url + "/healthz", headers={"Host": "10.1.2.3:8770"}).status_code == 200
    for host in (f"localhost:{port}", f"LocalHost:{port}", f"[::1]:{port}", f"127.0.0.2:{port}", "app.localhost"):
        assert requests.get(srv.url + "/api/voices", headers={"Host": host}).status_code == 200, host


def test_allowed_hosts_and_an_api_key_let_other_names_in(fast_server) -> None:
    srv = fast_server(allowed_hosts=("studio.lan",))
    assert requests.get(srv.url + "/api/voices", headers={"Host": "studio.lan:8770"}).status_code == 200
    assert requests.get(srv.url + "/api/voices", headers={"Host": "other.lan"}).status_code == 403
    keyed = fast_server(api_key=KEY)
    r = requests.get(keyed.url + "/api/voices", headers={"Host": "other.lan", "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200


# --------------------------------------------------------------------------- 4. stalled bodies, connection cap


def test_a_stalled_body_is_refused_and_its_connection_closed(fast_server) -> None:
    srv = fast_server(body_stall_timeout_sec=1.0)
    port = port_of(srv.url)
    paths = [("/api/stream", 100_000), ("/api/upload_ref?ext=wav", 1_000_000)]
    # Both bodies stall at once, so aiohttp's linger after each 408 (below) is waited for once, not twice.
    socks = [
        raw_http(
            port,
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {length}\r\n\r\nRIFF",
            timeout=15,
        )
        for path, length in paths
    ]
    for (path, _), sock in zip(paths, socks, strict=True):
        status, _ = read_head(sock)
        assert status == 408, path
    for (path, _), sock in zip(paths, socks, strict=True):
        # aiohttp lingers up to 10 s for the rest of an unread body, then closes.
        assert drain(sock, 20)[1], f"the connection stays open after the timeout ({path})"
        sock.close()


def test_a_dripping_body_is_cut_off_by_the_total_timeout(fast_server) -> None:
    srv = fast_server(body_stall_timeout_sec=1.0, body_read_timeout_sec=2.0)
    port = port_of(srv.url)
    sock = raw_http(port, f"POST /api/stream HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 1000\r\n\r\n")
    t0 = time.monotonic()
    sock.settimeout(0.3)
    while time.monotonic() - t0 < 15:
        try:
            sock.sendall(b" ")  # one byte every 0.3 s: never a stall, never done
            if sock.recv(1, socket.MSG_PEEK):
                break
        except TimeoutError:
            continue
        except OSError:
            break
    sock.settimeout(5)
    assert read_head(sock)[0] == 408
    sock.close()


def test_connections_per_client_are_capped(fast_server) -> None:
    srv = fast_server(max_connections_per_client=3, body_stall_timeout_sec=60.0)
    port = port_of(srv.url)
    head = f"POST /api/stream HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 1000\r\n\r\n{{"
    stalled = [raw_http(port, head) for _ in range(3)]

    async def held() -> None:
        await wait_until(lambda: srv.state.client_connections.open("127.0.0.1") == 3, 10)

    run(held())
    r = requests.get(srv.url + "/api/voices")
    assert r.status_code == 429 and error_of(r)["code"] == "rate_limited" and "Retry-After" in r.headers
    assert requests.get(srv.url + "/healthz").status_code == 200  # probes are not counted
    stalled.pop().close()

    async def one_left() -> None:
        await wait_until(lambda: srv.state.client_connections.open("127.0.0.1") == 2, 10)

    run(one_left())
    assert requests.get(srv.url + "/api/voices").status_code == 200
    for sock in stalled:
        sock.close()


# --------------------------------------------------------------------------- 5. no 500s


def test_non_ascii_credentials_are_unauthorized_not_500(fast_server) -> None:
    srv = fast_server(api_key=KEY)
    port = port_of(srv.url)
    for token in ("é", "v1.99999999999.é.é", "v1.١٢٣.a.b"):
        r = requests.get(srv.url + "/api/voices", params={"token": token})
        assert r.status_code == 401 and error_of(r)["code"] == "unauthorized", token
    for raw_query in ("token=%FF", "token=v1.9999999999.%FF.%ED%B3%BF"):
        r = requests.get(srv.url + "/api/voices?" + raw_query)
        assert r.status_code == 401 and error_of(r)["code"] == "unauthorized", raw_query
    for raw in ("Bearer \xc3\xa9t\xc3\xa9".encode("latin-1"), b"Bearer \xff\xfe", "Bearer é".encode()):
        sock = raw_http(port, "")
        sock.sendall(b"GET /api/voices HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: " + raw + b"\r\n\r\n")
        assert read_head(sock)[0] == 401, raw
        sock.close()
    r = requests.post(srv.url + "/api/token", headers={"Authorization": "Bearer é".encode()})
    assert r.status_code == 401


def test_malformed_host_is_400_not_500(fast_server) -> None:
    for srv in (fast_server(), fast_server(api_key=KEY)):
        port = port_of(srv.url)
        for host in ("[", "[::1", "a b", "x:99999", "[zz]:80"):
            sock = raw_http(
                port,
                f"GET /api/ws HTTP/1.1\r\nHost: {host}\r\nOrigin: https://evil.example\r\nUpgrade: websocket\r\n"
                "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                f"Authorization: Bearer {KEY}\r\n\r\n",
            )
            status, head = read_head(sock)
            assert status == 400, (host, head)
            sock.close()
        # The WebSocket with a good Host still opens.
        raw_ws_connect(port, headers=f"Authorization: Bearer {KEY}\r\n").close()


# --------------------------------------------------------------------------- 7. small ones


def test_the_content_decides_the_stored_type_and_bad_ext_is_echoed_as_sent(fast_server) -> None:
    srv = fast_server()
    wav = sine_wav(1.0)
    r = requests.post(f"{srv.url}/api/upload_ref", params={"ext": "flac"}, data=wav)
    assert r.status_code == 200, r.text
    voice = srv.state.voices.get(r.json()["ref_id"])
    assert voice.path.suffix == ".wav" and voice.path.read_bytes()[:4] == b"RIFF"
    r = requests.post(f"{srv.url}/api/upload_ref", params={"ext": "../x"}, data=wav)
    assert r.status_code == 422 and "'../x'" in error_of(r)["message"]
    # A readable container that is none of the accepted ones is refused, whatever ext says.
    aiff = sine_wav(1.0, fmt="AIFF")
    r = requests.post(f"{srv.url}/api/upload_ref", params={"ext": "wav"}, data=aiff)
    assert r.status_code == 422 and error_of(r)["field"] == "audio" and "AIFF" in error_of(r)["message"]


def test_deeply_nested_msgpack_gets_a_message() -> None:
    from moss_rt.protocol import ProtocolError, decode_client_binary

    for data in (b"\x91" * 5000 + b"\xc0", b"\x81\xa1a" * 3000 + b"\xc0"):
        try:
            decode_client_binary(data)
        except ProtocolError as err:
            assert err.code == "bad_json" and err.message == "invalid msgpack: nested too deeply"
        else:
            raise AssertionError("accepted")


def test_a_reader_whose_take_is_evicted_meanwhile_goes_on_from_a_render(fast_server) -> None:
    from moss_rt.web.downloads import take_pcm

    srv = fast_server(frame_ms=1.0)
    take = srv.state.takes.get(long_take(srv, 40))
    assert take is not None
    size = 40 * FRAME_BYTES

    async def read_across_eviction() -> tuple[bytes, bytes, int]:
        async with take_pcm(srv.state, take) as read:
            heard = await read(0, size)
            srv.state.heard.discard(take.take_id)  # evicted while the reader is halfway
            rendered = await read(0, size)
            return heard, rendered, srv.state.renders.nbytes

    future = asyncio.run_coroutine_threadsafe(read_across_eviction(), srv.loop)
    heard, rendered, held = future.result(30)
    assert len(heard) == size and rendered == heard  # the scripted engine renders what it streamed
    assert held == size and srv.state.renders.nbytes == 0  # the render is held only while read
