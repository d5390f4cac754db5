"""Directing benchmark (issue 22): N directors at once over WebSocket, each directing a line of its own.

On a CUDA machine (one command; rounds not started within ``--deadline-sec``, 360 s, are skipped, and a round lasts
at most ``--round-timeout``, 60 s):
    python bench/directing_bench.py --out directing.json
writes full-size random-weight checkpoints in the real layout (as bench/engine_bench.py does, into ``--work``),
starts ``python -m moss_rt serve`` on them (the server's defaults: slots from the memory plan, codec overlapped,
prompt cache on) and drives it with aiohttp WebSocket clients (``/api/ws``, wire protocol v1). Every director:

1. starts a take of its own ~400-row line (200 frames, chunks of 8, repetition penalty 1.1);
2. after 40 frames of its audio, retakes from frame 20: a new instruction and a new seed (``instruction`` rounds)
   or a new seed only (``seed`` rounds);
3. after 20 frames of the retake's audio, cancels it;
4. replays the retake from frame 0 (``mode: replay``) and waits for the replay's end;
5. starts a new line on the same socket, and cancels it after 20 frames of audio (only its first audio counts).

Rounds: every concurrency of ``--concurrency`` (default 1,16,64,128) x start mode (``burst``: every director
starts together; ``spread``: starts spread evenly over ``--spread-sec``, 3 s; concurrency 1 runs ``--single-repeats``
directors one after another instead) x retake mode (``instruction``, ``seed``), each ``--round-repeats`` times in a
row (default 1; the table pools a row's repeats: a steadier p95 than one round's 64 samples). Reported per round, p50
/ p95 (ms, client side): first audio; retake seek -> first audio; cancel -> ``end``; new line after a cancel (start ->
first audio); the running streams' slowest real-time factor while any retake was being prepared (each stream's audio
over its time inside those windows; and the slowest single chunk); step intervals over 80 ms (server metrics); how
the retakes' codec states began (shared / rebuilt) and the rebuild calls; each retake's first-audio path (queue,
prefill, first frame, codec queue, decode), in the order the retakes' first audio came (``retake_paths_ms``); and
any PCM that arrived after its take's ``end`` or before the next take's ``start`` (must be 0). The table of the issue
is printed at the end.

Each director retakes as soon as it has heard its retake point, so a round's retakes come as close together as its
first takes' audio did: an engine whose first audio comes sooner and closer together meets a tighter burst of
retakes, and its retake figures look worse for it (each round reports how far apart its seeks went out:
``retake_seeks``, the table's last column). ``--retake-at S`` sends every director's seek at one shared instant, S
seconds after the round's start (each keeps reading its audio until then), so trees are compared under the same
burst; S must come after every director's retake point and before its first take ends (a director whose take
ended first fails the round; 1.8 s suits 64 directors on an H200 for both a fresh and a cached round).

``--client-procs N`` spreads a round's directors over N client processes (default 1: one event loop reads and
writes every socket, and at 64 directors its own backlog shows in the figures; separate people's browsers do not
share one). Rows are comparable only at the same setting: the JSON says which (``client_procs``).

``--tiny`` runs it all on the tiny model on the CPU (a smoke test of this script: its numbers mean nothing; its
codec windows are 0.16 s, so retakes from 20 frames back are rebuilt, not shared).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import itertools
import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import engine_bench as eb  # noqa: E402  (bench/ is not a package: its helpers by path)

from moss_rt.engine.round_trace import read_trace  # noqa: E402

log = logging.getLogger("directing_bench")

PENALTY = 1.1
FRAME_BYTES = 3840 * 2  # one 80 ms frame of mono int16
FIRST_INSTRUCTION = "Tired, slow, a little hoarse; pauses between the sentences."
RETAKE_INSTRUCTION = "Bright and quick, smiling, as if sharing good news with a friend."
# The engine's account of a take's first audio (its end's timings, moss_rt.engine.scheduler.first_audio_path).
PATH = eb.FIRST_AUDIO_PATH
ROUND_PHASES = ("control", "step", "flush", "admit", "prepare", "capture", "jobs")
ADMIT_PARTS = ("match", "room", "kv", "sampling", "codec", "apply")  # moss_rt_admit_part_seconds{part} (apply: a round)


@dataclass
class Workload:
    frames: int = 200  # frames per take
    retake_after: int = 40  # frames of audio heard before the retake
    retake_from: int = 20  # the retake's branch frame
    cancel_after: int = 20  # frames of the retake heard before the cancel
    new_line_frames: int = 20  # frames of the new line heard before it is cancelled
    chunk_frames: int = 8
    # None: each director retakes as soon as it has heard retake_after frames, so the retakes come as close together
    # as the first takes' audio did (a faster engine makes a tighter burst). A number: every director of the round
    # waits for this many seconds after the round's start instant (and for its retake_after frames, reading its
    # audio meanwhile) and then seeks, so every tree is measured under one burst (``--retake-at``).
    retake_at: float | None = None
    # The tiny model's stop head is sampled to stop about every 60 frames: --tiny draws it greedily (never stops).
    # The full-size random checkpoint never stops at the default sampling.
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Director:
    """What one director measured (seconds of ``time.perf_counter``)."""

    index: int
    first_audio: float | None = None
    retake_first_audio: float | None = None
    cancel_to_end: float | None = None
    new_line_first_audio: float | None = None
    retake_window: tuple[float, float] | None = None  # seek sent -> the retake's first PCM
    retake_late: bool = False  # --retake-at: it had not heard retake_after frames by the shared instant
    # (arrival time, frames, stream name) of every PCM frame group
    pcm: list[tuple[float, int, str]] = field(default_factory=list)
    stopped: dict[str, float] = field(default_factory=dict)  # stream name -> when the director stopped it
    retake_path: dict[str, float] = field(default_factory=dict)  # the retake's end: where its first audio went (ms)
    stray_pcm: int = 0  # PCM frames outside a take (after its end, before the next start)
    ends: list[str] = field(default_factory=list)  # end reasons in order
    error: str | None = None


class Socket:
    """One director's WebSocket: frames in order, PCM attributed to the take whose ``start`` came last."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, rec: Director) -> None:
        self.ws = ws
        self.rec = rec
        self.current: str | None = None  # the take between its start and its end
        self.stream = ""

    async def send(self, obj: dict[str, Any]) -> None:
        await self.ws.send_str(json.dumps(obj))

    async def next(self) -> tuple[str, Any]:
        msg = await self.ws.receive()
        if msg.type != aiohttp.WSMsgType.BINARY:
            raise RuntimeError(f"socket closed or unexpected message: {msg.type}")
        data = msg.data
        if data[0] == 1:
            frames = (len(data) - 5) // FRAME_BYTES
            if self.current is None:
                self.rec.stray_pcm += frames
            self.rec.pcm.append((time.perf_counter(), frames, self.stream))
            return "pcm", frames
        obj = json.loads(data[5:])
        kind = obj.get("type")
        if kind == "start":
            self.current = obj.get("take")
        elif kind == "end":
            self.current = None
            self.rec.ends.append(str(obj.get("reason")))
        elif kind == "error":
            raise RuntimeError(f"server error: {obj}")
        return kind, obj

    async def until(self, kind: str) -> dict[str, Any]:
        while True:
            got, obj = await self.next()
            if got == kind:
                return obj

    async def audio_until(self, deadline: float) -> bool:
        """Read (and keep) whatever comes until ``deadline`` (perf_counter): whether the take ended meanwhile. The
        socket is read all along, as a player does, so the server never sees a slow client."""
        while (left := deadline - time.perf_counter()) > 0:
            try:
                kind, _ = await asyncio.wait_for(self.next(), timeout=left)
            except TimeoutError:
                return False
            if kind == "end":
                return True
        return False

    async def audio(self, frames: int) -> tuple[float | None, bool]:
        """Read until ``frames`` frames of PCM came or the take ended: (first PCM time, whether it ended)."""
        first, got = None, 0
        while got < frames:
            kind, obj = await self.next()
            if kind == "pcm":
                first = first or time.perf_counter()
                got += obj
            elif kind == "end":
                return first, True
        return first, False


