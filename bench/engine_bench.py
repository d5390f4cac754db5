"""Engine benchmark (issue 5): the real server driven over WebSocket at concurrency 1, 8, 32, 64.

On a CUDA machine:
    python bench/engine_bench.py --out results.json
writes full-size random-weight checkpoints in the real layout (model 4.55B bf16; codec decode-only),
starts ``python -m moss_rt serve`` on them in a subprocess, and drives it with aiohttp WebSocket
clients (``/api/ws``, wire protocol v1), one take per client, 400-row prompts, repetition penalty 1.1.
It prints one JSON object: per concurrency the server-side ``gpu_first_ms`` and client-side TTFA
(p50/p95) and where the first audio went (each take's parts at 1, ``first_audio_path_ms``: each part's p50/p95
above), per-stream real-time factor (min/median), aggregate real-time factor, and the server's
step-time split from ``/metrics`` (model step, codec decode, batched prefill passes and takes per pass,
scheduling rest; with the codec overlapped (``codec_overlap``, the server's default) codec time runs next to
the model steps and ``codec_wait_ms_per_step`` is what the scheduler still lost waiting for the codec);
``--codec-overlap both`` first runs the same rounds on a server with the overlap off (keys
``overlap_off_…``); then an eager, synchronised profile of one frame (backbone / local transformer /
sampling) and of the codec.
``--tiny`` runs everything on the tiny model (CPU smoke test of this script).

Cluster mode (issue 13, docs/cluster.md): ``--replicas N`` starts the server as the front end of N
engine replicas on a local Ray (``serve --cluster auto --replicas N``, each replica on its own GPU with
``max(concurrency) / N`` slots) and drives it exactly the same way; ``--baseline C`` first measures the
single-process server (one GPU) at concurrency C in the same run and reports the cluster's aggregate
real-time factor as a multiple of it (``scale_vs_baseline``).

Issue 29: in cluster mode the bench owns the Ray cluster (started in this process, bench/local_ray.py) and starts
``--front-ends N`` front-end processes (``serve --cluster ADDRESS``, each on its own port; the first creates the
replicas); the clients spread over them. Each round then also reports ``front_ends``: their CPU over the rounds
(the relay cost: ``cpu_ms_per_audio_sec``, ``busy_max`` = the busiest one's share of a core, its CPU by thread)
and the relay hops (stream items from the replicas, chunks per item), and ``replicas``: per replica the frames,
the prompt rows computed and shared from its cache, and where the routers sent takes by prompt match
(``routes_hit``/``routes_spill``/``routes_miss``, cache-aware routing). The 2xH200 run of issue 29:
    python bench/engine_bench.py --replicas 2 --front-ends 2 --baseline 128 --concurrency 256 --repeats 3 \
        --prompts lines --out cluster.json

Start to ready (issue 24): every single-process run also reports the server's start phase by phase (``startup``,
from ``moss_rt_startup_seconds`` in /metrics: engine/startup.py; ``process`` is process start to engine start,
``ready`` process start to ready, the ``compile: ...`` phases ran on threads beside the others) next to
``server_ready_sec`` (the server process started to /readyz 200). As a freshly started machine (every Triton kernel
compiled; with ``--drop-page-cache`` the weights from the disk too), then a second start (caches warm):
    python bench/engine_bench.py --cold --fresh-caches --drop-page-cache --prompts lines --concurrency 1 \
        --single-repeats 3 --no-profile --out first.json
    python bench/engine_bench.py --cold --prompts lines --concurrency 1 --single-repeats 3 --no-profile \
        --out second.json
``--compile-threads 1`` starts the server compiling every kernel in its captures, one after the other (as before);
``--no-compile-processes`` compiles them ahead on the server's threads instead of its worker processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from local_ray import RAY_ENV, LocalRay, cpu_seconds, per_replica, thread_cpu_seconds  # noqa: E402

log = logging.getLogger("engine_bench")
PENALTY = 1.1


# --------------------------------------------------------------------------- setup


# The full-size writers, run in a child process: the model's makes its random weights on the GPU, and a bench process
# that kept that CUDA context (and ~3.5 GiB its allocator cached) shared the GPU with the server it measured. On an
# H200 such a server planned 209 slots instead of 216 and the first render with directors of script_bench took
# 8.0-10.3 s where every later one, and every one with the checkpoints written beforehand, took 5.4-7.1 s.
_FULL_SIZE_WRITERS = {
    "model": "from moss_rt.model.tiny import write_full_size_random_checkpoint as w; w(sys.argv[1])",
    "codec": "from moss_rt.codec.tiny import write_full_size_random_codec as w; w(sys.argv[1], with_encoder=False)",
}


def write_checkpoints(work: Path, tiny: bool) -> tuple[Path, Path]:
    """The model and codec checkpoints under ``work`` (written once: tiny ones here, full-size random ones in a child
    process, so this process never holds the GPU)."""
    model, codec = work / "model", work / "codec"
    for name, folder in (("model", model), ("codec", codec)):
        if (folder / "config.json").is_file():
            continue
        t0 = time.perf_counter()
        if tiny:
            from moss_rt.codec.tiny import write_tiny_codec
            from moss_rt.model.tiny import write_tiny_checkpoint

            (write_tiny_checkpoint if name == "model" else write_tiny_codec)(folder)
        else:
            path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
            env = dict(os.environ, PYTHONPATH=path)
            code = f"import sys; {_FULL_SIZE_WRITERS[name]}"
            subprocess.run([sys.executable, "-c", code, str(folder)], check=True, env=env, cwd=ROOT)
        log.info("%s checkpoint written in %.1f s", name, time.perf_counter() - t0)
    return model, codec


def text_for_rows(model_dir: Path, rows: int, line: int | None = None) -> tuple[str, str]:
    """A directed line whose prompt is exactly ``rows`` rows with this checkpoint's tokenizer. With ``line``:
    that line of a script, each one different from its first word on (one voice and direction throughout)."""
    from moss_rt.model.config import MossTTSConfig
    from moss_rt.model.prompt import build_prompt_rows, load_tokenizer

    tok, cfg = load_tokenizer(model_dir), MossTTSConfig.from_file(model_dir / "config.json")
    instruction = "Tired, slow, a little hoarse; pauses between the sentences."
    base = "It was late, and the house was quiet. The rain had stopped an hour ago. "
    opening = "" if line is None else f"Line {line}: "
    words = (opening + base * 200).split(" ")

    def count(n: int) -> int:
        return len(build_prompt_rows(tok, cfg, text=" ".join(words[:n]), instruction=instruction))

    lo, hi = 1, len(words)
    while lo < hi:  # largest word count not above the target
        mid = (lo + hi + 1) // 2
        if count(mid) <= rows:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(words[:lo])
    # Top up one character at a time (at most one row each) so the row count is exact.
    while count_rows(tok, cfg, text, instruction) < rows:
        text += "."
    return text, instruction


def count_rows(tok: Any, cfg: Any, text: str, instruction: str) -> int:
    from moss_rt.model.prompt import build_prompt_rows

    return len(build_prompt_rows(tok, cfg, text=text, instruction=instruction))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    args: argparse.Namespace,
    model: Path,
    codec: Path,
    port: int,
    log_path: Path,
    *,
    concurrency: list[int],
    replicas: int = 0,
    codec_overlap: bool = True,
    cluster: str = "auto",
) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(
        MOSS_RT_MAX_SEQ_LEN=str(args.max_seq_len),
        MOSS_RT_MAX_TAKES_PER_CLIENT="0",  # every bench client shares 127.0.0.1
        MOSS_RT_HTTP_REQUESTS_PER_SEC="0",  # ...so does the per-client request rate (WebSocket upgrades)
        MOSS_RT_MAX_CONNECTIONS_PER_CLIENT="0",  # ...and the cap on its requests in progress
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    slots = max(concurrency) if replicas == 0 else -(-max(concurrency) // replicas)
    cmd = [
        sys.executable, "-m", "moss_rt", "serve", "--port", str(port), "--model", str(model), "--codec", str(codec),
        "--device", "cpu" if args.tiny else "cuda", "--max-slots", str(slots),
        "--max-queue", str(max(concurrency)), "--max-lead-sec", "0", "--data-dir", str(args.work / "data"),
        "--log-level", "INFO", "--codec-overlap" if codec_overlap else "--no-codec-overlap",
    ]
    if getattr(args, "no_prompt_cache", False):
        cmd.append("--no-prompt-cache")
    if getattr(args, "compile_threads", None) is not None:
        cmd += ["--compile-threads", str(args.compile_threads)]
    if getattr(args, "no_compile_processes", False):
        cmd.append("--no-compile-processes")
    if replicas > 0:
        # Ray on loopback, no usage report; the replicas are CPU ones with --tiny.
        env.update(RAY_ENV)
        # Half the machine's cores shared by the replicas (Ray sets each one's OMP_NUM_THREADS from it).
        cpus = max(1, (os.cpu_count() or 2) // (2 * replicas))
        cmd += ["--cluster", cluster, "--replicas", str(replicas), "--replica-cpus", str(cpus)]
    elif not args.tiny and args.replicas > 0:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]  # the baseline: one GPU
    cmd += getattr(args, "server_arg", None) or []  # A/B runs of a server setting
    fh = open(log_path, "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)


async def wait_ready(url: str, proc: subprocess.Popen, limit_sec: float, replicas: int = 0) -> float:
    """Seconds until /readyz says ready (a cluster front end: with every replica ready, not just one)."""
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as http:
        while time.perf_counter() - t0 < limit_sec:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                async with http.get(url + "/readyz") as resp:
                    if resp.status == 200 and (await resp.json()).get("replicas_ready", 0) >= replicas:
                        return time.perf_counter() - t0
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError("server not ready")


async def startup_phases(url: str) -> dict[str, float]:
    """The server's start, phase by phase (``moss_rt_startup_seconds{phase}``, engine/startup.py): ``process`` is
    process start to engine start (Python, imports, the app), ``ready`` process start to ready; the ``compile: ...``
    phases ran on threads beside the others."""
    async with aiohttp.ClientSession() as http:
        figures = await scrape(http, url)
    prefix = 'moss_rt_startup_seconds{phase="'
    return {k[len(prefix) : -2]: round(v, 3) for k, v in figures.items() if k.startswith(prefix)}


def clear_caches(args: argparse.Namespace) -> dict[str, Any]:
    """``--fresh-caches``: remove Triton's kernel caches (the server's, in its data dir, and the default ~/.triton) so
    the next start compiles every kernel, as a freshly started machine does; ``--drop-page-cache``: also drop the
    kernel's page cache (root only), so the weights come from the disk. Says what was done."""
    import shutil

    done: dict[str, Any] = {}
    if args.fresh_caches:
        folders = [args.work / "data" / "triton-cache", Path.home() / ".triton" / "cache"]
        if os.environ.get("TRITON_CACHE_DIR"):
            folders.append(Path(os.environ["TRITON_CACHE_DIR"]))
        done["removed"] = [str(f) for f in folders if f.exists()]
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    if args.drop_page_cache:
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            done["page_cache_dropped"] = True
        except OSError as exc:
            done["page_cache_dropped"] = f"no: {exc}"
    return done


