"""Memory proof (issue 11): the server on smaller (emulated) cards starts, prints its plan and streams takes.

On a CUDA machine:
    python bench/memory_proof.py --work /tmp/mp --out memory.json --runs 24:8:750,80:64:750,0:192:750
For each ``LIMIT_GIB:TAKES:FRAMES`` run it starts ``python -m moss_rt serve`` on full-size random weights
(written like bench/engine_bench.py does) with ``--gpu-memory-limit-gib LIMIT`` (0: the whole device;
torch's per-process memory fraction, so the plan budgets LIMIT), no --max-slots / --max-seq-len (the
plan decides), measures start-to-ready, reads the plan from /api/info, then streams TAKES concurrent
takes of FRAMES frames (750 = 60 s) over /api/ws and checks every one ends with all its frames. GPU
memory is sampled with nvidia-smi during the run. ``--tiny`` runs it on the tiny model (CPU smoke test).
Results are written to --out after every run (a partial file survives a later failure).

``--serve-args`` adds options to every run's serve command, e.g. the 256-stream proof on the whole H200 (issue 24):
    python bench/memory_proof.py --runs 0:256:750 --serve-args "--codec-state-dtype fp8 --max-slots 256"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import engine_bench as eb  # noqa: E402

log = logging.getLogger("memory_proof")


def gpu_used_mib() -> float | None:
    try:
        # The card this process's server runs on (the first one CUDA_VISIBLE_DEVICES names), not card 0.
        card = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        out = subprocess.run(["nvidia-smi", "-i", card, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout
        return float(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


class Sampler:
    """Peak GPU memory (nvidia-smi) while a run streams."""

    def __init__(self) -> None:
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            used = gpu_used_mib()
            if used is not None:
                self.peak = used if self.peak is None else max(self.peak, used)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def start(args: argparse.Namespace, model: Path, codec: Path, port: int, limit: float, queue: int,
          log_path: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(
        MOSS_RT_MAX_TAKES_PER_CLIENT="0",  # every client shares 127.0.0.1: no per-client take cap,
        MOSS_RT_HTTP_REQUESTS_PER_SEC="0",  # no per-client request rate (WebSocket upgrades count)
        MOSS_RT_MAX_CONNECTIONS_PER_CLIENT="0",
        MOSS_RT_GPU_MEMORY_LIMIT_GIB=str(limit),
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    cmd = [
        sys.executable, "-m", "moss_rt", "serve", "--port", str(port), "--model", str(model), "--codec", str(codec),
        "--device", "cpu" if args.tiny else "cuda", "--max-queue", str(queue), "--max-lead-sec", "0",
        "--data-dir", str(args.work / "data"), "--log-level", "INFO",
    ]
    if args.tiny:
        cmd += ["--max-slots", "4", "--max-seq-len", "1024"]
    cmd += shlex.split(args.serve_args)  # e.g. "--codec-state-dtype fp8 --max-slots 256" for the 256-stream proof
    fh = open(log_path, "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)


async def drive(url: str, takes: int, start_msg: dict[str, Any]) -> dict[str, Any]:
    ws_url = url.replace("http", "ws") + "/api/ws"
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    peak_active = 0
    # limit=0: aiohttp's default connector holds at most 100 connections, which would cap the takes.
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        go = asyncio.Event()
        tasks = [asyncio.create_task(eb.one_take(http, ws_url, {**start_msg, "seed": i}, go)) for i in range(takes)]
        await asyncio.sleep(0.5)
        go.set()
        t0 = time.perf_counter()
        pending = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=1.0)
            try:
                m = await eb.scrape(http, url)
                peak_active = max(peak_active, int(m.get("moss_rt_active_slots", 0)))
            except aiohttp.ClientError:
                pass
        wall = time.perf_counter() - t0
        results, errors = [], []
        for t in tasks:
            try:
                results.append(t.result())
            except Exception as exc:  # noqa: BLE001 - reported
                errors.append(str(exc)[:300])
        metrics = await eb.scrape(http, url)
    frames_ok = sum(1 for r in results if r["frames"] == start_msg["max_new_tokens"])
    return {
        "takes": takes,
        "completed_all_frames": frames_ok,
        "errors": errors[:5],
        "n_errors": len(errors),
        "peak_active_slots": peak_active,
        "wall_sec": round(wall, 1),
        "audio_sec_total": round(sum(r["audio_sec"] for r in results), 1),
        "per_stream_rtf_min": round(min((r["rtf"] for r in results), default=0.0), 2),
        "kv_blocks_free_after": metrics.get("moss_rt_kv_blocks_free"),
        "kv_blocks_total": metrics.get("moss_rt_kv_blocks_total"),
    }


def one_run(args: argparse.Namespace, model: Path, codec: Path, limit: float, takes: int, frames: int,
            text: str, instruction: str) -> dict[str, Any]:
    port = eb.free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = args.work / f"server-{limit:g}-{takes}.log"
    proc = start(args, model, codec, port, limit, takes, log_path)
    out: dict[str, Any] = {"limit_gib": limit, "takes": takes, "frames": frames}
    try:
        t0 = time.perf_counter()
        try:
            out["start_to_ready_sec"] = round(asyncio.run(eb.wait_ready(url, proc, 400.0)), 1)
        except Exception as exc:  # noqa: BLE001 - reported with the log tail
            out["start_error"] = str(exc)
            out["exit_code"] = proc.poll()
            out["log_tail"] = log_path.read_text()[-3000:]
            return out
        out["process_start_sec"] = round(time.perf_counter() - t0, 1)
        info = asyncio.run(_get_json(url + "/api/info"))
        out["plan"] = info.get("memory_plan")
        out["details"] = {k: v for k, v in info.get("details", {}).items() if k != "banner"}
        out["gpu_used_mib_ready"] = gpu_used_mib()
        start_msg = {"type": "start", "text": text, "instruction": instruction, "max_new_tokens": frames,
                     "chunk_frames": 8, "audio_repetition_penalty": 1.1, "text_temperature": 0.0}
        with Sampler() as sampler:
            out["stream"] = asyncio.run(drive(url, takes, start_msg))
        out["gpu_used_mib_peak"] = sampler.peak
        text_log = log_path.read_text()
        out["plan_table"] = _plan_table(text_log)
        out["log_lines"] = [ln[-220:] for ln in text_log.splitlines()
                            if "warm-up done" in ln or "peak memory" in ln or "out of memory" in ln.lower()
                            or "Traceback" in ln or "loaded in" in ln][:12]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return out


def _plan_table(text: str) -> list[str]:
    lines = text.splitlines()
    for i, ln in enumerate(lines):
        if ln.endswith("memory plan:"):
            return [x.rstrip() for x in lines[i + 1 : i + 16] if x.startswith("  ")]
    return []


async def _get_json(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return await resp.json()


def stream_bytes(codec_dir: Path, tiny: bool) -> dict[str, Any]:
    """Codec state per stream: the most it holds (what the planner reserves) and what it holds by age."""
    import torch

    from moss_rt.codec import load_codec
    from moss_rt.codec.streaming import stream_state_bytes

    dtype = torch.float32 if tiny else torch.bfloat16
    codec = load_codec(str(codec_dir), device="cpu", compute_dtype=dtype, decode_only=True)
    out: dict[str, Any] = {f"chunk_headroom_{n}": stream_state_bytes(codec, n, dtype) for n in (25, 8)}
    # what a stream holds by its age (paged state), 8-frame chunks
    rate = codec.config.frame_rate
    out.update({f"after_{s}s": stream_state_bytes(codec, 8, dtype, frames=round(s * rate)) for s in (2, 10, 60)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/memory_proof"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--runs", default="24:8:750,80:64:750,0:192:750")
    ap.add_argument("--prompt-rows", type=int, default=300)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--serve-args", default="", help="more `moss_rt serve` options, one string (shell quoting)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"runs": []}
    t0 = time.perf_counter()
    model, codec = eb.write_checkpoints(args.work, args.tiny)
    result["write_checkpoints_sec"] = round(time.perf_counter() - t0, 1)
    text, instruction = eb.text_for_rows(model, args.prompt_rows)
    for spec in args.runs.split(","):
        limit, takes, frames = spec.split(":")
        log.info("run %s", spec)
        result["runs"].append(one_run(args, model, codec, float(limit), int(takes), int(frames), text, instruction))
        save(result, args.out)
    try:
        result["codec_stream_bytes"] = stream_bytes(codec, args.tiny)
    except Exception as exc:  # noqa: BLE001 - reported
        result["codec_stream_bytes"] = str(exc)
    save(result, args.out)
    print(json.dumps(result, indent=1))


def save(result: dict[str, Any], path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