async def direct(http: aiohttp.ClientSession, ws_url: str, rec: Director, lines: tuple[str, str], seed: int,
                 work: Workload, mode: str, go: asyncio.Event, delay: float, go_at: float) -> Director:
    try:
        async with http.ws_connect(ws_url, max_msg_size=64 * 2**20) as ws:
            sock = Socket(ws, rec)
            await sock.until("hello")
            await go.wait()
            await asyncio.sleep(delay)
            base = {"max_new_tokens": work.frames, "chunk_frames": work.chunk_frames,
                    "audio_repetition_penalty": PENALTY, **work.extra}
            # 1. a take of its own line
            sock.stream = f"{rec.index}.take"
            t0 = time.perf_counter()
            await sock.send({"type": "start", "text": lines[0], "instruction": FIRST_INSTRUCTION, "seed": seed,
                             **base})
            start = await sock.until("start")
            take = start["take"]
            first, ended = await sock.audio(work.retake_after)
            if first is None or ended:
                raise RuntimeError("the first take ended before the retake point (a sampled stop)")
            rec.first_audio = first - t0
            if work.retake_at is not None:  # one shared instant for every director's seek
                rec.retake_late = time.perf_counter() > go_at + work.retake_at
                if await sock.audio_until(go_at + work.retake_at):
                    raise RuntimeError("the first take ended before the shared retake instant (--retake-at)")
            # 2. the retake from frame retake_from
            t_seek = time.perf_counter()
            rec.stopped[sock.stream] = t_seek
            seek: dict[str, Any] = {"type": "seek", "take": take, "frame": work.retake_from, "seed": seed + 7919}
            if mode == "instruction":
                seek["instruction"] = RETAKE_INSTRUCTION
            await sock.send(seek)
            ack = await sock.until("seek")
            retake = ack["take"]
            while True:  # the parent's end (replaced) came before the ack; the retake's start comes next
                kind, obj = await sock.next()
                if kind == "start" and obj.get("take") == retake:
                    break
            sock.stream = f"{rec.index}.retake"
            first, ended = await sock.audio(work.cancel_after)
            if first is None:
                raise RuntimeError("the retake ended before its audio")
            rec.retake_first_audio = first - t_seek
            rec.retake_window = (t_seek, first)
            # 3. cancel (unless a sampled stop ended it first)
            if not ended:
                t_cancel = time.perf_counter()
                rec.stopped[sock.stream] = t_cancel
                await sock.send({"type": "cancel"})
                end = await sock.until("end")
                rec.cancel_to_end = time.perf_counter() - t_cancel
                rec.retake_path = {k: float(end[k]) for k in PATH if isinstance(end.get(k), (int, float))}
                if end.get("reason") != "cancelled":
                    raise RuntimeError(f"the retake ended with {end.get('reason')} instead of cancelled")
            # 4. replay the retake from frame 0
            sock.stream = f"{rec.index}.replay"
            await sock.send({"type": "seek", "take": retake, "frame": 0, "mode": "replay"})
            await sock.until("end")
            # 5. a new line on the same socket
            sock.stream = f"{rec.index}.new"
            t_new = time.perf_counter()
            await sock.send({"type": "start", "text": lines[1], "instruction": FIRST_INSTRUCTION, "seed": seed + 31,
                             **base})
            await sock.until("start")
            first, ended = await sock.audio(work.new_line_frames)
            if first is None:
                raise RuntimeError("the new line ended before its audio")
            rec.new_line_first_audio = first - t_new
            if not ended:
                rec.stopped[sock.stream] = time.perf_counter()
                await sock.send({"type": "cancel"})
                await sock.until("end")
    except Exception as exc:  # one failing director is reported, the round goes on
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