async def wait_graphs(url: str, proc: subprocess.Popen, limit_sec: float) -> float:
    """Seconds until the server has captured every CUDA graph it captures while idle (its steady state);
    a round started before that times captures and eager calls of shapes met for the first time."""
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as http:
        while time.perf_counter() - t0 < limit_sec:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            if (await scrape(http, url)).get("moss_rt_graphs_pending", 0.0) == 0.0:
                return time.perf_counter() - t0
            await asyncio.sleep(1.0)
    raise TimeoutError("graphs still pending")


# --------------------------------------------------------------------------- driving


# The engine's account of a take's first audio, in its end frame (moss_rt.engine.scheduler.first_audio_path).
FIRST_AUDIO_PATH = (
    "prompt_ms", "queue_ms", "prefill_ms", "to_first_frame_ms", "to_codec_ms", "codec_queue_ms", "decode_ms",
)


async def one_take(http: aiohttp.ClientSession, ws_url: str, start: dict[str, Any], go: asyncio.Event) -> dict:
    async with http.ws_connect(ws_url, max_msg_size=64 * 2**20) as ws:
        await ws.receive()  # hello
        await go.wait()
        t0 = time.perf_counter()
        await ws.send_str(json.dumps(start))
        first_pcm: float | None = None
        pcm_bytes = 0
        server_first = None
        async for msg in ws:
            data = msg.data
            if data[0] == 1:
                if first_pcm is None:
                    first_pcm = time.perf_counter()
                pcm_bytes += len(data) - 5
                continue
            obj = json.loads(data[5:])
            if obj["type"] == "start":
                server_first = obj.get("gpu_first_ms")
            elif obj["type"] == "error":
                raise RuntimeError(f"server error: {obj}")
            elif obj["type"] == "end":
                wall = time.perf_counter() - t0
                audio = pcm_bytes / 2 / 48000
                return {
                    "ttfa_ms": None if first_pcm is None else (first_pcm - t0) * 1000.0,
                    "gpu_first_ms": server_first,
                    "audio_sec": audio,
                    "wall_sec": wall,
                    "rtf": audio / wall,
                    "reason": obj["reason"],
                    "frames": obj["n_frames"],
                    # The engine's account of its first audio (moss_rt.engine.scheduler.first_audio_path).
                    "path": {k: obj[k] for k in FIRST_AUDIO_PATH if isinstance(obj.get(k), (int, float))},
                }
    raise RuntimeError("socket closed before the end frame")


