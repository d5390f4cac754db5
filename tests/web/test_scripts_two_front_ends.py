"""Scripts on two front ends sharing one PostgreSQL store: one front end renders a script, the other shows its
state from the database; a retake through the other moves the script there; and a script whose front end stops
mid-render is finished by the other, without rendering a finished line again."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from moss_rt.scripts import service
from tests.helpers import OwnerJar, RunningServer, ServerThread, free_port
from tests.web.conftest import scripted
from tests.web.test_scripts import SCRIPT, post, wait_done


def _start(tmp: Path, name: str, url: str, **overrides: Any) -> ServerThread:
    from moss_rt.config import Settings

    settings = Settings(
        host="127.0.0.1", port=free_port(), data_dir=tmp / name, voices_dir=tmp / "voices", engine="scripted",
        frame_ms=2.0, max_lead_sec=0.0, session_store=url, session_files=str(tmp / "shared"),
    ).replace(**overrides)  # fmt: skip
    thread = ServerThread(settings, scripted(settings))
    thread.start()
    return thread


def _state(jar: OwnerJar, server: RunningServer, script_id: str) -> dict[str, Any]:
    r = jar.request("GET", f"{server.url}/api/scripts/{script_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_script_moves_between_front_ends(tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "RENEW_SEC", 0.2)  # leases looked at often (every 15 s in service)
    threads = [_start(tmp_path, "fe-a", postgres_url), _start(tmp_path, "fe-b", postgres_url, frame_ms=1.0)]
    try:
        a, b = (t.server for t in threads)
        assert a is not None and b is not None
        jar = OwnerJar()
        r = post(jar, a.url, SCRIPT)
        assert r.status_code == 201, r.text
        script_id = r.json()["script"]
        done = wait_done(jar, b.url, script_id)  # b reads what a renders, from the database
        # a may still be finishing its last line's words after recording the line: wait for it to be done too.
        assert done["lines_done"] == 6 and wait_done(jar, a.url, script_id)["lines"] == done["lines"]

        # A retake through b: b renders it (the script is b's now), a shows it.
        r = jar.request("POST", f"{b.url}/api/scripts/{script_id}/lines/2/retake", json={"seed": 777})
        assert r.status_code == 202, r.text
        after = wait_done(jar, b.url, script_id)
        deadline = time.monotonic() + 10
        while after["lines"][1]["seed"] != 777:
            assert time.monotonic() < deadline, after
            after = wait_done(jar, b.url, script_id)
        assert _state(jar, a, script_id)["lines"][1]["take"] == after["lines"][1]["take"] != done["lines"][1]["take"]
        assert [x["take"] for x in after["lines"] if x["line"] != 2] == [
            x["take"] for x in done["lines"] if x["line"] != 2
        ]  # no other line rendered again

        # A front end stops mid-render: the other finishes the script.
        slow = _start(tmp_path, "fe-c", postgres_url, frame_ms=30.0)
        threads.append(slow)
        c = slow.server
        assert c is not None
        r = post(jar, c.url, SCRIPT)
        second = r.json()["script"]
        deadline = time.monotonic() + 30
        while (state := _state(jar, b, second))["lines_done"] < 1:
            assert time.monotonic() < deadline, state
            time.sleep(0.02)
        slow.stop()
        threads.remove(slow)
        finished = {x["line"]: x["take"] for x in _state(jar, b, second)["lines"] if x["status"] == "done"}
        assert 1 <= len(finished) < 6, finished  # stopped halfway
        final = wait_done(jar, a.url, second, within=60)
        assert final["lines_done"] == 6 and final["lines_failed"] == 0, final
        for line, take in finished.items():
            assert final["lines"][line - 1]["take"] == take  # finished lines are not rendered again
    finally:
        for thread in threads:
            thread.stop()
