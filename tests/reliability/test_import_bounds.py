"""Session imports are checked and bounded before anything is kept (issue 23, findings 2, 4 and 9).

Each hostile archive of the corpus (tests/reliability/archives.py: broken zips, decoders that could allocate
gigabytes, JSON too large, too deep, with too many values or non-finite numbers, records of the wrong types,
codes out of the codebook or over the frame cap, audio that lies about its length) is refused with a clear 4xx
and leaves nothing on disk; the server keeps serving. A small zip cannot unpack past its budget, imports are
a few at a time (one per client), and an import's answer is strict JSON.
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest
import requests

from moss_rt.protocol import Limits
from tests.helpers import OwnerJar, error_of
from tests.reliability.archives import (
    archive,
    codes_of,
    hostile_archives,
    npy_of,
    one_take,
    take_record,
    valid_archive,
    wav_of,
)

OTHER = {"X-Forwarded-For": "10.0.0.7"}  # another client, through the trusted proxy 127.0.0.1


def session_dirs(data_dir: Path) -> list[str]:
    """Everything an import could have left in the sessions folder: session folders and staging leftovers."""
    root = data_dir / "sessions"
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def import_(url: str, data: bytes, jar: OwnerJar | None = None, **headers: str) -> requests.Response:
    jar = jar or OwnerJar()
    return jar.request("POST", f"{url}/api/sessions/import", data=data, headers=headers, timeout=60)


def test_every_hostile_archive_is_a_clear_4xx_and_leaves_nothing(fast_server) -> None:
    srv = fast_server()
    data_dir = srv.state.settings.data_dir
    for name, data in hostile_archives().items():
        r = import_(srv.url, data)
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:300])
        err = error_of(r)
        assert err["code"] in ("invalid_field", "too_large"), (name, err)
        assert "Traceback" not in r.text and "object at 0x" not in r.text, (name, r.text)
        assert session_dirs(data_dir) == [], (name, session_dirs(data_dir))
    assert srv.state.sessions is not None and srv.state.sessions.usage()["sessions"] == 0
    # Still serving, and a valid archive still imports.
    assert requests.get(f"{srv.url}/healthz", timeout=5).status_code == 200
    ok = import_(srv.url, valid_archive())
    assert ok.status_code == 200 and len(ok.json()["takes"]) == 2


def test_takes_over_the_frame_cap_and_codes_out_of_the_codebook_are_refused(fast_server) -> None:
    srv = fast_server()
    cap = max(Limits().max_new_tokens, 5120)  # a stored take's frames: new frames plus a retake's kept ones
    # The header says 40,000 frames: refused from it, before a byte of the (tiny, lying) audio is read.
    r = import_(srv.url, one_take(npy=npy_of(codes_of(40_000, value=1)), wav=wav_of(1)))
    assert r.status_code == 413 and error_of(r)["code"] == "too_large", r.text
    assert "40000 frames" in error_of(r)["message"] and str(cap) in error_of(r)["message"]
    # One frame over the cap.
    r = import_(srv.url, one_take(npy=npy_of(codes_of(cap + 1, value=1)), wav=wav_of(1)))
    assert r.status_code == 413, r.text
    # Codes of 999999 (the red team's replay that never ended and the download that answered 500).
    r = import_(srv.url, one_take(npy=npy_of(codes_of(3, value=999_999)), frames=3))
    assert r.status_code == 422 and error_of(r)["code"] == "invalid_field"
    assert "[0, 1023]" in error_of(r)["message"] and "999999" in error_of(r)["message"]
    assert session_dirs(srv.state.settings.data_dir) == []


def test_a_small_zip_cannot_unpack_past_its_budget(fast_server) -> None:
    # 3 silent stereo takes of 300 frames: 6.9 MB each unpacked, a few KB zipped.
    srv = fast_server(limits=Limits(max_session_archive_unpacked_bytes=10 * 1024 * 1024))
    bomb = valid_archive(3, 300, channels=2, silent=True)
    assert len(bomb) < 200_000
    r = import_(srv.url, bomb)
    assert r.status_code == 413 and error_of(r)["code"] == "too_large", r.text
    assert "max_session_archive_unpacked_bytes" in error_of(r)["message"]
    assert session_dirs(srv.state.settings.data_dir) == []  # what was unpacked before the budget ran out is gone


def test_the_data_dir_budget_answers_507(fast_server) -> None:
    srv = fast_server(session_storage_per_client_mb=1)
    r = import_(srv.url, valid_archive(2, 100))  # 2 x 100 frames of mono: 1.5 MB unpacked
    assert r.status_code == 507 and error_of(r)["code"] == "insufficient_storage", r.text
    assert session_dirs(srv.state.settings.data_dir) == []
    assert import_(srv.url, valid_archive(1, 4)).status_code == 200  # a small one fits


def test_an_import_answer_is_strict_json(fast_server) -> None:
    srv = fast_server()
    # 1e999 parses as infinity in Python; the answer once carried it back as the non-JSON token Infinity.
    record = take_record("t_inf", stats={"rtf": 1.5})
    text = json.dumps({"moss_rt_session": 1, "takes": [record]}).replace("1.5", "1e999")
    r = import_(srv.url, archive([(record, wav_of(2), npy_of(codes_of(2)))], manifest=text))
    assert r.status_code == 422 and "Infinity" not in r.text, r.text
    record = take_record("t_ok", stats={"rtf": 0.25, "ttfa_ms": 12})
    r = import_(srv.url, archive([(record, wav_of(2), npy_of(codes_of(2)))]))
    assert r.status_code == 200, r.text
    body = json.loads(r.text, parse_constant=lambda c: pytest.fail(f"{c} in the answer"))
    assert body["takes"][0]["stats"] == {"rtf": 0.25, "ttfa_ms": 12}


def test_imports_are_a_few_at_a_time_and_never_stall_others(fast_server) -> None:
    srv = fast_server(max_concurrent_archives=1, trusted_proxies=("127.0.0.1",))
    data = valid_archive(1, 4)
    # One import whose body is still arriving holds the only slot.
    sock = socket.create_connection(("127.0.0.1", int(srv.url.rsplit(":", 1)[1])))
    head = (
        f"POST /api/sessions/import HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n"
        "Content-Type: application/zip\r\n\r\n"
    )
    sock.sendall(head.encode() + data[:100])
    try:
        holder = srv.state.archive_slots

        def held() -> bool:
            return len(holder) == 1

        deadline = threading.Event()
        for _ in range(200):
            if held():
                break
            deadline.wait(0.02)
        assert held()
        same = import_(srv.url, data)  # the same client: one at a time
        assert same.status_code == 429 and error_of(same)["code"] == "rate_limited"
        other = import_(srv.url, data, **OTHER)  # another client: all slots taken
        assert other.status_code == 503 and error_of(other)["code"] == "busy" and other.headers["Retry-After"]
        # Everything else is served meanwhile.
        assert requests.get(f"{srv.url}/api/info", timeout=5).status_code == 200
        assert requests.post(f"{srv.url}/api/stream", json={"text": "hi", "tokens": 2}, timeout=10).status_code == 200
        sock.sendall(data[100:])
        answer = sock.recv(65536).decode(errors="replace")
        assert answer.startswith("HTTP/1.1 200"), answer[:200]
    finally:
        sock.close()
    for _ in range(200):
        if len(srv.state.archive_slots) == 0:
            break
        threading.Event().wait(0.02)
    assert import_(srv.url, data, **OTHER).status_code == 200