REPLICA_LABEL = re.compile(r'(,?)replica="[^"]*"')


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """/metrics as {name with labels: value}; a cluster's per-replica series are summed over ``replica``."""
    async with http.get(url + "/metrics") as resp:
        return parse_metrics(await resp.text())


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus exposition text as {name with labels: value}, per-replica series summed over ``replica``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = REPLICA_LABEL.sub("", name).replace("{,", "{").replace("{}", "")
            out[name] = out.get(name, 0.0) + float(value)
    return out


SHAPE_SERIES = re.compile(r'^moss_rt_codec_call_shape_seconds_count\{frames="(\d+)",graphed="([01])"\}$')


def codec_by_shape(delta: Callable[[str], float], after: dict[str, float], steps: float) -> dict[str, dict]:
    """{"T=1 graph": {"calls", "ms_per_call", "ms_per_step"}, ...}: where the codec's share of a step went."""
    out: dict[str, dict] = {}
    for name in sorted(after):
        m = SHAPE_SERIES.match(name)
        if m is None or not (calls := delta(name)):
            continue
        seconds = delta(name.replace("_count{", "_sum{"))
        key = f"T={m.group(1)} {'graph' if m.group(2) == '1' else 'eager'}"
        out[key] = {"calls": calls, "ms_per_call": round(1000.0 * seconds / calls, 2),
                    "ms_per_step": round(1000.0 * seconds / max(1.0, steps), 3)}
    return out


