"""Cluster mode end to end: the real front end over two CPU replicas of the tiny model on a local Ray.

What a client and an operator see: both transports work through the front end, takes spread over
the replicas, a replica killed mid-take ends exactly its takes with ``replica_lost`` (the other
replica's takes finish) and comes back, a retake whose parent's replica died is rebuilt on the
other one with its kept frames bit-identical, and the front end keeps serving throughout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from typing import Any

import aiohttp
import numpy as np
import pytest

from moss_rt.client import DirectingClient, ServerError, TakeAudio, http_stream
from moss_rt.protocol import FRAME_SAMPLES
from tests.cluster.conftest import RAY_TEST_ENV, REPLICAS, cluster_settings
from tests.engine.helpers import LONG, metrics, take_codes
from tests.helpers import RunningServer, free_port, next_message, run

pytestmark = pytest.mark.cluster


async def get_json(srv: RunningServer, path: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.get(srv.url + path) as resp:
        return resp.status, await resp.json()


async def replicas(srv: RunningServer) -> dict[str, dict[str, Any]]:
    _, info = await get_json(srv, "/api/info")
    return {r["name"]: r for r in info["replicas"]}


async def wait_for(predicate: Any, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out after {within:.0f} s waiting for {what}")


async def all_ready(srv: RunningServer, within: float = 120.0) -> dict[str, dict[str, Any]]:
    async def ok() -> bool:
        reps = await replicas(srv)
        return len(reps) == REPLICAS and all(r["ready"] for r in reps.values())

    await wait_for(ok, within, "every replica to be ready")
    return await replicas(srv)


def replica_of(srv: RunningServer, take_id: str) -> str:
    name = srv.engine.replica_of(take_id)  # type: ignore[attr-defined]
    assert name is not None
    return name


async def wav_pcm(srv: RunningServer, take_id: str) -> bytes:
    async with aiohttp.ClientSession() as http, http.get(f"{srv.url}/api/takes/{take_id}.wav") as resp:
        assert resp.status == 200
        return (await resp.read())[44:]


def test_both_transports_spread_and_one_view(cluster_server) -> None:
    srv = cluster_server()

    async def scenario() -> None:
        reps = await all_ready(srv)
        assert {r["pid"] for r in reps.values()} and len({r["pid"] for r in reps.values()}) == REPLICAS
        status, ready = await get_json(srv, "/readyz")
        assert status == 200 and ready["replicas"] == REPLICAS and ready["replicas_ready"] == REPLICAS

        # Legacy HTTP stream, byte-compatible framing.
        legacy = await http_stream(srv.url, text="Through the front end.", max_new_tokens=12, seed=3, **LONG)
        assert legacy.end["reason"] == "max_frames" and legacy.end["n_frames"] == 12
        assert len(legacy.pcm) == 12 * FRAME_SAMPLES * 2

        # Four WebSocket takes at once: they overlap, so both replicas get some.
        async def one(i: int) -> TakeAudio:
            async with DirectingClient.connect(srv.ws_url) as client:
                return await client.speak(f"Line number {i}.", seed=i, max_new_tokens=16, chunk_frames=4, **LONG)

        takes = await asyncio.gather(*(one(i) for i in range(4)))
        for take in takes:
            assert take.end["reason"] == "max_frames" and len(take.pcm) == 16 * FRAME_SAMPLES * 2
        placed = {replica_of(srv, t.take_id) for t in takes}
        assert placed == set(reps), placed

        # One /metrics: each replica's engine series, labelled by replica.
        async def both_counted() -> bool:
            m = await metrics(srv)
            return all(
                m.get(f'moss_rt_takes_total{{reason="max_frames",replica="{name}"}}', 0) >= 1 for name in reps
            )

        await wait_for(both_counted, 10, "per-replica take counters in /metrics")
        m = await metrics(srv)
        assert m['moss_rt_cluster_routes_total{route="new"}'] >= 5
        assert all(m[f'moss_rt_replica_ready{{replica="{name}"}}'] == 1 for name in reps)

    run(scenario(), timeout=240)


def test_killed_replica_ends_its_takes_only_and_comes_back(cluster_server) -> None:
    srv = cluster_server()

    async def scenario() -> None:
        reps = await all_ready(srv)
        async with DirectingClient.connect(srv.ws_url) as a, DirectingClient.connect(srv.ws_url) as b:
            # Paced at real time: 50 frames last 4 s, so both are mid-take when the kill comes.
            await a.start("The doomed take.", seed=1, max_new_tokens=50, chunk_frames=2, **LONG)
            start_a = await next_message(a, "start")
            await b.start("The surviving take.", seed=2, max_new_tokens=50, chunk_frames=2, **LONG)
            start_b = await next_message(b, "start")
            victim, survivor = replica_of(srv, start_a["take"]), replica_of(srv, start_b["take"])
            assert victim != survivor

            os.kill(int(reps[victim]["pid"]), signal.SIGKILL)
            killed_at = time.monotonic()
            with pytest.raises(ServerError) as lost:
                await a.collect()
            noticed = time.monotonic() - killed_at
            assert lost.value.code == "replica_lost"
            assert noticed < 2.0, f"the lost replica was reported after {noticed:.2f} s"
            end_a = await next_message(a, "end")
            assert end_a["reason"] == "error" and end_a["take"] == start_a["take"]

            rest_b = await b.collect()
            assert rest_b.end["reason"] == "max_frames" and rest_b.end["n_frames"] == 50

            # The front end keeps serving while Ray restarts the victim: new takes go to the survivor.
            again = await a.speak("Still here.", seed=5, max_new_tokens=8, **LONG)
            assert again.end["n_frames"] == 8 and replica_of(srv, again.take_id) == survivor

        async def restarted() -> bool:
            r = (await replicas(srv))[victim]
            return bool(r["ready"]) and r["pid"] != reps[victim]["pid"] and r["restarts"] >= 1

        await wait_for(restarted, 120, f"{victim} to be restarted and ready")
        m = await metrics(srv)
        assert m[f'moss_rt_cluster_lost_takes_total{{replica="{victim}"}}'] == 1
        assert m.get(f'moss_rt_cluster_lost_takes_total{{replica="{survivor}"}}', 0) == 0

    run(scenario(), timeout=300)


def test_retake_is_sticky_then_rebuilt_elsewhere_with_identical_prefix(cluster_server) -> None:
    srv = cluster_server()
    n = 8

    async def scenario() -> None:
        reps = await all_ready(srv)
        async with DirectingClient.connect(srv.ws_url) as client:
            first = await client.speak("A line to direct.", seed=7, max_new_tokens=20, chunk_frames=4, **LONG)
            home = replica_of(srv, first.take_id)
            a_codes = take_codes(srv, first.take_id)

            # While the parent's replica is up, the retake goes there and reuses its cache.
            await client.seek(first.take_id, n, seed=99)
            ack = await next_message(client, "seek")
            assert ack["rebuilt"] is False
            sticky = await client.collect()
            assert replica_of(srv, sticky.take_id) == home

            # The parent's replica dies: the retake is rebuilt on the other one from stored codes.
            os.kill(int(reps[home]["pid"]), signal.SIGKILL)
            await client.seek(first.take_id, n, seed=99)
            ack = await next_message(client, "seek")
            assert ack["rebuilt"] is True and ack["from_take"] == first.take_id and ack["frame"] == n
            rebuilt = await client.collect()
            assert replica_of(srv, rebuilt.take_id) != home
            assert rebuilt.start["first_frame"] == n and rebuilt.end["n_frames"] == n + 20
            assert len(rebuilt.pcm) == 20 * FRAME_SAMPLES * 2
            b_codes = take_codes(srv, rebuilt.take_id)
            np.testing.assert_array_equal(b_codes[:n], a_codes[:n])
            prefix = n * FRAME_SAMPLES * 2
            assert (await wav_pcm(srv, rebuilt.take_id))[:prefix] == (await wav_pcm(srv, first.take_id))[:prefix]

    run(scenario(), timeout=300)


def test_a_second_front_end_process_serves_the_same_replicas(cluster_server, ray_cluster, tmp_path) -> None:
    """``python -m moss_rt serve --cluster ADDRESS`` finds the replicas the first front end made."""
    srv = cluster_server()
    port = free_port()
    s = cluster_settings(tmp_path)
    env = {**os.environ, **RAY_TEST_ENV, "PYTHONPATH": os.getcwd()}
    cmd = [
        sys.executable, "-m", "moss_rt", "serve", "--cluster", ray_cluster, "--replicas", str(REPLICAS),
        "--port", str(port), "--model", "tiny", "--codec", "tiny", "--device", "cpu",
        "--data-dir", str(s["data_dir"]), "--max-slots", "4", "--max-queue", "4", "--max-seq-len", "1024",
        "--max-lead-sec", "0.5", "--log-level", "WARNING",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:

        async def scenario() -> None:
            mine = await all_ready(srv)
            url = f"http://127.0.0.1:{port}"

            async def up() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(f"second front end exited: {proc.stderr.read().decode()[-2000:]}")
                try:
                    async with aiohttp.ClientSession() as http, http.get(url + "/readyz") as resp:
                        return resp.status == 200
                except aiohttp.ClientError:
                    return False

            await wait_for(up, 120, "the second front end to be ready")
            async with aiohttp.ClientSession() as http, http.get(url + "/api/info") as resp:
                theirs = {r["name"]: r["pid"] for r in (await resp.json())["replicas"]}
            assert theirs == {name: r["pid"] for name, r in mine.items()}
            take = await http_stream(url, text="From the other front end.", max_new_tokens=6, **LONG)
            assert take.end["n_frames"] == 6

            # That front end dies mid-take (no goodbye): the replica frees the take's slot on its own.
            async with DirectingClient.connect(url.replace("http", "ws") + "/api/ws") as orphan:
                # Paced at real time: 600 frames would last 48 s.
                await orphan.start("Nobody will hear the end of this.", max_new_tokens=600, chunk_frames=2, **LONG)
                await next_message(orphan, "start")

                async def active(n: int) -> bool:
                    return sum(r["active"] for r in (await replicas(srv)).values()) == n

                await wait_for(lambda: active(1), 10, "the take to show on a replica")  # one poll late
                proc.kill()
                proc.wait(10)

            await wait_for(lambda: active(0), 15, "the orphaned take's slot to be freed")

        run(scenario(), timeout=240)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
