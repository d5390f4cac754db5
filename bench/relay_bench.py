"""Relay bench (issue 29): what a cluster front end spends, in CPU, to relay streams of audio from replicas.

A cluster front end (``serve --cluster``) relays every take's audio from its replica to the client: a Ray
streaming-generator item per chunk in, a WebSocket frame per chunk out. This bench measures that cost per
stream, with replicas fast enough that the front end is the only thing working hard:

    python bench/relay_bench.py                       # scripted replicas (no model), CPU only: runs anywhere
    python bench/relay_bench.py --engine tiny         # the tiny model on CPU replicas (slower, same relay path)
    python bench/relay_bench.py --front-ends 1,2 --streams 64,256 --frame-ms 1 --out relay.json

It starts a local Ray in this process (loopback, a temporary directory, torn down at exit), then for each
front-end count N starts N ``python -m moss_rt serve --cluster ADDRESS`` processes (the first creates the
replicas; they stay up for the next N), each on its own port (``--reuse-port``: all on one port, the kernel
spreading connections), and drives S WebSocket takes at once, spread over the front ends, reading as fast as
they can (``--max-lead-sec 0``: no pacing). The replicas are the scripted engine at ``--frame-ms`` per frame
(2 ms: 40x real time per stream) unless ``--engine tiny``.

Printed (and written with ``--out``), per N and S: the audio relayed (seconds of 48 kHz PCM and MB/s), the
front ends' CPU time over the round (user + system, from /proc), and from those the relay cost:
``fe_cpu_ms_per_audio_sec`` (CPU milliseconds a front end spends per second of audio it relays; a real-time
stream costs that many ms of CPU every second), ``streams_per_core`` (real-time streams one core relays),
``fe_cpu_us_per_chunk``, and ``cores_at_800x`` (front-end cores that 800x real time, two H200s at full speed
on issue 29's estimate, needs at this cost). ``fe_busy_max`` is the busiest front end's share of one core:
near 1.0 it was the bottleneck of the round. On a small machine the bench's own clients and the replicas
share the cores with the front ends: the per-second costs are the figures to read, not the aggregate speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from local_ray import RAY_ENV, LocalRay, cpu_seconds, thread_cpu_seconds  # noqa: E402

log = logging.getLogger("relay_bench")
FRAME_SAMPLES = 3840  # 80 ms at 48 kHz
BYTES_PER_AUDIO_SEC = 48000 * 2  # mono int16
TEXT = "It was late, and the house was quiet. The rain had stopped an hour ago. " * 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- processes


def start_front_end(args: argparse.Namespace, address: str, port: int, index: int, work: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(
        RAY_ENV,
        MOSS_RT_MAX_TAKES_PER_CLIENT="0",  # every bench client shares 127.0.0.1
        MOSS_RT_HTTP_REQUESTS_PER_SEC="0",
        MOSS_RT_MAX_CONNECTIONS_PER_CLIENT="0",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    slots = max(args.streams) // args.replicas + 1
    profile = ["-m", "cProfile", "-o", str(work / "fe0.prof")] if args.profile and index == 0 else []
    cmd = [
        sys.executable, *profile, "-m", "moss_rt", "serve", "--cluster", address, "--replicas", str(args.replicas),
        "--replica-cpus", str(args.replica_cpus), "--port", str(port), "--data-dir", str(work / f"fe{index}"),
        "--max-slots", str(slots), "--max-queue", str(max(args.streams)), "--max-lead-sec", "0",
        "--log-level", "WARNING",
    ]  # fmt: skip
    if args.reuse_port:
        cmd.append("--reuse-port")
    if args.engine == "scripted":
        cmd += ["--engine", "scripted", "--frame-ms", str(args.frame_ms)]
    elif args.engine == "tiny":
        cmd += ["--engine", "moss", "--model", "tiny", "--codec", "tiny", "--device", "cpu", "--max-seq-len", "1024"]
    else:
        cmd += ["--engine", "moss", "--model", args.model, "--codec", args.codec]
    log_file = open(work / f"fe{index}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)


def stop_front_ends(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


async def wait_ready(urls: list[str], procs: list[subprocess.Popen], replicas: int, limit: float) -> None:
    deadline = time.monotonic() + limit
    async with aiohttp.ClientSession() as http:
        for url in urls:
            while True:
                if any(p.poll() is not None for p in procs):
                    raise RuntimeError("a front end exited (see its log in --work)")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} not ready")
                try:
                    async with http.get(url + "/readyz") as resp:
                        if resp.status == 200 and (await resp.json()).get("replicas_ready", 0) >= replicas:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.5)


# --------------------------------------------------------------------------- driving


async def one_take(http: aiohttp.ClientSession, ws_url: str, start: dict[str, Any], go: asyncio.Event) -> dict:
    async with http.ws_connect(ws_url, max_msg_size=64 * 2**20) as ws:
        await ws.receive()  # hello
        await go.wait()
        t0 = time.perf_counter()
        await ws.send_str(json.dumps(start))
        pcm = chunks = 0
        async for msg in ws:
            data = msg.data
            if data[0] == 1:
                pcm += len(data) - 5
                chunks += 1
                continue
            obj = json.loads(data[5:])
            if obj["type"] == "error":
                raise RuntimeError(f"server error: {obj}")
            if obj["type"] == "end":
                return {"audio_sec": pcm / BYTES_PER_AUDIO_SEC, "chunks": chunks, "wall_sec": time.perf_counter() - t0,
                        "frames": obj["n_frames"]}
    raise RuntimeError("socket closed before the end frame")


async def relay_counts(http: aiohttp.ClientSession, urls: list[str]) -> tuple[float, float]:
    """Stream items received from replicas and the chunks they carried, summed over the front ends."""
    items = chunks = 0.0
    for url in urls:
        async with http.get(url + "/metrics") as resp:
            for line in (await resp.text()).splitlines():
                if line.startswith("moss_rt_cluster_relay_items_total "):
                    items += float(line.split()[1])
                elif line.startswith("moss_rt_cluster_relay_chunks_total "):
                    chunks += float(line.split()[1])
    return items, chunks


async def run_round(urls: list[str], pids: list[int], streams: int, args: argparse.Namespace) -> dict[str, Any]:
    start = {"type": "start", "text": TEXT, "max_new_tokens": args.frames, "chunk_frames": args.chunk_frames,
             "text_temperature": 0.0}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        go = asyncio.Event()
        ws_urls = [u.replace("http", "ws") + "/api/ws" for u in urls]
        tasks = [
            asyncio.create_task(one_take(http, ws_urls[i % len(ws_urls)], {**start, "seed": i}, go))
            for i in range(streams)
        ]
        await asyncio.sleep(0.5 + streams / 200)  # every client connected and holding its hello
        items0, chunks0 = await relay_counts(http, urls)
        cpu0 = [cpu_seconds(pid) for pid in pids]
        threads0 = thread_cpu_seconds(pids[0])
        me0 = time.process_time()
        t0 = time.perf_counter()
        go.set()
        done = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        cpu = [cpu_seconds(pid) - c for pid, c in zip(pids, cpu0, strict=True)]
        threads = {name: t - threads0.get(name, 0.0) for name, t in thread_cpu_seconds(pids[0]).items()}
        clients_cpu = time.process_time() - me0
        items1, chunks1 = await relay_counts(http, urls)
    audio = sum(d["audio_sec"] for d in done)
    chunks = sum(d["chunks"] for d in done)
    fe_cpu = sum(cpu)
    ms_per_audio_sec = 1000.0 * fe_cpu / audio
    return {
        "streams": streams,
        "frames_per_take": args.frames,
        "audio_sec": round(audio, 1),
        "chunks": chunks,
        "wall_sec": round(wall, 2),
        "aggregate_rtf": round(audio / wall, 1),
        "relayed_mb_per_sec": round(audio * BYTES_PER_AUDIO_SEC / wall / 1e6, 2),
        "fe_cpu_sec": [round(c, 2) for c in cpu],
        "fe_busy_max": round(max(cpu) / wall, 2),
        "fe_cpu_ms_per_audio_sec": round(ms_per_audio_sec, 3),
        "fe_cpu_us_per_chunk": round(1e6 * fe_cpu / max(1, chunks), 1),
        # Relay hops: items from the replicas and chunks per item (above 1: chunks that piled up went together).
        # With --reuse-port each scrape reaches one front end of the port: these then cover only some of them.
        "relay_items": int(items1 - items0),
        "chunks_per_item": round((chunks1 - chunks0) / max(1.0, items1 - items0), 2),
        "streams_per_core": round(1000.0 / ms_per_audio_sec, 1),
        "cores_at_800x": round(0.8 * ms_per_audio_sec, 2),
        "bench_clients_cpu_sec": round(clients_cpu, 2),
        # The first front end's CPU by thread: its event loop (relay, WebSocket) vs Ray's own threads.
        "fe0_threads_cpu_sec": {k: round(v, 2) for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v >= 0.01},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("scripted", "tiny", "moss"), default="scripted")
    p.add_argument("--model", default="auto", help="with --engine moss")
    p.add_argument("--codec", default="auto", help="with --engine moss")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--front-ends", default="1,2", help="front-end process counts to measure, in order")
    p.add_argument("--streams", default="16,64", help="takes at once per round")
    p.add_argument("--frames", type=int, default=150, help="frames per take (12.5 per second of audio)")
    p.add_argument("--chunk-frames", type=int, default=8)
    p.add_argument("--frame-ms", type=float, default=2.0, help="scripted replicas: wall time per frame")
    p.add_argument("--reuse-port", action="store_true", help="all front ends on one port (SO_REUSEPORT)")
    p.add_argument("--profile", action="store_true",
                   help="run the first front end under cProfile (its event loop thread; stats in --work/fe0.prof)")
    p.add_argument("--work", type=Path, default=Path("/tmp/moss-relay-bench"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    args.front_ends = [int(n) for n in args.front_ends.split(",")]
    args.streams = [int(n) for n in args.streams.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "rounds": []}
    local = LocalRay(num_cpus=args.replicas * args.replica_cpus + 1)
    address = local.address
    try:
        for n in args.front_ends:
            ports = [free_port()] * n if args.reuse_port else [free_port() for _ in range(n)]
            procs: list[subprocess.Popen] = []
            try:
                for i, port in enumerate(ports):
                    procs.append(start_front_end(args, address, port, i, args.work))
                    if i == 0:  # the first creates the replicas; the others find them
                        asyncio.run(wait_ready([f"http://127.0.0.1:{port}"], procs, args.replicas, 900))
                urls = sorted({f"http://127.0.0.1:{port}" for port in ports})
                asyncio.run(wait_ready(urls, procs, args.replicas, 900))
                asyncio.run(run_round(urls, [pr.pid for pr in procs], min(args.streams), args))  # warm-up
                for streams in args.streams:
                    r = {"front_ends": n, **asyncio.run(run_round(urls, [pr.pid for pr in procs], streams, args))}
                    log.info("%s", json.dumps(r))
                    result["rounds"].append(r)
                    if args.out is not None:
                        args.out.write_text(json.dumps(result, indent=1))
            finally:
                stop_front_ends(procs)
    finally:
        local.stop()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