ROUND_PHASE_SERIES = re.compile(r'^moss_rt_round_phase_seconds_sum\{phase="([a-z_]+)"\}$')


def round_phases(delta: Callable[[str], float], after: dict[str, float], steps: float) -> dict[str, dict]:
    """{"step": {"wall_ms_per_step", "cpu_ms_per_step"}, ...}: the engine thread's time in each part of its rounds
    (wall, and its own CPU: the gap between them is time it waited, on the device or for the interpreter lock)."""
    out: dict[str, dict] = {}
    for name in sorted(after):
        m = ROUND_PHASE_SERIES.match(name)
        if m is None or not (seconds := delta(name)):
            continue
        cpu = delta(f'moss_rt_round_phase_cpu_seconds_total{{phase="{m.group(1)}"}}')
        out[m.group(1)] = {"wall_ms_per_step": round(1000.0 * seconds / max(1.0, steps), 3),
                           "cpu_ms_per_step": round(1000.0 * cpu / max(1.0, steps), 3)}
    return out


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else float("nan")


def first_audio_parts(paths: list[dict[str, float]]) -> dict[str, list[float]]:
    """Many takes at once: where their first audio went, each part's [p50, p95] in ms over the takes that have it."""
    return {k: [pct([p[k] for p in paths if k in p], q) for q in (50, 95)] for k in FIRST_AUDIO_PATH}


CLUSTER_SERIES = (
    "moss_rt_frames_total", "moss_rt_prompt_rows_total", "moss_rt_cluster_prompt_routes_total",
    "moss_rt_takes_total",
)


async def cluster_view(http: aiohttp.ClientSession, urls: list[str], pids: list[int]) -> dict[str, Any]:
    """What a cluster's rounds are measured by: replica series (from the first front end: every front end shows
    the same replica registries), router series (summed over the front ends: each routes its own takes), the
    front ends' CPU."""
    texts = []
    for url in urls:
        async with http.get(url + "/metrics") as resp:
            texts.append(await resp.text())
    replicas = per_replica(texts[0], CLUSTER_SERIES[:2])
    for text in texts:
        for name, row in per_replica(text, CLUSTER_SERIES[2:3]).items():
            for key, value in row.items():
                replicas.setdefault(name, {})[key] = replicas.get(name, {}).get(key, 0.0) + value
    relay = {"items": 0.0, "chunks": 0.0}
    for text in texts:
        for line in text.splitlines():
            if line.startswith("moss_rt_cluster_relay_items_total "):
                relay["items"] += float(line.split()[1])
            elif line.startswith("moss_rt_cluster_relay_chunks_total "):
                relay["chunks"] += float(line.split()[1])
    return {
        "replicas": replicas,
        "relay": relay,
        "cpu": [cpu_seconds(pid) for pid in pids],
        "threads": thread_cpu_seconds(pids[0]) if pids else {},
    }


def cluster_delta(before: dict[str, Any], after: dict[str, Any], audio_sec: float, wall: float) -> dict[str, Any]:
    """The rounds' share of the front ends' CPU (``wall``: the rounds' own time) and the replicas' counters."""
    cpu = [b - a for a, b in zip(before["cpu"], after["cpu"], strict=True)]
    items = after["relay"]["items"] - before["relay"]["items"]
    chunks = after["relay"]["chunks"] - before["relay"]["chunks"]
    replicas = {}
    for name, row in after["replicas"].items():
        was = before["replicas"].get(name, {})

        def d(key: str, row: dict[str, float] = row, was: dict[str, float] = was) -> float:
            return row.get(key, 0.0) - was.get(key, 0.0)

        replicas[name] = {
            "frames": d("moss_rt_frames_total"),
            "prompt_rows_prefilled": d('moss_rt_prompt_rows_total{source="prefill"}'),
            "prompt_rows_cached": d('moss_rt_prompt_rows_total{source="cache"}'),
            **{
                f"routes_{m}": d(f'moss_rt_cluster_prompt_routes_total{{match="{m}"}}')
                for m in ("hit", "spill", "miss")
            },
        }
    threads = {k: round(v - before["threads"].get(k, 0.0), 2) for k, v in after["threads"].items()}
    return {
        "front_ends": {
            "count": len(cpu),
            "cpu_sec": [round(c, 2) for c in cpu],
            "busy_max": round(max(cpu) / wall, 2) if cpu and wall > 0 else None,
            "cpu_ms_per_audio_sec": round(1000.0 * sum(cpu) / audio_sec, 3) if audio_sec else None,
            "relay_items": items,
            "chunks_per_item": round(chunks / items, 2) if items else None,
            "fe0_threads_cpu_sec": {k: v for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v >= 0.05},
        },
        "replicas": replicas,
    }


