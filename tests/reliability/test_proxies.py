"""Clients behind a reverse proxy (X-Forwarded-For believed from trusted proxies only) and the
per-client request rate."""

from __future__ import annotations

import asyncio
import json

import pytest
import requests
import websockets

from moss_rt.web.guards import ClientRequestRate
from moss_rt.web.proxies import client_address, parse_networks
from tests.helpers import error_of, hello, next_json, run

PROXIES = parse_networks(["10.0.0.0/8", "127.0.0.1", "::1"])


@pytest.mark.parametrize(
    ("peer", "header", "client"),
    [
        ("203.0.113.9", ["198.51.100.1"], "203.0.113.9"),  # peer not a proxy: its header is ignored
        ("10.1.2.3", ["198.51.100.1"], "198.51.100.1"),
        ("10.1.2.3", [], "10.1.2.3"),  # a proxy's own request
        # A client may put anything at the left; only the hop our proxy saw counts.
        ("10.1.2.3", ["6.6.6.6, 198.51.100.1"], "198.51.100.1"),
        ("10.1.2.3", ["198.51.100.1, 10.9.9.9"], "198.51.100.1"),  # two trusted hops
        ("10.1.2.3", ["198.51.100.1", "10.9.9.9"], "198.51.100.1"),  # repeated header lines
        ("10.1.2.3", ["10.9.9.9, 10.8.8.8"], "10.9.9.9"),  # all trusted: the farthest one
        ("10.1.2.3", ["not-an-ip"], "10.1.2.3"),  # garbage: stop at the last hop we can vouch for
        ("10.1.2.3", ["198.51.100.1:4711"], "198.51.100.1"),
        ("10.1.2.3", ["[2001:db8::7]:443"], "2001:db8::7"),
        ("::ffff:10.1.2.3", ["198.51.100.1"], "198.51.100.1"),  # IPv4 on a dual-stack socket
        ("::1", ["2001:db8::7"], "2001:db8::7"),
    ],
)
def test_client_address(peer: str, header: list[str], client: str) -> None:
    assert client_address(peer, header, PROXIES) == client


def test_no_trusted_proxies_means_the_peer() -> None:
    assert client_address("10.1.2.3", ["198.51.100.1"], ()) == "10.1.2.3"


def test_bad_proxy_entry_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="not-a-net"):
        parse_networks(["10.0.0.0/8", "not-a-net"])


def _start_http(url: str, forwarded_for: str | None) -> requests.Response:
    headers = {"X-Forwarded-For": forwarded_for} if forwarded_for else {}
    return requests.post(f"{url}/api/stream", json={"text": "short", "tokens": 2}, headers=headers, timeout=30)


def test_takes_per_client_count_forwarded_clients_separately(fast_server) -> None:
    srv = fast_server(max_takes_per_client=1, frame_ms=20.0, trusted_proxies=("127.0.0.1",))

    async def scenario() -> None:
        alice = {"X-Forwarded-For": "198.51.100.1"}
        async with websockets.connect(srv.ws_url, additional_headers=alice) as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "start", "text": "long " * 100}))
            await next_json(ws, "start")
            # Another client behind the same proxy is not limited by alice's take...
            r = await asyncio.to_thread(_start_http, srv.url, "198.51.100.2")
            assert r.status_code == 200, r.text
            # ...alice herself is, whichever way she comes in.
            r = await asyncio.to_thread(_start_http, srv.url, "6.6.6.6, 198.51.100.1")
            assert r.status_code == 429 and error_of(r)["code"] == "rate_limited"
            await ws.send(json.dumps({"type": "cancel"}))
            await next_json(ws, "end")

    run(scenario())


