"""Fairness of script renders, with a recording engine behind a real server: every line is submitted at batch
priority, a render fills its client's share of the slots and no more, two clients' renders run side by side, the
queue limit refuses a client's extra script, and an interactive take is admitted at once in the middle of it all."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import requests
import websockets

from moss_rt.config import Settings
from moss_rt.engine.base import TakePriority, TakeSpec
from moss_rt.engine.scripted import ScriptedEngine
from tests.helpers import OwnerJar, ServerThread, error_of, free_port

SLOTS = 8  # script renders may fill 4 (0.5) in all, one client 3 (0.375)


class RecordingEngine(ScriptedEngine):
    """The scripted engine, noting every take from its submit to its end: its priority and whose it is (the first
    word of its text), and what was in the engine at each submit."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._lock = threading.Lock()
        self.running: dict[str, TakeSpec] = {}
        self.submits: list[tuple[TakeSpec, Counter[str]]] = []

    async def submit(self, spec: TakeSpec) -> Any:
        channel = await super().submit(spec)
        with self._lock:
            self.running[spec.take_id] = spec
            batch = Counter(s.text.split()[0] for s in self.running.values() if s.priority is TakePriority.BATCH)
            self.submits.append((spec, batch))
        return channel

    def _finish(self, item: Any, reason: Any) -> None:
        with self._lock:
            self.running.pop(item.spec.take_id, None)
        super()._finish(item, reason)


def script(owner: str, lines: int) -> str:
    return "".join(f"{owner.upper()}: {owner} line {n} of the scene\n" for n in range(lines))


def post(url: str, text: str, client: str, jar: OwnerJar) -> requests.Response:
    return jar.request("POST", f"{url}/api/scripts", data=text.encode(),
                       headers={"Content-Type": "text/plain", "X-Forwarded-For": client})  # fmt: skip


async def interactive_take(ws_url: str) -> dict[str, Any]:
    async with websockets.connect(ws_url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "start", "text": "director speaking now", "tokens": 10}))
        while True:
            data = await ws.recv()
            if data[0] == 0 and json.loads(data[5:])["type"] in ("end", "error"):
                return json.loads(data[5:])


def test_renders_share_the_engine_fairly_and_interactive_takes_get_in(tmp_path: Path) -> None:
    settings = Settings(
        host="127.0.0.1", port=free_port(), data_dir=tmp_path / "data", voices_dir=tmp_path / "voices",
        engine="scripted", frame_ms=8.0, max_lead_sec=0.0, max_slots=SLOTS, max_queue=2,
        max_scripts_per_client=2, trusted_proxies=("127.0.0.1",),
    )  # fmt: skip
    engine = RecordingEngine(frame_ms=8.0, max_slots=SLOTS, max_queue=2, max_lead_sec=0.0)
    thread = ServerThread(settings, engine)
    server = thread.start()
    alpha, beta = OwnerJar(), OwnerJar()  # two directors, each with its own identity (owner cookie)
    try:
        first = post(server.url, script("alpha", 16), "10.0.0.1", alpha)
        second = post(server.url, script("alpha", 4), "10.0.0.1", alpha)
        assert first.status_code == 201 and second.status_code == 201
        refused = post(server.url, script("alpha", 2), "10.0.0.1", alpha)  # its queue limit: two scripts at once
        assert refused.status_code == 429 and error_of(refused)["code"] == "rate_limited"
        assert refused.headers["Retry-After"] and "2 scripts" in error_of(refused)["message"]
        other = post(server.url, script("beta", 8), "10.0.0.2", beta)
        assert other.status_code == 201
        ids = [(r.json()["script"], jar) for r, jar in ((first, alpha), (second, alpha), (other, beta))]
        deadline = time.monotonic() + 30
        while "beta" not in {s.text.split()[0] for s in list(engine.running.values())}:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        end = asyncio.run(asyncio.wait_for(interactive_take(server.ws_url), 30))
        assert end["type"] == "end" and end["reason"] in ("done", "max_frames")
        states = [jar.request("GET", f"{server.url}/api/scripts/{i}").json()["state"] for i, jar in ids]
        assert states.count("done") < 3  # the director was not kept waiting behind the renders
        deadline = time.monotonic() + 60
        while any(jar.request("GET", f"{server.url}/api/scripts/{i}").json()["state"] != "done" for i, jar in ids):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        thread.stop()

    scripted_lines = [(spec, seen) for spec, seen in engine.submits if spec.text.split()[0] in ("alpha", "beta")]
    assert len(scripted_lines) == 16 + 4 + 8
    assert all(spec.priority is TakePriority.BATCH for spec, _ in scripted_lines)
    interactive = [(spec, seen) for spec, seen in engine.submits if spec.text.startswith("director")]
    assert len(interactive) == 1 and interactive[0][0].priority is TakePriority.INTERACTIVE
    peaks = {who: max(seen[who] for _, seen in engine.submits) for who in ("alpha", "beta")}
    total_peak = max(seen["alpha"] + seen["beta"] for _, seen in engine.submits)
    assert peaks["alpha"] == 3  # alone, a render fills its client's share of the slots, and no more
    assert peaks["beta"] == 2  # side by side, the renders' places are split evenly (2 and 2 of 4)
    assert total_peak == 4  # all renders together leave half of the slots to interactive takes
    # The second client did not wait for the first one's 20 lines: they rendered side by side.
    first_beta = next(i for i, (spec, _) in enumerate(engine.submits) if spec.text.startswith("beta"))
    alphas_after = sum(1 for spec, _ in engine.submits[first_beta:] if spec.text.startswith("alpha"))
    assert alphas_after >= 4, alphas_after