async def run_round(url: str | list[str], concurrency: int, repeats: int, start: dict[str, Any],
                    settle_sec: float = 0.0, line_for: Any = None, pids: list[int] | None = None) -> dict:
    """``repeats`` rounds of ``concurrency`` takes started together; ``line_for(seed)``: each take's own text
    (default: every take speaks ``start``'s). ``url`` a list: cluster front ends, the clients spread over them
    (``pids``: theirs, for their CPU)."""
    urls = [url] if isinstance(url, str) else url
    url = urls[0]
    ws_urls = [u.replace("http", "ws") + "/api/ws" for u in urls]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    # limit=0: aiohttp's default connector holds at most 100 connections, which would cap concurrency.
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        before = await scrape(http, url)
        fleet_before = await cluster_view(http, urls, pids) if pids else None
        takes: list[dict] = []
        t0 = time.perf_counter()
        aggregate, walls = [], []
        for r in range(repeats):
            go = asyncio.Event()
            seeds = [1000 * r + i for i in range(concurrency)]
            starts = [{**start, "seed": seed} | ({"text": line_for(seed)} if line_for else {}) for seed in seeds]
            tasks = [
                asyncio.create_task(one_take(http, ws_urls[i % len(ws_urls)], msg, go)) for i, msg in enumerate(starts)
            ]
            await asyncio.sleep(0.2)  # every client connected and holding its hello
            go.set()
            t_round = time.perf_counter()
            done = await asyncio.gather(*tasks)
            wall = time.perf_counter() - t_round
            aggregate.append(sum(d["audio_sec"] for d in done) / wall)
            walls.append(wall)
            takes.extend(done)
        total = time.perf_counter() - t0
        await asyncio.sleep(settle_sec)  # a cluster front end shows replica metrics one poll late
        after = await scrape(http, url)
        fleet_after = await cluster_view(http, urls, pids) if pids else None
    fleet = (
        cluster_delta(fleet_before, fleet_after, sum(t["audio_sec"] for t in takes), sum(walls))
        if fleet_before is not None and fleet_after is not None
        else {}
    )

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = delta("moss_rt_step_seconds_count")
    codec_calls = delta("moss_rt_codec_seconds_count")
    frames = delta("moss_rt_frames_total")
    return {
        "concurrency": concurrency,
        "takes": len(takes),
        "frames_per_take": start["max_new_tokens"],
        "reasons": sorted({t["reason"] for t in takes}),
        # One take at a time (the cold start's first takes): each one's first audio, where its time went.
        **({"first_audio_paths": [{"gpu_first_ms": t["gpu_first_ms"], **t["path"]} for t in takes]}
           if concurrency == 1 else {}),
        **({"first_audio_path_ms": first_audio_parts([t["path"] for t in takes])} if concurrency > 1 else {}),
        "gpu_first_ms_p50": pct([t["gpu_first_ms"] for t in takes if t["gpu_first_ms"] is not None], 50),
        "gpu_first_ms_p95": pct([t["gpu_first_ms"] for t in takes if t["gpu_first_ms"] is not None], 95),
        "ttfa_ms_p50": pct([t["ttfa_ms"] for t in takes if t["ttfa_ms"] is not None], 50),
        "ttfa_ms_p95": pct([t["ttfa_ms"] for t in takes if t["ttfa_ms"] is not None], 95),
        "stream_rtf_min": min(t["rtf"] for t in takes),
        "stream_rtf_median": pct([t["rtf"] for t in takes], 50),
        "aggregate_rtf": float(np.median(aggregate)),
        "aggregate_rtf_rounds": [round(a, 2) for a in aggregate],
        "wall_sec": total,
        "server": {
            "steps": steps,
            "mean_batch": delta("moss_rt_step_batch_size_sum") / max(1.0, steps),
            "model_step_ms_mean": 1000.0 * delta("moss_rt_step_seconds_sum") / max(1.0, steps),
            "codec_calls": codec_calls,
            "codec_ms_mean_per_call": 1000.0 * delta("moss_rt_codec_seconds_sum") / max(1.0, codec_calls),
            "codec_ms_per_step": 1000.0 * delta("moss_rt_codec_seconds_sum") / max(1.0, steps),
            # The codec's time by call shape: chunk length in frames, graphed or eager (calls, ms per step).
            "codec_by_shape": codec_by_shape(delta, after, steps),
            # The engine thread's rounds by part (control, admit, step, flush, prepare, capture): wall and CPU.
            "round_phases": round_phases(delta, after, steps),
            # Overlap: 1 when the codec ran on its own thread/stream; the scheduler's waits for it (queue full,
            # a take's last chunk, captures/rebuilds behind queued decodes), per step and per wait.
            "codec_overlap": after.get("moss_rt_codec_overlap", float("nan")),
            "codec_wait_ms_per_step": 1000.0 * delta("moss_rt_codec_wait_seconds_sum") / max(1.0, steps),
            "codec_waits": delta("moss_rt_codec_wait_seconds_count"),
            # The garbage collector's runs meanwhile (any thread): full collections and the time of all of them.
            "gc_full_collections": delta('moss_rt_gc_pause_seconds_count{generation="2"}'),
            "gc_ms_total": 1000.0 * sum(delta(f'moss_rt_gc_pause_seconds_sum{{generation="{g}"}}') for g in "012"),
            # Wall time per step as the streams saw it (prefill and waits included): with the codec overlapped
            # it nears the model step; inline it is about model step + codec per step.
            "wall_ms_per_step": 1000.0 * sum(walls) / max(1.0, steps),
            "prefill_ms_mean": 1000.0 * delta("moss_rt_prefill_seconds_sum")
            / max(1.0, delta("moss_rt_prefill_seconds_count")),
            # batched prefill: passes through the backbone, takes per pass, wall time of one pass
            "prefill_passes": delta("moss_rt_prefill_batch_size_count"),
            "prefill_takes_per_pass": delta("moss_rt_prefill_batch_size_sum")
            / max(1.0, delta("moss_rt_prefill_batch_size_count")),
            "prefill_pass_ms_mean": 1000.0 * delta("moss_rt_prefill_call_seconds_sum")
            / max(1.0, delta("moss_rt_prefill_call_seconds_count")),
            "frames": frames,
            # Prompt rows computed by prefill passes vs shared from blocks kept by earlier takes (prompt cache).
            "prompt_rows_prefilled": delta('moss_rt_prompt_rows_total{source="prefill"}'),
            "prompt_rows_cached": delta('moss_rt_prompt_rows_total{source="cache"}'),
            # A frame's wall time as running streams saw it (step start to step start, prefill passes between
            # included): how far a burst of arrivals held them (issue 12: at most about one 80 ms frame).
            "step_interval_ms_mean": 1000.0 * delta("moss_rt_step_interval_seconds_sum")
            / max(1.0, delta("moss_rt_step_interval_seconds_count")),
            "step_intervals": delta("moss_rt_step_interval_seconds_count"),
            "step_intervals_over_80ms": delta('moss_rt_step_interval_seconds_bucket{le="+Inf"}')
            - delta('moss_rt_step_interval_seconds_bucket{le="0.08"}'),
            "step_intervals_over_120ms": delta('moss_rt_step_interval_seconds_bucket{le="+Inf"}')
            - delta('moss_rt_step_interval_seconds_bucket{le="0.12"}'),
        },
        **fleet,
    }


