"""Optional API key, browser tokens, WebSocket Origin allowlist and CORS (docs/security.md)."""

from __future__ import annotations

import json
import time

import pytest
import requests
import websockets

from moss_rt.web.security import issue_token, verify_token
from tests.helpers import error_of, hello, next_json, run

KEY = "s3cret-key"
PROTECTED_GETS = ["/api/models", "/api/info", "/api/voices", "/api/takes/t_x", "/api/takes/t_x.wav", "/metrics"]


def bearer(value: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {value}"}


def test_everything_open_without_a_key(fast_server) -> None:
    srv = fast_server()
    assert requests.get(f"{srv.url}/api/models").status_code == 200
    token = requests.post(f"{srv.url}/api/token").json()
    assert token == {"auth_required": False, "token": None, "expires_at": None, "expires_in": None}


def test_key_required_on_api_and_ws_but_not_on_probes_and_page(fast_server) -> None:
    srv = fast_server(api_key=KEY)
    for path in PROTECTED_GETS:
        r = requests.get(srv.url + path)
        assert r.status_code == 401, path
        assert error_of(r)["code"] == "unauthorized"
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
        assert requests.get(srv.url + path, headers=bearer("wrong")).status_code == 401
    for path, body in [("/api/stream", {"text": "x"}), ("/api/upload_ref", None), ("/api/token", None)]:
        assert requests.post(srv.url + path, json=body).status_code == 401, path
    for path in ["/healthz", "/readyz", "/", "/api/openapi.json"]:
        assert requests.get(srv.url + path).status_code == 200, path
    # The key works as a Bearer credential.
    assert requests.get(f"{srv.url}/api/models", headers=bearer(KEY)).status_code == 200
    r = requests.post(f"{srv.url}/api/stream", json={"text": "x", "tokens": 2}, headers=bearer(KEY))
    assert r.status_code == 200
    # The key is never accepted in a URL (URLs are logged).
    assert requests.get(f"{srv.url}/api/models", params={"token": KEY}).status_code == 401

    async def scenario() -> None:
        with pytest.raises(websockets.InvalidStatus) as info:
            async with websockets.connect(srv.ws_url):
                pass
        assert info.value.response.status_code == 401
        assert json.loads(info.value.response.body)["error"]["code"] == "unauthorized"
        async with websockets.connect(srv.ws_url, additional_headers=bearer(KEY)) as ws:
            await hello(ws)

    run(scenario())


def test_expect_continue_upload_refused_before_the_body_without_credentials(fast_server) -> None:
    from tests.reliability.conftest import raw_http, read_head

    srv = fast_server(api_key=KEY)
    head = "POST /api/upload_ref?ext=wav HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\nExpect: 100-continue\r\n"
    sock = raw_http(int(srv.url.rsplit(":", 1)[1]), head + "\r\n")
    status, _ = read_head(sock)
    sock.close()
    assert status == 401  # not "100 Continue": the body is never sent
    sock = raw_http(int(srv.url.rsplit(":", 1)[1]), head + f"Authorization: Bearer {KEY}\r\n\r\n")
    status, _ = read_head(sock)
    sock.close()
    assert status == 100


def test_browser_token_exchange_and_use(fast_server) -> None:
    srv = fast_server(api_key=KEY, token_ttl_sec=60.0)
    r = requests.post(f"{srv.url}/api/token", headers=bearer(KEY))
    assert r.status_code == 200 and r.headers["Cache-Control"] == "no-store"
    body = r.json()
    assert body["auth_required"] is True and body["expires_in"] == 60
    assert abs(body["expires_at"] - (time.time() + 60)) < 5
    token = body["token"]
    # As ?token= on the WebSocket URL (browsers cannot set headers there), or as a Bearer header.
    assert requests.get(f"{srv.url}/api/models", headers=bearer(token)).status_code == 200
    assert requests.get(f"{srv.url}/api/takes/t_missing.wav", params={"token": token}).status_code == 404
    # A query token is not accepted for POSTs (no URL-carried credentials for state changes).
    assert requests.post(f"{srv.url}/api/stream", params={"token": token}, json={"text": "x"}).status_code == 401
    # Only the key buys tokens: a leaked token cannot renew itself.
    r = requests.post(f"{srv.url}/api/token", headers=bearer(token))
    assert r.status_code == 401 and error_of(r)["code"] == "unauthorized"

    async def scenario() -> None:
        async with websockets.connect(f"{srv.ws_url}?token={token}") as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "start", "text": "hi", "tokens": 2}))
            assert (await next_json(ws, "end"))["reason"] == "done"

    run(scenario())


