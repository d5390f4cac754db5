"""Cluster mode end to end: the real front end over two CPU replicas of the tiny model on a local Ray.

What a client and an operator see: both transports work through the front end, takes spread over
the replicas, a replica killed mid-take ends exactly its takes with ``replica_lost`` (the other
replica's takes finish) and comes back, a retake whose parent's replica died is rebuilt on the
other one with its kept frames bit-identical, and the front end keeps serving throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
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

        # Four WebSocket takes that overlap: each is started (admitted, its start heard) before the next is sent,
        # and each lasts as long as its audio (paced, 3.2 s), so every placement sees the others still running
        # and both replicas get some. Lines with nothing in common beyond the opening every prompt has: no
        # replica is preferred for its cache. (Started all at once, short takes could each finish before the next
        # was routed on a loaded machine, and then go anywhere: a flaky failure under make test.)
        frames = 40
        texts = ["Alpha speaks first.", "Bravo answers.", "Charlie laughs.", "Delta sighs."]
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(DirectingClient.connect(srv.ws_url)) for _ in texts]
            for i, (client, text) in enumerate(zip(clients, texts, strict=True)):
                await client.start(text, seed=i, max_new_tokens=frames, chunk_frames=4, **LONG)
                await next_message(client, "start")
            takes = await asyncio.gather(*(client.collect() for client in clients))
        for take in takes:
            assert take.end["reason"] == "max_frames" and len(take.pcm) == frames * FRAME_SAMPLES * 2
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


def test_a_replica_lost_mid_round_ends_exactly_its_takes_and_their_retakes_are_rebuilt(cluster_server) -> None:
    """A round of four takes over both replicas; one replica is killed while they stream: each of its takes ends
    with ``replica_lost`` within 2 s, the other replica's takes run to their end, complete; the next retake of a
    lost take is rebuilt on the survivor with the frames it kept bit-identical; Ray restarts the victim."""
    srv = cluster_server()
    kept = 6  # frames of the lost take the retake keeps (the client has heard them before the kill)
    frames = 60  # paced at real time: 4.8 s, so every take is mid-stream when the kill comes
    texts = ["Alpha opens the round.", "Bravo follows it.", "Charlie is third.", "Delta closes it."]

    async def scenario() -> None:
        reps = await all_ready(srv)
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(DirectingClient.connect(srv.ws_url)) for _ in texts]
            starts = []
            for i, (client, text) in enumerate(zip(clients, texts, strict=True)):
                await client.start(text, seed=i, max_new_tokens=frames, chunk_frames=2, **LONG)
                starts.append(await next_message(client, "start"))
            placed = [replica_of(srv, start["take"]) for start in starts]
            assert set(placed) == set(reps), placed  # the round spans both replicas
            victim = placed[0]
            survivor = next(name for name in reps if name != victim)
            lost = [i for i, name in enumerate(placed) if name == victim]
            # The first lost take has streamed `kept` frames to its client.
            heard = b""
            while len(heard) < kept * FRAME_SAMPLES * 2:
                item = await clients[0].receive()
                if isinstance(item, bytes):
                    heard += item

            os.kill(int(reps[victim]["pid"]), signal.SIGKILL)
            killed_at = time.monotonic()

            async def outcome(i: int) -> tuple[str, float, TakeAudio | None]:
                try:
                    take = await clients[i].collect()
                except ServerError as exc:
                    return str(exc.code), time.monotonic() - killed_at, None
                return "end", time.monotonic() - killed_at, take

            outcomes = {i: asyncio.create_task(outcome(i)) for i in range(len(texts))}
            for i in lost:
                what, after, _ = await outcomes[i]
                assert what == "replica_lost", (i, what)
                assert after < 2.0, f"take {i}'s lost replica was reported after {after:.2f} s"
                end = await next_message(clients[i], "end")
                assert end["reason"] == "error" and end["take"] == starts[i]["take"]

            # Right away (Ray is still restarting the victim), the next retake of the lost take: rebuilt on the
            # survivor from the frames the front end kept, those frames bit-identical.
            lost_take = starts[0]["take"]
            await clients[0].seek(lost_take, kept, seed=99)
            ack = await next_message(clients[0], "seek")
            assert ack["rebuilt"] is True and ack["from_take"] == lost_take and ack["frame"] == kept
            retake = await clients[0].collect()
            assert replica_of(srv, retake.take_id) == survivor
            assert retake.start["first_frame"] == kept and retake.end["n_frames"] == kept + frames
            np.testing.assert_array_equal(take_codes(srv, retake.take_id)[:kept], take_codes(srv, lost_take)[:kept])
            prefix = kept * FRAME_SAMPLES * 2
            assert (await wav_pcm(srv, retake.take_id))[:prefix] == heard[:prefix]

            for i in set(outcomes) - set(lost):  # the survivor's takes ran to their end, every frame there
                what, _, take = await outcomes[i]
                assert what == "end" and take is not None, (i, what)
                assert take.end["reason"] == "max_frames" and take.end["n_frames"] == frames
                assert len(take.pcm) == frames * FRAME_SAMPLES * 2

        async def restarted() -> bool:
            r = (await replicas(srv))[victim]
            return bool(r["ready"]) and r["pid"] != reps[victim]["pid"] and r["restarts"] >= 1

        await wait_for(restarted, 120, f"{victim} to be restarted and ready")
        m = await metrics(srv)
        assert m[f'moss_rt_cluster_lost_takes_total{{replica="{victim}"}}'] == len(lost)
        assert m.get(f'moss_rt_cluster_lost_takes_total{{replica="{survivor}"}}', 0) == 0

    run(scenario(), timeout=300)


def test_lines_of_one_direction_go_where_their_prompt_is_kept(cluster_server) -> None:
    """Takes one after another (the replicas equally idle each time), all of one direction: each goes to the
    replica that keeps the direction's prompt blocks, and that replica serves them from its cache. By load alone
    they would take turns."""
    srv = cluster_server()
    direction = "Tired, slow, a little hoarse; pauses between the sentences."
    lines = ["It was late, and the house was quiet.", "Nobody answered the door.", "She knocked again.",
             "A light came on upstairs."]

    async def scenario() -> None:
        await all_ready(srv)

        async def routing_on() -> bool:
            return (await get_json(srv, "/api/info"))[1]["details"].get("cache_routing") == "on"

        await wait_for(routing_on, 30, "the prompt recipe to reach the front end")
        before = await metrics(srv)
        homes = []
        async with DirectingClient.connect(srv.ws_url) as client:
            for i, text in enumerate(lines):
                take = await client.speak(text, instruction=direction, seed=i, max_new_tokens=4, **LONG)
                assert take.end["n_frames"] == 4
                homes.append(replica_of(srv, take.take_id))
        assert len(set(homes)) == 1, homes
        home = homes[0]

        def grew(m: dict[str, float], name: str) -> float:
            return m.get(name, 0.0) - before.get(name, 0.0)

        async def reported() -> bool:  # replica series arrive with the next poll
            m = await metrics(srv)
            return grew(m, f'moss_rt_prompt_rows_total{{replica="{home}",source="cache"}}') > 0

        await wait_for(reported, 10, f"{home}'s cache use in /metrics")
        m = await metrics(srv)
        assert grew(m, f'moss_rt_cluster_prompt_routes_total{{match="hit",replica="{home}"}}') == len(lines) - 1
        assert grew(m, f'moss_rt_cluster_prompt_rows_routed_total{{replica="{home}"}}') > 0
        assert m[f'moss_rt_replica_prompt_blocks{{replica="{home}"}}'] > 0

    run(scenario(), timeout=240)


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


def start_front_end(address: str, port: int, data_dir: Path) -> subprocess.Popen[bytes]:
    """``python -m moss_rt serve --cluster ADDRESS --reuse-port``: a front end of the module's replicas."""
    s = cluster_settings(data_dir)
    env = {**os.environ, **RAY_TEST_ENV, "PYTHONPATH": os.getcwd()}
    cmd = [
        sys.executable, "-m", "moss_rt", "serve", "--cluster", address, "--replicas", str(REPLICAS),
        "--port", str(port), "--reuse-port", "--model", "tiny", "--codec", "tiny", "--device", "cpu",
        "--data-dir", str(s["data_dir"]), "--max-slots", "4", "--max-queue", "4", "--max-seq-len", "1024",
        "--max-lead-sec", "0.5", "--log-level", "WARNING",
    ]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_front_ends_sharing_one_port_serve_the_same_replicas(cluster_server, ray_cluster, tmp_path) -> None:
    """Two ``serve --cluster ADDRESS --reuse-port`` processes on one port find the replicas the first front end
    made; the kernel spreads connections over both. One dies mid-take: the take's slot is freed on its replica,
    and the port keeps serving through the other."""
    srv = cluster_server()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []

    def alive() -> None:
        for proc in procs:
            if proc.poll() is not None and proc.returncode not in (-signal.SIGKILL,):
                assert proc.stderr is not None
                raise AssertionError(f"a front end exited: {proc.stderr.read().decode()[-2000:]}")

    async def info_by_new_connection() -> dict[str, Any] | None:
        alive()
        try:
            connector = aiohttp.TCPConnector(force_close=True)  # a new connection: the kernel picks a front end
            async with aiohttp.ClientSession(connector=connector) as http, http.get(url + "/api/info") as resp:
                return await resp.json() if resp.status == 200 else None
        except aiohttp.ClientError:
            return None

    async def front_ends_seen(want: int, ready: bool, tries: int = 400) -> dict[str, dict[str, Any]]:
        seen: dict[str, dict[str, Any]] = {}
        for _ in range(tries):
            info = await info_by_new_connection()
            # Ready, and every replica heard from: a front end is ready as soon as one replica is, and lists one it
            # has not polled yet without its pid.
            if info is not None and (not ready or (info["ready"] and all(r["pid"] for r in info["replicas"]))):
                seen[info["details"]["front_end"]] = info
                if len(seen) >= want:
                    return seen
            await asyncio.sleep(0.05)
        raise AssertionError(f"saw {len(seen)} front end(s) on the shared port, wanted {want}")

    try:

        async def scenario() -> None:
            mine = {name: r["pid"] for name, r in (await all_ready(srv)).items()}
            procs.append(start_front_end(ray_cluster, port, tmp_path / "fe-a"))
            first = await front_ends_seen(1, ready=True, tries=2400)
            async with DirectingClient.connect(url.replace("http", "ws") + "/api/ws") as orphan:
                # Only the first front end listens yet: this connection is its. Paced at real time: 600 frames
                # would last 48 s.
                await orphan.start("Nobody will hear the end of this.", max_new_tokens=600, chunk_frames=2, **LONG)
                await next_message(orphan, "start")

                async def active(n: int) -> bool:
                    return sum(r["active"] for r in (await replicas(srv)).values()) == n

                await wait_for(lambda: active(1), 10, "the take to show on a replica")  # one poll late
                procs.append(start_front_end(ray_cluster, port, tmp_path / "fe-b"))
                both = await front_ends_seen(2, ready=True, tries=2400)
                for info in both.values():
                    assert {r["name"]: r["pid"] for r in info["replicas"]} == mine
                take = await http_stream(url, text="Through the shared port.", max_new_tokens=6, **LONG)
                assert take.end["n_frames"] == 6

                # The first front end dies mid-take (no goodbye): the replica frees the take's slot on its own.
                procs[0].kill()
                procs[0].wait(10)
            await wait_for(lambda: active(0), 15, "the orphaned take's slot to be freed")
            survivor = set(both) - set(first)
            for _ in range(10):  # the port is the survivor's alone now
                info = await info_by_new_connection()
                assert info is not None and {info["details"]["front_end"]} == survivor
            take = await http_stream(url, text="Still served.", max_new_tokens=6, **LONG)
            assert take.end["n_frames"] == 6

        run(scenario(), timeout=300)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