# --------------------------------------------------------------------------- eager profile


def eager_profile(model_dir: Path, codec_dir: Path, batches: list[int], prompt_rows: int, tiny: bool) -> dict:
    """One frame split into backbone / local / sampling (synchronised laps, eager: no graphs), and codec calls."""
    import torch

    import moss_rt.model.step as step_mod
    from moss_rt.codec import load_codec
    from moss_rt.codec.streaming import StreamingDecoder
    from moss_rt.generation import SamplingParams
    from moss_rt.model.loader import load_model
    from moss_rt.model.runner import ModelRunner

    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    original_start, original_lap = step_mod.Timer.start, step_mod.Timer.lap

    def start(self: Any) -> None:
        sync()
        original_start(self)

    def lap(self: Any, bucket: str) -> None:
        sync()
        original_lap(self, bucket)

    step_mod.Timer.start, step_mod.Timer.lap = start, lap  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    loaded = load_model(model_dir, device=device, dtype=dtype)
    runner = ModelRunner(loaded.model, loaded.tokenizer, loaded.config, max_slots=max(batches),
                         max_seq_len=prompt_rows + 64, device=device, dtype=dtype, use_cuda_graphs=False)
    text, instruction = text_for_rows(model_dir, prompt_rows)
    rows = runner.build_prompt(text=text, instruction=instruction)
    slots = [runner.alloc_slot() for _ in range(max(batches))]
    for i, s in enumerate(slots):
        runner.prefill(s, rows)
        runner.set_sampling(s, SamplingParams(audio_repetition_penalty=PENALTY, text_temperature=0.0), seed=i)
    st = runner.state
    for b in batches:
        laps = []
        for it in range(8):
            st.active.zero_()
            st.active[:b] = True
            timer = step_mod.Timer()
            key_len = int(st.lengths[:b].max()) + 1
            step_mod.frame_step(runner.model, st, runner.tables, 0, b, key_len, timer)
            st.active.zero_()
            if it >= 3:
                laps.append((timer.backbone_ms, timer.local_ms, timer.sampling_ms + timer.bookkeeping_ms))
        arr = np.array(laps)
        out[f"model_eager_batch{b}_ms"] = {
            "backbone": float(np.median(arr[:, 0])), "local": float(np.median(arr[:, 1])),
            "sampling": float(np.median(arr[:, 2])),
        }
    del runner, loaded
    step_mod.Timer.start, step_mod.Timer.lap = original_start, original_lap  # type: ignore[method-assign]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    codec = load_codec(codec_dir, device=device, compute_dtype=dtype, decode_only=True)
    dec = StreamingDecoder(codec, device=device, dtype=dtype, max_streams=max(batches))
    for b in batches:
        for t in (1, 8):
            states = [dec.new_state() for _ in range(b)]
            codes = [np.zeros((t, 12), dtype=np.int64)] * b
            times = []
            for it in range(6):
                sync()
                t0 = time.perf_counter()
                dec.decode(states, codes)
                sync()
                if it >= 2:
                    times.append((time.perf_counter() - t0) * 1000.0)
            out[f"codec_batch{b}_T{t}_ms"] = float(np.median(times))
            for s in states:
                s.close()
    return out