def seek_spread(directors: list[Director]) -> dict[str, Any]:
    """When the round's seeks went out, in ms after the first one: p50 / p95 / last, and how many directors had not
    heard their retake point by a shared instant (``--retake-at``: those seek late, when they have)."""
    sent = sorted(d.retake_window[0] for d in directors if d.retake_window is not None)
    after = [t - sent[0] for t in sent]
    return {"p50": pct(after, 50), "p95": pct(after, 95), "last": round(after[-1] * 1000.0, 1) if after else None,
            "late": sum(d.retake_late for d in directors)}


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(np.array(values), q)) * 1000.0, 1) if values else None


def rtf_during(directors: list[Director], min_overlap_s: float = 0.25) -> dict[str, float | None]:
    """Running streams' real-time factor inside the retake windows (seek sent -> that retake's first PCM, any
    director): per stream, the audio it received inside the windows (its position interpolated between chunk
    arrivals) over the time the windows overlap its running span (first PCM to the last one before its director
    stopped it), for streams overlapping at least ``min_overlap_s``;
    and the slowest single chunk inside a window (its audio over the time since the stream's previous chunk).
    Replays are left out (not generated), and so is what a stream sends after its director stopped it."""
    windows = sorted(d.retake_window for d in directors if d.retake_window is not None)
    if not windows:
        return {"stream_rtf_min": None, "chunk_rtf_min": None, "streams": 0}
    merged: list[list[float]] = []
    for a, b in windows:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])

    def inside(t: float) -> bool:
        return any(a <= t <= b for a, b in merged)

    streams: dict[str, list[tuple[float, int]]] = {}
    for d in directors:
        for t, frames, name in d.pcm:
            if not name.endswith(".replay") and t <= d.stopped.get(name, float("inf")):
                streams.setdefault(name, []).append((t, frames))
    per_stream, per_chunk = [], []
    slowest: tuple[float, str, float, list[tuple[float, int]]] | None = None  # (rtf, stream, longest wait, arrivals)
    for name, arrivals in streams.items():
        arrivals.sort()
        times = np.array([t for t, _ in arrivals])
        heard = np.cumsum([f * 0.08 for _, f in arrivals])  # seconds of audio received by each arrival
        lo_all, hi_all = times[0], times[-1]
        gained = spent = 0.0
        for a, b in merged:  # audio position interpolated between arrivals: no chunk-size quantisation
            lo, hi = max(a, lo_all), min(b, hi_all)
            if hi > lo:
                gained += float(np.interp(hi, times, heard) - np.interp(lo, times, heard))
                spent += hi - lo
        gaps = [t - t_prev for (t_prev, _), (t, _) in zip(arrivals, arrivals[1:], strict=False) if inside(t)]
        if spent >= min_overlap_s:
            per_stream.append(gained / spent)
            if slowest is None or per_stream[-1] < slowest[0]:
                slowest = (per_stream[-1], name, max(gaps, default=0.0), arrivals)
        for (t_prev, _), (t, f) in zip(arrivals, arrivals[1:], strict=False):
            if inside(t) and t > t_prev:
                per_chunk.append(f * 0.08 / (t - t_prev))
    return {
        "stream_rtf_min": round(min(per_stream), 2) if per_stream else None,
        "chunk_rtf_min": round(min(per_chunk), 2) if per_chunk else None,
        "streams": len(per_stream),
        # Which stream was slowest and its longest wait for a chunk inside the windows: a stalled stream, or one that
        # only overlapped the windows between two chunks?
        "slowest_stream": slowest[1] if slowest else None,
        "slowest_stream_gap_ms": round(slowest[2] * 1000.0, 1) if slowest else None,
        # ...its chunks (ms from its first PCM, frames) and the windows it overlaps (ms, same origin), to tell a
        # stalled stream from one whose chunks all fell between the windows.
        "slowest_stream_chunks": [(round((t - slowest[3][0][0]) * 1000.0, 1), f) for t, f in slowest[3][:64]]
        if slowest else None,
        "slowest_stream_windows": [
            (round((a - slowest[3][0][0]) * 1000.0, 1), round((b - slowest[3][0][0]) * 1000.0, 1))
            for a, b in merged if b >= slowest[3][0][0] and a <= slowest[3][-1][0]
        ] if slowest else None,
    }


