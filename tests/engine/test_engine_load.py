"""CPU load test: 64 concurrent WebSocket takes on the tiny model all complete without error."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from moss_rt.client import DirectingClient
from moss_rt.protocol import FRAME_RATE
from tests.engine.helpers import metrics
from tests.helpers import run

log = logging.getLogger(__name__)
CLIENTS = 64
FRAMES = 12


@pytest.mark.slow  # started first in parallel runs (tests/conftest.py)
def test_64_concurrent_websocket_takes(moss_server, record_property) -> None:
    # All clients share 127.0.0.1, so the per-address take cap is lifted (0 = no cap).
    srv = moss_server(max_slots=64, max_queue=64, max_seq_len=512, max_takes_per_client=0)

    async def one(i: int) -> tuple[dict[str, object], float]:
        async with DirectingClient.connect(srv.ws_url) as client:
            t0 = time.monotonic()
            take = await client.speak(f"Load test line number {i}.", seed=i, max_new_tokens=FRAMES, chunk_frames=4)
            assert len(take.pcm) == int(take.end["n_frames"]) * 3840 * 2
            return take.end, time.monotonic() - t0

    async def scenario() -> None:
        t0 = time.monotonic()
        results = await asyncio.gather(*(one(i) for i in range(CLIENTS)))
        wall = time.monotonic() - t0
        ends = [end for end, _ in results]
        assert all(end["reason"] in ("done", "max_frames") for end in ends), ends
        frames = sum(int(end["n_frames"]) for end in ends)
        audio_sec = frames / FRAME_RATE
        ttfa = sorted(float(end["ttfa_ms"]) for end in ends if end.get("ttfa_ms") is not None)
        m = await metrics(srv)
        assert m["moss_rt_frames_total"] >= frames
        assert m.get('moss_rt_takes_total{reason="error"}', 0.0) == 0
        steps = m["moss_rt_step_seconds_count"]
        summary = (
            f"{CLIENTS} takes, {frames} frames ({audio_sec:.1f} s audio) in {wall:.1f} s: "
            f"{frames / wall:.0f} frames/s, aggregate RTF {audio_sec / wall:.2f}, "
            f"mean batch {m['moss_rt_step_batch_size_sum'] / max(1, steps):.1f}, "
            f"TTFA p50 {ttfa[len(ttfa) // 2]:.0f} ms"
        )
        log.warning("CPU load test: %s", summary)
        record_property("throughput", summary)

    run(scenario(), timeout=300)