# --------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--work", type=Path, default=Path("/tmp/moss-engine-bench"))
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test)")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--frames", type=int, default=150, help="frames per take (12.5 per second of audio)")
    p.add_argument("--single-repeats", type=int, default=5, help="sequential takes at concurrency 1")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds at each concurrency above 1 (aggregate RTF: the median round; the other figures "
                        "pool every take)")
    p.add_argument("--prompt-rows", type=int, default=400)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--chunk-frames", type=int, default=8)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--prompts", choices=("same", "lines"), default="same",
                   help="same: every take speaks one line (a burst of one prompt); lines: each take its own line "
                        "of the same length, one voice and direction (the prompt cache can share only the opening)")
    p.add_argument("--no-prompt-cache", action="store_true", help="start the server with --no-prompt-cache")
    p.add_argument("--cold", action="store_true",
                   help="start the rounds as soon as the server is ready, before its idle-time graph captures "
                        "(what the first users after a restart see); by default wait for them (steady state)")
    p.add_argument("--fresh-caches", action="store_true",
                   help="remove Triton's kernel caches first (the server's in WORK/data/triton-cache, ~/.triton): "
                        "the start compiles every kernel, as on a freshly started machine")
    p.add_argument("--drop-page-cache", action="store_true",
                   help="drop the OS page cache first (root only): the weights come from the disk")
    p.add_argument("--compile-threads", type=int, default=None,
                   help="the server's --compile-threads (1: nothing compiled ahead; default: the server's)")
    p.add_argument("--no-compile-processes", action="store_true",
                   help="the server's --no-compile-processes: the kernels ahead compile on its threads, not in worker "
                        "processes (the start before issue 24's worker processes)")
    p.add_argument("--server-log", type=Path, default=None)
    p.add_argument("--server-arg", action="append", default=[],
                   help="one more argument for the server, repeatable (--server-arg=--batch-yield-share=0.75)")
    p.add_argument("--upstream", type=Path, default=None,
                   help="unmodified upstream moss_tts_local_v1.5 folder: also time its per-frame generate")
    p.add_argument("--deadline-sec", type=float, default=480.0, help="skip the optional sections past this")
    p.add_argument("--replicas", type=int, default=0, help="cluster mode: N engine replicas on a local Ray")
    p.add_argument("--baseline", type=int, default=0, help="with --replicas: one GPU, one process, at this concurrency")
    p.add_argument("--front-ends", type=int, default=1,
                   help="with --replicas: front-end processes (each its own port; the clients spread over them)")
    p.add_argument("--codec-overlap", choices=("on", "off", "both"), default="on",
                   help="the server's codec_overlap; both: the rounds with it off first (keys overlap_off_...)")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    t_all = time.perf_counter()
    model, codec = write_checkpoints(args.work, args.tiny)
    result["checkpoints_sec"] = time.perf_counter() - t_all
    if args.fresh_caches or args.drop_page_cache:
        result["caches"] = clear_caches(args)
        log.info("caches: %s", result["caches"])
    text, instruction = text_for_rows(model, args.prompt_rows)
    start = {
        "type": "start", "text": text, "instruction": instruction, "max_new_tokens": args.frames,
        "chunk_frames": args.chunk_frames, "audio_repetition_penalty": PENALTY,
    }
    if args.replicas > 0 and args.baseline > 0:
        serve_and_drive(args, model, codec, start, result, [args.baseline], replicas=0, prefix="baseline_")
    if args.codec_overlap == "both":
        serve_and_drive(args, model, codec, start, result, args.concurrency, replicas=args.replicas,
                        prefix="overlap_off_", codec_overlap=False)
    serve_and_drive(args, model, codec, start, result, args.concurrency, replicas=args.replicas,
                    codec_overlap=args.codec_overlap != "off")
    if args.replicas > 0 and args.baseline > 0:
        base = result.get(f"baseline_c{args.baseline}", {}).get("aggregate_rtf")
        top = result.get(f"c{max(args.concurrency)}", {}).get("aggregate_rtf")
        if base and top:
            result["scale_vs_baseline"] = top / base
    save(result, args.out)
    if not args.no_profile and time.perf_counter() - t_all < args.deadline_sec * 0.7:
        try:
            result["eager_profile"] = eager_profile(model, codec, [1, 32], args.prompt_rows, args.tiny)
        except Exception:
            result["eager_profile"] = {"error": traceback.format_exc(limit=3)}
        save(result, args.out)
    if args.upstream is not None and time.perf_counter() - t_all < args.deadline_sec * 0.8:
        result["upstream"] = upstream_per_frame(args, model)
    manifest = args.work / "data" / "kernel-manifest.json"
    if args.out is not None and manifest.is_file():
        # The kernels this GPU's starts compiled (engine/kernel_manifest.py): the file to ship for it.
        kept = args.out.with_name(args.out.stem + ".kernel-manifest.json")
        shutil.copyfile(manifest, kept)
        result["kernel_manifest"] = str(kept)
    result["total_sec"] = time.perf_counter() - t_all
    save(result, args.out)
    print(json.dumps(result, indent=1))