async def run_directors(http: aiohttp.ClientSession, ws_url: str, jobs: list[tuple[int, tuple[str, str], float]],
                        work: Workload, mode: str, go_at: float, limit_s: float) -> list[Director]:
    """Direct ``jobs`` (index, lines, start delay) from this process: every socket connects and waits for its hello,
    all start at ``go_at`` (perf_counter) plus their delay; a director not done within ``limit_s`` failed."""
    go = asyncio.Event()
    recs = [Director(i) for i, _, _ in jobs]
    tasks = [asyncio.create_task(direct(http, ws_url, rec, pair, 1000 * i + 1, work, mode, go, delay, go_at))
             for rec, (i, pair, delay) in zip(recs, jobs, strict=True)]
    await asyncio.sleep(max(0.0, go_at - time.perf_counter()))
    go.set()
    _, pending = await asyncio.wait(tasks, timeout=limit_s)
    for task, rec in zip(tasks, recs, strict=True):
        if task in pending:
            task.cancel()
            rec.error = rec.error or f"timed out after {limit_s:.0f} s"
    return recs


def directors_in_process(ws_url: str, jobs: list[tuple[int, tuple[str, str], float]], work: Workload, mode: str,
                         go_at: float, limit_s: float, sock_read: float | None) -> list[Director]:
    """A client process's share of a round (``--client-procs``): its own event loop and connections."""

    async def run() -> list[Director]:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=sock_read)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            return await run_directors(http, ws_url, jobs, work, mode, go_at, limit_s)

    return asyncio.run(run())


def trace_during(trace: Path, directors: list[Director]) -> dict[str, Any] | None:
    """The engine's rounds from the first seek to the last retake's first audio (``--round-trace``): how many, how
    long, their parts' time summed, what they did, and the five longest (t: ms after the first seek)."""
    windows = [d.retake_window for d in directors if d.retake_window is not None]
    if not windows or not trace.is_file():
        return None
    lo, hi = min(a for a, _ in windows), max(b for _, b in windows)
    rounds = [r for r in read_trace(trace) if lo <= r["t"] <= hi]
    if not rounds:
        return {"rounds": 0}
    parts: dict[str, float] = {}
    for r in rounds:
        for ph, (wall, _) in r["parts"].items():
            parts[ph] = parts.get(ph, 0.0) + wall
    longest = sorted(rounds, key=lambda r: -r["ms"])[:5]
    return {
        "rounds": len(rounds), "window_ms": round(1000.0 * (hi - lo), 1),
        "round_ms_p50": round(float(np.percentile([r["ms"] for r in rounds], 50)), 2),
        "round_ms_max": round(max(r["ms"] for r in rounds), 2),
        "parts_ms": {ph: round(v, 1) for ph, v in parts.items()},
        **{k: sum(r.get(k, 0) for r in rounds) for k in ("steps", "admitted", "passes", "rows", "held")},
        "gc_ms": round(sum(r.get("gc_ms", 0.0) for r in rounds), 2),
        "longest": [{"t": round(1000.0 * (r["t"] - lo), 1), **{k: r.get(k) for k in
                     ("ms", "parts", "batch", "admitted", "passes", "rows", "held", "parked", "gc_ms")}}
                    for r in longest],
    }