def test_a_client_at_its_take_cap_can_still_cut_in_on_its_own_take(fast_server) -> None:
    """A director barging in replaces the take it is streaming: the new take is submitted while that one stops (early
    admission), and the cap of concurrent takes per client does not refuse it for that moment; a second socket of
    the same client still is refused."""
    srv = fast_server(max_takes_per_client=1, frame_ms=20.0)

    async def scenario() -> None:
        async with websockets.connect(srv.ws_url) as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "start", "text": "long " * 100, "take": "one"}))
            await next_json(ws, "start")
            for label in ("two", "three"):
                await ws.send(json.dumps({"type": "start", "text": "long " * 100, "take": label}))
                ended = await next_json(ws, "end")
                assert ended["reason"] == "replaced"
                started = await next_json(ws, "start")
                assert started["label"] == label
            async with websockets.connect(srv.ws_url) as other:
                await hello(other)
                await other.send(json.dumps({"type": "start", "text": "hello"}))
                refused = await next_json(other, "error")
                assert refused["code"] == "rate_limited"
            await ws.send(json.dumps({"type": "cancel"}))
            await next_json(ws, "end")

    run(scenario())


def test_forwarded_for_is_ignored_unless_the_proxy_is_trusted(fast_server) -> None:
    srv = fast_server(max_takes_per_client=1, frame_ms=20.0)  # no trusted proxies

    async def scenario() -> None:
        async with websockets.connect(srv.ws_url, additional_headers={"X-Forwarded-For": "198.51.100.1"}) as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "start", "text": "long " * 100}))
            await next_json(ws, "start")
            # A header cannot buy a second take: both requests come from 127.0.0.1.
            r = await asyncio.to_thread(_start_http, srv.url, "198.51.100.2")
            assert r.status_code == 429 and error_of(r)["code"] == "rate_limited"
            await ws.send(json.dumps({"type": "cancel"}))
            await next_json(ws, "end")

    run(scenario())


# --------------------------------------------------------------------------- request rate per client


def test_request_rate_bucket_per_client_is_bounded() -> None:
    now = [0.0]
    rate = ClientRequestRate(2.0, 3, max_clients=2, clock=lambda: now[0])
    assert [rate.admit("a") for _ in range(3)] == [None, None, None]
    assert rate.admit("a") == pytest.approx(0.5)  # one token comes back every 0.5 s
    assert rate.admit("b") is None  # another client has its own bucket
    now[0] = 0.5
    assert rate.admit("a") is None
    rate.admit("c")
    assert len(rate) == 2  # bounded: the least recently seen client ("b") was forgotten
    assert ClientRequestRate(0.0, 1).admit("a") is None  # 0 disables it


def test_costly_requests_are_rate_limited_per_client(fast_server) -> None:
    srv = fast_server(http_requests_per_sec=0.1, http_request_burst=3, trusted_proxies=("127.0.0.1",))

    def post(forwarded_for: str) -> requests.Response:
        headers = {"X-Forwarded-For": forwarded_for}
        return requests.post(f"{srv.url}/api/stream", json={"text": "hi", "tokens": 1}, headers=headers, timeout=30)

    assert [post("198.51.100.1").status_code for _ in range(3)] == [200, 200, 200]
    refused = post("198.51.100.1")
    assert refused.status_code == 429 and error_of(refused)["code"] == "rate_limited"
    assert 1 <= int(refused.headers["Retry-After"]) <= 10
    # A WebSocket upgrade is refused the same way, as JSON before the upgrade.
    ws = requests.get(
        f"{srv.url}/api/ws",
        headers={"X-Forwarded-For": "198.51.100.1", "Connection": "Upgrade", "Upgrade": "websocket",
                 "Sec-WebSocket-Version": "13", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="},
        timeout=30,
    )
    assert ws.status_code == 429 and error_of(ws)["code"] == "rate_limited"
    # Cheap reads stay open to the same client, and other clients are unaffected.
    assert requests.get(f"{srv.url}/api/models", headers={"X-Forwarded-For": "198.51.100.1"}, timeout=30).ok
    assert requests.get(f"{srv.url}/readyz", headers={"X-Forwarded-For": "198.51.100.1"}, timeout=30).ok
    assert post("198.51.100.2").status_code == 200