def serve_and_drive(
    args: argparse.Namespace,
    model: Path,
    codec: Path,
    start: dict[str, Any],
    result: dict[str, Any],
    concurrency: list[int],
    *,
    replicas: int,
    prefix: str = "",
    codec_overlap: bool = True,
) -> None:
    """Start a server (single process, or ``--front-ends`` front ends of ``replicas`` replicas on a Ray cluster
    this process owns) and run the rounds."""
    n_front = max(1, getattr(args, "front_ends", 1)) if replicas > 0 else 1
    ports = [free_port() for _ in range(n_front)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    procs: list[subprocess.Popen] = []
    local: LocalRay | None = None
    try:
        if replicas > 0:
            local = LocalRay(num_cpus=os.cpu_count() or 2)
        for i, port in enumerate(ports):
            log_path = args.server_log or (args.work / f"{prefix}server.log")
            if i:
                log_path = log_path.with_name(f"{log_path.stem}.fe{i}{log_path.suffix}")
            procs.append(start_server(args, model, codec, port, log_path, concurrency=concurrency, replicas=replicas,
                                      codec_overlap=codec_overlap, cluster=local.address if local else "auto"))
            if i == 0:  # the first front end creates the replicas; the others find them
                result[f"{prefix}server_ready_sec"] = asyncio.run(wait_ready(urls[0], procs[0], 900, replicas))
                if replicas == 0:
                    phases = asyncio.run(startup_phases(urls[0]))
                    result[f"{prefix}startup"] = phases
                    log.info("%sready in %.1f s after the server was started; its start, phase by phase:\n%s",
                             prefix, result[f"{prefix}server_ready_sec"],
                             "\n".join(f"  {v:7.2f} s  {k}" for k, v in phases.items()))
        for url, proc in zip(urls[1:], procs[1:], strict=True):
            asyncio.run(wait_ready(url, proc, 300, replicas))
        if not args.cold:
            result[f"{prefix}graphs_settled_sec"] = asyncio.run(wait_graphs(urls[0], procs[0], 300))
        for c in concurrency:
            try:
                repeats = args.single_repeats if c == 1 else args.repeats
                frames = args.frames if c > 1 else max(50, args.frames * 2 // 3)
                settle = 1.5 if replicas > 0 else 0.0
                r = asyncio.run(run_round(urls, c, repeats, {**start, "max_new_tokens": frames}, settle,
                                          line_for=line_for(args, model),
                                          pids=[p.pid for p in procs] if replicas > 0 else None))
                result[f"{prefix}c{c}"] = r
                save(result, args.out)
                log.info("%sconcurrency %d: %s", prefix, c, json.dumps(r))
            except Exception:
                result[f"{prefix}c{c}"] = {"error": traceback.format_exc(limit=3)}
    except Exception:
        result[f"{prefix}server_error"] = traceback.format_exc(limit=3)
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        if local is not None:
            local.stop()
    save(result, args.out)


def line_for(args: argparse.Namespace, model: Path) -> Any:
    """With ``--prompts lines``: seed -> that take's own line (prompt rows exactly --prompt-rows); else None."""
    if getattr(args, "prompts", "same") != "lines":
        return None
    cache: dict[int, str] = {}

    def text(seed: int) -> str:
        if seed not in cache:
            cache[seed] = text_for_rows(model, args.prompt_rows, line=seed)[0]
        return cache[seed]

    return text


def save(result: dict[str, Any], path: Path | None) -> None:
    """Write what we have so far (a run cut off by its time limit still leaves its numbers)."""
    if path is not None:
        path.write_text(json.dumps(result, indent=1))


def upstream_per_frame(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """The upstream reference's per-frame time on the same weights, through the model bench's harness."""
    import importlib.util

    import torch

    try:
        spec = importlib.util.spec_from_file_location("model_bench", ROOT / "bench" / "model_bench.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        ns = argparse.Namespace(upstream=args.upstream, upstream_frames=20, upstream_batch=0,
                                prompt_rows=args.prompt_rows)
        device = torch.device("cpu" if args.tiny else "cuda")
        return module.bench_upstream(ns, model_dir, device, torch.float32 if args.tiny else torch.bfloat16)
    except Exception:
        return {"error": traceback.format_exc(limit=4)}


if __name__ == "__main__":
    main()