async def run_round(url: str, lines: list[tuple[str, str]], concurrency: int, starts: str, mode: str,
                    work: Workload, spread_sec: float, repeats: int, limit_s: float,
                    client_procs: int = 1, trace: Path | None = None) -> dict[str, Any]:
    ws_url = url.replace("http", "ws") + "/api/ws"
    client_timeout = aiohttp.ClientTimeout(total=None, sock_read=limit_s)
    async with aiohttp.ClientSession(timeout=client_timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        before = await eb.scrape(http, url)
        t0 = time.perf_counter()
        directors: list[Director] = []
        groups = [list(range(concurrency))] if concurrency > 1 else [[i] for i in range(repeats)]
        for group in groups:
            delays = [spread_sec * k / max(1, len(group)) if starts == "spread" else 0.0 for k in range(len(group))]
            jobs = [(i, lines[i % len(lines)], delay) for i, delay in zip(group, delays, strict=True)]
            procs = max(1, min(client_procs, len(jobs)))
            if procs == 1:
                go_at = time.perf_counter() + 0.3  # every socket connected and holding its hello
                directors.extend(await run_directors(http, ws_url, jobs, work, mode, go_at, limit_s))
                continue
            # Each process directs every procs-th director: one client process per few directors, as separate
            # people's browsers are (one process's event loop handling 64 sockets delays what it reads and sends).
            # They share the start instant: perf_counter is the system's monotonic clock on Linux.
            go_at = time.perf_counter() + 1.5  # every process started and every socket holding its hello
            with concurrent.futures.ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
                loop = asyncio.get_running_loop()
                parts = await asyncio.gather(*(
                    loop.run_in_executor(pool, directors_in_process, ws_url, jobs[k::procs], work, mode, go_at,
                                         limit_s, client_timeout.sock_read)
                    for k in range(procs)))
            directors.extend(rec for part in parts for rec in part)
        wall = time.perf_counter() - t0
        await asyncio.sleep(0.5)  # the last ends and gauges settle
        after = await eb.scrape(http, url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    ok = [d for d in directors if d.error is None]

    def stat(values: list[float | None]) -> dict[str, Any]:
        v = [x for x in values if x is not None]
        return {"p50": pct(v, 50), "p95": pct(v, 95), "n": len(v), "ms": [round(x * 1000.0, 1) for x in v]}

    intervals = delta("moss_rt_step_interval_seconds_count")
    return {
        "directors": concurrency if concurrency > 1 else repeats,
        "concurrency": concurrency,
        "starts": starts,
        "retake": mode,
        "client_procs": max(1, min(client_procs, concurrency)),
        "wall_sec": round(wall, 2),
        "errors": sorted({d.error for d in directors if d.error is not None})[:5],
        "failed_directors": len(directors) - len(ok),
        "first_audio_ms": stat([d.first_audio for d in directors]),
        "retake_ms": stat([d.retake_first_audio for d in directors]),
        "cancel_to_end_ms": stat([d.cancel_to_end for d in directors]),
        "new_line_ms": stat([d.new_line_first_audio for d in directors]),
        "rtf_during_retakes": rtf_during(directors),
        # How close together the retakes' seeks went out: the burst the retake figures were measured under.
        "retake_seeks": seek_spread(directors),
        # The engine's own rounds meanwhile (--round-trace): where the retakes' wait went, round by round.
        **({"rounds_during_retakes": trace_during(trace, directors)} if trace is not None else {}),
        # Where the retakes' first audio went, engine side (p50 / p95 ms of each part).
        "retake_path_ms": {k: [pct([d.retake_path[k] / 1000.0 for d in ok if k in d.retake_path], q) for q in (50, 95)]
                           for k in PATH},
        # ...and each retake's own, in the order its first audio came (a burst goes in groups, a prefill pass each:
        # which part grows from one group to the next).
        "retake_paths_ms": [
            {"retake_ms": round(first * 1000.0, 1),
             **{k: round(d.retake_path[k], 1) for k in PATH if k in d.retake_path}}
            for first, d in sorted(((d.retake_first_audio, d) for d in ok if d.retake_first_audio is not None),
                                   key=lambda pair: pair[0])
        ],
        "stray_pcm_frames": sum(d.stray_pcm for d in directors),
        "server": {
            "step_intervals": intervals,
            "step_intervals_over_80ms": delta('moss_rt_step_interval_seconds_bucket{le="+Inf"}')
            - delta('moss_rt_step_interval_seconds_bucket{le="0.08"}'),
            "step_intervals_over_120ms": delta('moss_rt_step_interval_seconds_bucket{le="+Inf"}')
            - delta('moss_rt_step_interval_seconds_bucket{le="0.12"}'),
            "step_interval_ms_mean": round(1000.0 * delta("moss_rt_step_interval_seconds_sum")
                                           / max(1.0, intervals), 2),
            "model_step_ms_mean": round(1000.0 * delta("moss_rt_step_seconds_sum")
                                        / max(1.0, delta("moss_rt_step_seconds_count")), 2),
            "codec_states": {s: delta(f'moss_rt_codec_states_total{{source="{s}"}}')
                             for s in ("fresh", "shared", "rebuilt")},
            "codec_rebuild_calls": delta("moss_rt_codec_rebuild_calls_total"),
            "codec_rebuild_frames": delta("moss_rt_codec_rebuild_frames_total"),
            "seeks": {p: delta(f'moss_rt_seeks_total{{path="{p}"}}') for p in ("share", "reprefill")},
            "prompt_rows_prefilled": delta('moss_rt_prompt_rows_total{source="prefill"}'),
            "prompt_rows_cached": delta('moss_rt_prompt_rows_total{source="cache"}'),
            "prefill_passes": delta("moss_rt_prefill_batch_size_count"),
            "codec_wait_ms_per_step": round(1000.0 * delta("moss_rt_codec_wait_seconds_sum")
                                            / max(1.0, delta("moss_rt_step_seconds_count")), 2),
            # The codec worker's lanes: calls started in each, and a decode's mean time (all lanes).
            "codec_calls": {lane: delta(f'moss_rt_codec_calls_total{{lane="{lane}"}}')
                            for lane in ("priority", "bulk")},
            # ...and how long a call waited in each lane from its hand-over to its start (mean, and calls over 80 ms).
            "codec_queued_ms_mean": {
                lane: round(1000.0 * delta(f'moss_rt_codec_queued_seconds_sum{{lane="{lane}"}}')
                            / max(1.0, delta(f'moss_rt_codec_queued_seconds_count{{lane="{lane}"}}')), 2)
                for lane in ("priority", "bulk")},
            "codec_queued_over_80ms": {
                lane: delta(f'moss_rt_codec_queued_seconds_count{{lane="{lane}"}}')
                - delta(f'moss_rt_codec_queued_seconds_bucket{{lane="{lane}",le="0.08"}}')
                for lane in ("priority", "bulk")},
            # The garbage collector's runs while the round ran (any thread): full collections and their total time.
            "gc_full_collections": delta('moss_rt_gc_pause_seconds_count{generation="2"}'),
            "gc_ms_total": round(1000.0 * sum(delta(f'moss_rt_gc_pause_seconds_sum{{generation="{g}"}}')
                                               for g in ("0", "1", "2")), 1),
            "codec_call_ms_mean": round(1000.0 * delta("moss_rt_codec_seconds_sum")
                                        / max(1.0, delta("moss_rt_codec_seconds_count")), 2),
            "cancel_dropped_frames": delta("moss_rt_cancel_dropped_frames_total"),
            # The engine thread's rounds: how many, how many long, and the seconds of each part.
            "rounds": delta("moss_rt_round_seconds_count"),
            "rounds_over_60ms": delta("moss_rt_round_seconds_count") - delta('moss_rt_round_seconds_bucket{le="0.06"}'),
            "rounds_over_120ms": delta("moss_rt_round_seconds_count")
            - delta('moss_rt_round_seconds_bucket{le="0.12"}'),
            "round_phase_sec": {ph: round(delta(f'moss_rt_round_phase_seconds_sum{{phase="{ph}"}}'), 3)
                                for ph in ROUND_PHASES},
            # The same parts' engine-thread CPU time: far below their wall time, the thread waited (the interpreter
            # lock, a blocking call), not worked.
            "round_phase_cpu_sec": {ph: round(delta(f'moss_rt_round_phase_cpu_seconds_total{{phase="{ph}"}}'), 3)
                                    for ph in ROUND_PHASES},
            "round_phase_over_40ms": {ph: delta(f'moss_rt_round_phase_seconds_count{{phase="{ph}"}}')
                                      - delta(f'moss_rt_round_phase_seconds_bucket{{le="0.04",phase="{ph}"}}')
                                      for ph in ROUND_PHASES},
            # Admissions by part (engine-thread seconds in all), how many, and steps held back for codec room.
            "admit_part_ms": {part: round(1000.0 * delta(f'moss_rt_admit_part_seconds_sum{{part="{part}"}}'), 2)
                              for part in ADMIT_PARTS},
            "admit_part_cpu_ms": {part: round(1000.0 * delta(f'moss_rt_admit_part_cpu_seconds_total{{part="{part}"}}'),
                                              2) for part in ADMIT_PARTS},
            "admissions": delta('moss_rt_admit_part_seconds_count{part="match"}'),
            "steps_held": delta("moss_rt_steps_held_total"),
        },
    }


def start_server(args: argparse.Namespace, model: Path, codec: Path, port: int, log_path: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(
        MOSS_RT_MAX_SEQ_LEN=str(args.max_seq_len),
        MOSS_RT_MAX_TAKES_PER_CLIENT="0",  # every bench client shares 127.0.0.1
        MOSS_RT_HTTP_REQUESTS_PER_SEC="0",  # ...so does the per-client request rate (WebSocket upgrades)
        MOSS_RT_MAX_CONNECTIONS_PER_CLIENT="0",  # ...and the cap on its requests in progress
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    top = max(args.concurrency)
    cmd = [
        sys.executable, "-m", "moss_rt", "serve", "--port", str(port), "--model", str(model), "--codec", str(codec),
        "--device", "cpu" if args.tiny else "cuda", "--max-queue", str(max(64, top)), "--max-lead-sec", "0",
        "--max-connections", str(max(256, 2 * top)), "--data-dir", str(args.work / "data"), "--log-level", "INFO",
    ]
    if args.max_slots or args.tiny:  # 0 on a GPU: the memory plan's (the server's default)
        cmd += ["--max-slots", str(args.max_slots or top)]
    if getattr(args, "round_trace", False):
        cmd += ["--round-trace", str(args.work / "rounds.jsonl")]
    cmd += getattr(args, "server_arg", None) or []  # A/B runs of a server setting
    fh = open(log_path, "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)


def table(result: dict[str, Any]) -> str:
    """The issue's table: one row per concurrency and start mode (p50 / p95 ms)."""
    rows = ["| directors | starts | first audio | retake: seek → first audio | retake, new seed only | cancel → `end` "
            "| new line after a cancel | slowest stream / chunk during retakes | step intervals > 80 ms | codec states "
            "shared / rebuilt | seeks: last after first |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(stats: list[dict[str, Any] | None]) -> str:
        """p50 / p95 of the samples of every given round together."""
        values = [x for st in stats if st for x in st.get("ms", [])]
        if not values:
            return "–"
        p50, p95 = np.percentile(values, 50), np.percentile(values, 95)
        return f"{p50:,.0f}" if len(values) == 1 else f"{p50:,.0f} / {p95:,.0f}"

    def who(conc: int, directors: int) -> str:
        """The row's directors: at concurrency 1, that many one after another (``--single-repeats``)."""
        return str(conc) if directors == conc else f"{conc} ({directors} one after another)"

    keys = sorted({(r["concurrency"], r["starts"]) for r in result["rounds"] if "concurrency" in r})
    for conc, starts in keys:
        rs = [r for r in result["rounds"] if r.get("concurrency") == conc and r.get("starts") == starts]
        instr = [r for r in rs if r["retake"] == "instruction"]  # --round-repeats: pooled
        seed = [r for r in rs if r["retake"] == "seed"]
        both = instr + seed
        rtfs = [r["rtf_during_retakes"] for r in rs]
        stream = min((x["stream_rtf_min"] for x in rtfs if x["stream_rtf_min"] is not None), default=None)
        chunk = min((x["chunk_rtf_min"] for x in rtfs if x["chunk_rtf_min"] is not None), default=None)
        over = sum(r["server"]["step_intervals_over_80ms"] for r in rs)
        total = sum(r["server"]["step_intervals"] for r in rs)
        shared = sum(r["server"]["codec_states"]["shared"] for r in rs)
        rebuilt = sum(r["server"]["codec_states"]["rebuilt"] for r in rs)
        spreads = [r["retake_seeks"]["last"] for r in rs if (r.get("retake_seeks") or {}).get("last") is not None]
        rows.append(
            f"| {who(conc, rs[0]['directors'])} | {starts} | {cell([r.get('first_audio_ms') for r in both])} "
            f"| {cell([r.get('retake_ms') for r in instr])} | {cell([r.get('retake_ms') for r in seed])} "
            f"| {cell([r.get('cancel_to_end_ms') for r in both])} | {cell([r.get('new_line_ms') for r in both])} "
            f"| {stream if stream is not None else '–'}× / {chunk if chunk is not None else '–'}× "
            f"| {over:.0f} of {total:.0f} | {shared:.0f} / {rebuilt:.0f} "
            f"| {f'{max(spreads):,.0f} ms' if spreads else '–'} |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--work", type=Path, default=Path("/tmp/moss-engine-bench"),
                   help="checkpoints (shared with engine_bench.py: written once) and the server's data dir")
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test)")
    p.add_argument("--concurrency", default=None, help="directors at once (default 1,16,64,128; --tiny: 1,4)")
    p.add_argument("--starts", default="burst,spread", help="burst, spread or both")
    p.add_argument("--retakes", default="instruction,seed", help="instruction (new instruction and seed), seed")
    p.add_argument("--spread-sec", type=float, default=3.0)
    p.add_argument("--retake-at", type=float, default=None,
                   help="every director seeks this many seconds after the round's start instant (once it has heard "
                        "its retake point): one burst of retakes whatever the first takes' timing (default: each "
                        "seeks when it has heard its retake point)")
    p.add_argument("--single-repeats", type=int, default=5, help="directors one after another at concurrency 1")
    p.add_argument("--round-repeats", type=int, default=1,
                   help="each round this many times in a row (the table pools their samples: a steadier p95)")
    p.add_argument("--prompt-rows", type=int, default=400)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--max-slots", type=int, default=0, help="0: the memory plan's (the server's default)")
    p.add_argument("--frames", type=int, default=200)
    p.add_argument("--round-timeout", type=float, default=60.0, help="a director not done by then counts as failed")
    p.add_argument("--deadline-sec", type=float, default=360.0, help="rounds not started by then are skipped")
    p.add_argument("--no-wait-graphs", action="store_true", help="start before the idle-time graph captures end")
    p.add_argument("--client-procs", type=int, default=1,
                   help="client processes sharing a round's directors (1: one event loop drives every socket)")
    p.add_argument("--server-log", type=Path, default=None)
    p.add_argument("--round-trace", action="store_true",
                   help="the server traces its rounds (--round-trace); each round reports those during the retakes, "
                        "and the trace is kept beside --out")
    p.add_argument("--server-arg", action="append", default=[],
                   help="one more argument for the server, repeatable (--server-arg=--batch-yield-share=0.75)")
    args = p.parse_args()
    args.concurrency = [int(c) for c in (args.concurrency or ("1,4" if args.tiny else "1,16,64,128")).split(",")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.work.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "rounds": []}
    work = Workload(frames=args.frames, retake_at=args.retake_at,
                    extra={"text_temperature": 0.0} if args.tiny else {})
    model, codec = eb.write_checkpoints(args.work, args.tiny)
    result["checkpoints_sec"] = round(time.perf_counter() - t_all, 1)
    top = max(args.concurrency) if max(args.concurrency) > 1 else args.single_repeats
    t_lines = time.perf_counter()
    lines = [(eb.text_for_rows(model, args.prompt_rows, line=i)[0],
              eb.text_for_rows(model, args.prompt_rows, line=10_000 + i)[0])
             for i in range(max(top, args.single_repeats))]
    result["lines_sec"] = round(time.perf_counter() - t_lines, 1)
    port = eb.free_port()
    url = f"http://127.0.0.1:{port}"
    (args.work / "rounds.jsonl").unlink(missing_ok=True)  # this run's rounds only
    proc = start_server(args, model, codec, port, args.server_log or (args.work / "directing_server.log"))
    try:
        result["server_ready_sec"] = round(asyncio.run(eb.wait_ready(url, proc, 300)), 1)
        if not args.no_wait_graphs:
            try:  # the steady state; past the limit the rounds run anyway (and say so)
                result["graphs_settled_sec"] = round(asyncio.run(eb.wait_graphs(url, proc, 180)), 1)
            except TimeoutError:
                result["graphs_settled_sec"] = "not within 180 s: rounds ran with graphs still pending"
        plan = asyncio.run(_info(url))
        result["server"] = {k: plan.get(k) for k in ("max_slots", "max_seq_len", "cuda_graphs", "codec_overlap")}
        for conc in args.concurrency:
            for starts in (["burst"] if conc == 1 else args.starts.split(",")):
                for mode, repeat in itertools.product(args.retakes.split(","), range(args.round_repeats)):
                    if time.perf_counter() - t_all > args.deadline_sec:
                        result["rounds"].append({"skipped": f"c{conc} {starts} {mode}: past --deadline-sec"})
                        continue
                    try:
                        r = asyncio.run(run_round(url, lines, conc, starts, mode, work, args.spread_sec,
                                                  args.single_repeats, args.round_timeout, args.client_procs,
                                                  trace=args.work / "rounds.jsonl" if args.round_trace else None))
                    except Exception:
                        r = {"concurrency": conc, "starts": starts, "retake": mode,
                             "error": traceback.format_exc(limit=3)}
                    r["repeat"] = repeat
                    result["rounds"].append(r)
                    log.info("c%d %s %s #%d: %s", conc, starts, mode, repeat, json.dumps(r))
                    eb.save(result, args.out)
    except Exception:
        result["server_error"] = traceback.format_exc(limit=3)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    trace = args.work / "rounds.jsonl"
    if args.round_trace and args.out is not None and trace.is_file():
        kept = args.out.with_name(args.out.stem + ".rounds.jsonl")
        kept.write_bytes(trace.read_bytes())
        result["round_trace"] = str(kept)
    result["total_sec"] = round(time.perf_counter() - t_all, 1)
    try:
        result["table"] = table({"rounds": [r for r in result["rounds"] if "server" in r]})
    except Exception:
        result["table"] = traceback.format_exc(limit=3)
    eb.save(result, args.out)
    print(json.dumps(result, indent=1))
    print(result["table"])


async def _info(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(url + "/api/info") as resp:
        info = await resp.json()
    return dict(info.get("details", {}))


if __name__ == "__main__":
    main()