def test_expired_forged_and_foreign_tokens_refused(fast_server) -> None:
    srv = fast_server(api_key=KEY)
    expired, _ = issue_token(KEY, -1.0)
    other_key, _ = issue_token("another-key", 600.0)
    good, _ = issue_token(KEY, 600.0)
    parts = good.split(".")
    extended = ".".join([parts[0], str(int(parts[1]) + 10_000), parts[2], parts[3]])  # tampered expiry
    for bad in [expired, other_key, extended, "v1.1.2", "garbage", good + "x"]:
        assert not verify_token(KEY, bad)
        assert requests.get(f"{srv.url}/api/models", headers=bearer(bad)).status_code == 401, bad

        async def scenario(token: str = bad) -> None:
            with pytest.raises(websockets.InvalidStatus) as info:
                async with websockets.connect(f"{srv.ws_url}?token={token}"):
                    pass
            assert info.value.response.status_code == 401

        run(scenario())
    assert verify_token(KEY, good)


def test_ws_origin_same_origin_by_default(fast_server) -> None:
    srv = fast_server()
    host = srv.url.removeprefix("http://")

    async def scenario() -> None:
        async with websockets.connect(srv.ws_url, origin=f"http://{host}") as ws:  # the page's own origin
            await hello(ws)
        async with websockets.connect(srv.ws_url) as ws:  # no Origin: not a browser
            await hello(ws)
        for foreign in ["http://evil.example", f"http://{host}.evil.example", "null", "https://localhost:1"]:
            with pytest.raises(websockets.InvalidStatus) as info:
                async with websockets.connect(srv.ws_url, origin=foreign):
                    pass
            response = info.value.response
            assert response.status_code == 403, foreign
            assert json.loads(response.body)["error"]["code"] == "forbidden_origin"

    run(scenario())


def test_ws_origin_allowlist(fast_server) -> None:
    srv = fast_server(allowed_origins=("https://studio.example",))

    async def scenario() -> None:
        async with websockets.connect(srv.ws_url, origin="https://studio.example") as ws:
            await hello(ws)
        with pytest.raises(websockets.InvalidStatus) as info:
            async with websockets.connect(srv.ws_url, origin="https://other.example"):
                pass
        assert info.value.response.status_code == 403

    run(scenario())


def test_origin_checked_before_auth_has_any_effect_and_both_hold(fast_server) -> None:
    srv = fast_server(api_key=KEY)

    async def scenario() -> None:
        with pytest.raises(websockets.InvalidStatus) as info:
            async with websockets.connect(srv.ws_url, origin="http://evil.example", additional_headers=bearer(KEY)):
                pass
        assert info.value.response.status_code == 403

    run(scenario())


def test_cors_only_for_configured_origins(fast_server) -> None:
    srv = fast_server(cors_origins=("https://app.example",))
    r = requests.get(f"{srv.url}/api/models", headers={"Origin": "https://app.example"})
    assert r.headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert "Origin" in r.headers["Vary"]
    r = requests.get(f"{srv.url}/api/models", headers={"Origin": "https://evil.example"})
    assert "Access-Control-Allow-Origin" not in r.headers
    pre = requests.options(
        f"{srv.url}/api/stream",
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert pre.status_code == 204
    assert "POST" in pre.headers["Access-Control-Allow-Methods"]
    assert "Authorization" in pre.headers["Access-Control-Allow-Headers"]
    pre = requests.options(
        f"{srv.url}/api/stream", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    )
    assert pre.status_code == 403 and "Access-Control-Allow-Origin" not in pre.headers


def test_no_cors_headers_by_default(fast_server) -> None:
    srv = fast_server()
    r = requests.get(f"{srv.url}/api/models", headers={"Origin": "https://app.example"})
    assert "Access-Control-Allow-Origin" not in r.headers


def test_errors_are_json_everywhere(fast_server) -> None:
    srv = fast_server()
    r = requests.get(f"{srv.url}/api/nope")
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"
    r = requests.delete(f"{srv.url}/api/stream")
    assert r.status_code == 405 and error_of(r)["code"] == "bad_message" and "POST" in r.headers["Allow"]
    r = requests.get(f"{srv.url}/api/ws")  # not an upgrade
    assert r.status_code == 400 and error_of(r)["code"] == "bad_message"
