"""Word-timing benchmarks (issue 25, docs/words.md). Three measurements, each printed as one JSON object:

``cpu`` — what aligning a 10 s take costs with the offline aligner (PocketSphinx, one CPU core): the first 10 s of
the espeak-ng fixture (real speech) aligned whole, best and median of ``--repeats``; and what the streaming track
costs over the same audio (all its jobs, 0.64 s chunks). Target: at most 1 s per 10 s take.

    .venv/bin/python bench/words_bench.py cpu

``latency`` — how long after the audio that holds it a word arrives: a real server (tiny model; ``--device cuda``
on a GPU) streams ``--takes`` concurrent WebSocket takes with ``"words": true``; for every word, the time its
``words`` message arrived minus the time the PCM frame holding the word's end arrived (client clock). Prints
p50/p95/max. Target: p95 at most 1.2 s. The tiny model's audio is noise, so these words are the estimated ones;
the pipeline (tick, queue, alignment, send) is the same for real speech.

    .venv/bin/python bench/words_bench.py latency                      # CPU, tiny model
    .venv/bin/python bench/words_bench.py latency --device cuda --takes 64 --aligner pocketsphinx

``gpu`` — the CTC aligner's share of the GPU at ``--takes`` concurrent takes: writes a random CTC checkpoint of
the MMS-300m size (24 layers, 1024 wide, 315M parameters) in the hub layout, and streams ``--takes`` takes of
real-time audio (80 ms frames in 0.64 s chunks, as the engine sends them) through the service's own word tracks
and batching aligner service for ``--seconds``; the GPU time is the aligner's synchronised network time. Target:
at most 5 % of the GPU's time at 64 takes (report it beside the directing and engine benches).

    python bench/words_bench.py gpu --takes 64 --seconds 60                    # on the H200: both regimes
    python bench/words_bench.py gpu --takes 64 --seconds 30 --results truth --no-graphs --gather-ms 150  # before
    .venv/bin/python bench/words_bench.py gpu --takes 4 --seconds 5 --size tiny --device cpu --warmup-sec 2  # smoke

Each take streams the fixture's real speech (from a word of its own, looped) and its text (from that word on,
repeated, so a take never runs out of words). The network runs on every job's audio; what the track is told back
is ``--results``: ``random`` (the random network's own Viterbi: no word ever settles, so every word is settled by
age, the most audio a job can hold: the worst case), ``truth`` (the words where the fixture says they are, as a
trained checkpoint places them: the typical case), or ``both`` (the default: one run of each, one JSON line each).
Beside the share it prints the jobs' audio (``job_window_sec``: mean and max, bounded by the track's
``--window-sec``), the network calls, windows per call, and the share of padding they computed. The takes stream
``--warmup-sec`` first (10 s: every shape's CUDA graph gets captured, the load-dependent gather settles), then
``--seconds`` are measured: the steady state of a service that has been up a while; ``captures_measured`` says
whether any capture still fell inside it. ``job_turnaround_sec`` is a job's time in the aligner (queue, gather,
network, Viterbi), what the aligner adds to a word's lag; ``max_abs_diff_vs_hf`` compares the graphed network's
log-probabilities with the Hugging Face module's on one batch; ``--no-graphs`` runs the module eagerly instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moss_rt.align.base import AlignResult  # noqa: E402
from moss_rt.align.track import WordTrack  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "words"
CHUNK_SEC = 0.64  # 8 frames of 80 ms: the engine's default chunk


def _speech() -> tuple[np.ndarray, dict[str, Any]]:
    audio, _ = sf.read(FIXTURE / "espeak_16k.flac", dtype="float32")
    return audio, json.loads((FIXTURE / "espeak_16k.json").read_text())


def _text_until(truth: dict[str, Any], seconds: float) -> str:
    return " ".join(w["word"] for w in truth["words"] if w["end"] <= seconds)


# --------------------------------------------------------------------------- cpu


def bench_cpu(args: argparse.Namespace) -> dict[str, Any]:
    import soxr

    from moss_rt.align.sphinx import PocketsphinxAligner

    audio, truth = _speech()
    seconds = 10.0
    clip, text = audio[: int(16000 * seconds)], _text_until(truth, seconds)
    aligner = PocketsphinxAligner()
    aligner.load()
    whole: list[float] = []
    streamed: list[float] = []
    jobs = 0
    for _ in range(args.repeats):
        track = WordTrack(text, sample_rate=16000, input_rate=16000)
        track.add_audio(clip)
        t0 = time.process_time()
        while (due := track.next_job(final=True, complete=True)) is not None:
            track.apply(due[1], aligner.align_batch([due[0]])[0])
        whole.append(time.process_time() - t0)
        pcm = (np.clip(soxr.resample(clip, 16000, 48000), -1, 1) * 32767).astype("<i2").tobytes()
        step = int(CHUNK_SEC * 48000) * 2
        track = WordTrack(text, sample_rate=16000)
        spent, jobs = 0.0, 0
        for at in range(0, len(pcm), step):
            track.add_pcm(pcm[at : at + step], 1)
            if (due := track.next_job()) is not None:
                t0 = time.process_time()
                track.apply(due[1], aligner.align_batch([due[0]])[0])
                spent += time.process_time() - t0
                jobs += 1
        t0 = time.process_time()
        while (due := track.next_job(final=True, complete=True)) is not None:
            track.apply(due[1], aligner.align_batch([due[0]])[0])
            jobs += 1
        streamed.append(spent + time.process_time() - t0)
    return {
        "bench": "words cpu", "aligner": "pocketsphinx", "audio_sec": seconds, "words": len(text.split()),
        "whole_take_cpu_sec": {"best": round(min(whole), 3), "median": round(statistics.median(whole), 3)},
        "streamed_take_cpu_sec": {"best": round(min(streamed), 3), "median": round(statistics.median(streamed), 3),
                                  "jobs": jobs},
        "target_sec": 1.0,
    }  # fmt: skip


# --------------------------------------------------------------------------- latency


async def _one_take(url: str, index: int, args: argparse.Namespace) -> tuple[list[float], float | None]:
    import websockets

    text = "Forty ships sailed across the quiet silver harbor before dawn, and nobody saw them go."
    lags: list[float] = []
    async with websockets.connect(url, max_size=None) as ws:
        await ws.recv()
        start = {"type": "start", "text": text, "seed": index, "max_new_tokens": args.frames,
                 "text_temperature": 0.0, "words": True}  # fmt: skip
        await ws.send(json.dumps(start))
        frame_at: list[float] = []  # arrival time of every 80 ms frame (by index from the take's start)
        first_frame = 0
        while True:
            data = await ws.recv()
            now = time.perf_counter()
            tag = data[0]
            if tag == 1:
                frames = (len(data) - 5) // (3840 * 2)
                frame_at += [now] * frames
                continue
            msg = json.loads(data[5:])
            if msg["type"] == "start":
                first_frame = msg.get("first_frame", 0)
            elif msg["type"] == "words":
                for word in msg["words"]:
                    holding = max(0, int(np.ceil(word["end"] * 12.5)) - 1 - first_frame)
                    if holding < len(frame_at):
                        lags.append(now - frame_at[holding])
                        if args.verbose:
                            print(index, word["word"], word["end"], holding, len(frame_at), round(lags[-1], 3),
                                  file=sys.stderr)  # fmt: skip
            elif msg["type"] in ("end", "error"):
                return lags, msg.get("rtf")


def bench_latency(args: argparse.Namespace) -> dict[str, Any]:
    from moss_rt.config import Settings
    from moss_rt.engine.moss import MossEngine
    from tests.helpers import ServerThread, free_port

    data = Path(tempfile.mkdtemp(prefix="words-bench-"))
    settings = Settings(
        host="127.0.0.1", port=free_port(), engine="moss", model=args.model, codec=args.model, device=args.device,
        data_dir=data, voices_dir=data / "voices", max_slots=max(args.takes, 4), max_queue=args.takes,
        max_seq_len=1024, max_lead_sec=args.max_lead, aligner=args.aligner, sessions=False,
    )  # fmt: skip
    server = ServerThread(settings, MossEngine(settings))
    running = server.start(ready_timeout=600)
    try:

        async def drive() -> tuple[list[float], list[float]]:
            await _one_take(running.ws_url, 99, args)  # warm-up (the aligner's worker processes start), not counted
            results = await asyncio.gather(*(_one_take(running.ws_url, i, args) for i in range(args.takes)))
            return [lag for lags, _ in results for lag in lags], [rtf for _, rtf in results if rtf]

        lags, rtfs = asyncio.run(drive())
    finally:
        server.stop()
    lags.sort()
    pick = lambda q: round(lags[min(len(lags) - 1, int(q * len(lags)))], 3) if lags else None  # noqa: E731
    return {
        "bench": "words latency", "model": args.model, "device": args.device, "aligner": args.aligner,
        "takes": args.takes, "frames": args.frames, "words": len(lags),
        "lag_sec": {"p50": pick(0.5), "p95": pick(0.95), "max": round(lags[-1], 3) if lags else None},
        # The engine's own speed (audio seconds per wall second per take): below 1 the audio itself comes late.
        "engine_rtf_median": round(statistics.median(rtfs), 2) if rtfs else None,
        "target_p95_sec": 1.2,
    }  # fmt: skip


# --------------------------------------------------------------------------- gpu


class _Speech:
    """The fixture's speech looped, from word ``first`` on, and the take's text with each word's time in it."""

    def __init__(self, audio: np.ndarray, truth: dict[str, Any], first: int, seconds: float) -> None:
        from moss_rt.align.normalize import tokenize

        words = truth["words"]
        duration = len(audio) / 16000
        self.offset = max(0.0, words[first]["start"] - 0.1)  # fixture time of the take's sample 0
        order = [(j, 0) for j in range(first, len(words))]
        loops = int(seconds / duration) + 2
        order += [(j, n) for n in range(1, loops) for j in range(len(words))]
        self.text = " ".join(words[j]["word"] for j, _ in order)
        self.times = [
            (words[j]["start"] + n * duration - self.offset, words[j]["end"] + n * duration - self.offset)
            for j, n in order
        ]
        self.index = {token.start: i for i, token in enumerate(tokenize(self.text))}
        assert len(self.index) == len(self.times)

    def answer(self, pending: Any, free_end: bool) -> AlignResult:
        """What a trained checkpoint would answer for a job: the words at their known times (job time), and, as
        the CTC aligner reports it, whether the free end is in a pause (``PAUSE_SEC`` past the last word's end)."""
        from moss_rt.align.ctc import PAUSE_SEC

        spans: list[tuple[float, float] | None] = []
        last_end = None
        for token in pending.tokens:
            start, end = self.times[self.index[token.start]]
            if free_end and start >= pending.end:
                break
            span = (max(start, pending.offset) - pending.offset, min(end, pending.end) - pending.offset)
            spans += [span] * len(token.spoken)
            last_end = end
        paused = free_end and last_end is not None and pending.end - last_end >= PAUSE_SEC
        return AlignResult(spans, len(spans) if paused else None)


def bench_gpu(args: argparse.Namespace) -> list[dict[str, Any]]:
    regimes = ["random", "truth"] if args.results == "both" else [args.results]
    return [_bench_gpu(args, regime) for regime in regimes]


def _bench_gpu(args: argparse.Namespace, regime: str) -> dict[str, Any]:
    import torch

    from moss_rt.align.ctc import CtcAligner, write_random_ctc_checkpoint
    from moss_rt.align.service import AlignService
    from moss_rt.align.track import STREAM_WINDOW_SEC

    folder = Path(tempfile.mkdtemp(prefix="ctc-bench-")) / args.size
    write_random_ctc_checkpoint(folder, size=args.size)
    gather = None if args.gather_ms is None else args.gather_ms / 1000
    most = None if args.max_gather_ms is None else args.max_gather_ms / 1000
    aligner = CtcAligner(str(folder), device=args.device, max_batch=args.takes, gather_sec=gather,
                         max_gather_sec=most, cuda_graphs=not args.no_graphs)  # fmt: skip
    cuda = args.device.startswith("cuda")
    forward = aligner._forward
    calls = {"forwards": 0, "rows": 0, "padded_sec": 0.0, "audio_sec": 0.0}
    window_sec = STREAM_WINDOW_SEC if args.window_sec is None else args.window_sec

    def counted(batch: Any) -> Any:  # the network's time, not just its launch; and what each call held
        calls["forwards"] += 1
        calls["rows"] += len(batch)
        calls["audio_sec"] += sum(len(a) for a in batch) / aligner.sample_rate
        calls["padded_sec"] += len(batch) * max(len(a) for a in batch) / aligner.sample_rate
        if cuda:
            torch.cuda.synchronize()
        out = forward(batch)
        if cuda:
            torch.cuda.synchronize()
        return out

    aligner._forward = counted  # type: ignore[method-assign]
    service = AlignService(aligner, max_pending=4 * args.takes)
    service.start()
    audio, truth = _speech()
    import soxr

    pcm48 = (np.clip(soxr.resample(audio, 16000, 48000), -1, 1) * 32767).astype("<i2").tobytes()
    step = int(CHUNK_SEC * 48000) * 2
    job_sec: list[float] = []  # audio of every streaming job (what the network computes over for it)
    turnaround: list[float] = []  # a job's queue, gather, network and Viterbi: what the aligner adds to a word's lag
    measure = {"from": float("inf")}  # steady state: after --warmup-sec (shapes captured, the gather settled)

    async def take(index: int, stop_at: float, counters: dict[str, float]) -> None:
        speech = _Speech(audio, truth, (index * 7919) % len(truth["words"]), args.warmup_sec + args.seconds)
        start = int(round(speech.offset * 48000)) * 2
        track = WordTrack(speech.text, sample_rate=aligner.sample_rate, window_sec=window_sec)
        t0 = time.perf_counter()
        sent = 0
        words_before = None
        while time.perf_counter() < stop_at:
            measuring = time.perf_counter() >= measure["from"]
            if measuring and words_before is None:
                words_before = len(track.words)
            at = (start + sent * step) % len(pcm48)
            piece = pcm48[at : at + step]
            if len(piece) < step:  # the loop's seam
                piece += pcm48[: step - len(piece)]
            track.add_pcm(piece, 1)
            sent += 1
            if measuring:
                counters["audio_sec"] += CHUNK_SEC
            if (due := track.next_job()) is not None:
                job, pending = due
                asked = time.perf_counter()
                try:
                    result = await service.align(job, wait=False)
                except Exception:
                    if measuring:
                        counters["skipped"] += 1
                    result = None
                if result is not None:
                    if measuring:
                        job_sec.append(len(job.audio) / aligner.sample_rate)
                        turnaround.append(time.perf_counter() - asked)
                        counters["jobs"] += 1
                    if regime == "truth":
                        result = speech.answer(pending, job.free_end)
                    track.apply(pending, result if isinstance(result, AlignResult) else AlignResult())
            # Real time: the next chunk is due CHUNK_SEC after this one.
            await asyncio.sleep(max(0.0, t0 + sent * CHUNK_SEC - time.perf_counter()))
        counters["words"] += len(track.words) - (words_before or 0)

    def check_vs_hf() -> float | None:
        """The largest difference between the graphed network's log-probabilities and the HF module's (eager) on
        one batch of 16 windows of 1 to 5 s: the graphs compute what the module does."""
        if aligner._graphed is None:
            return None
        rng = np.random.default_rng(0)
        batch = [rng.normal(0, 0.1, int(16000 * s)).astype(np.float32) for s in np.linspace(1, 5, 16)]
        graphed = forward(batch)
        runner, aligner._graphed = aligner._graphed, None
        try:
            eager = forward(batch)
        finally:
            aligner._graphed = runner
        return float(max(np.abs(a - b).max() for a, b in zip(graphed, eager, strict=True)))

    async def drive() -> dict[str, Any]:
        await service.wait_loaded()
        warm = np.zeros(16000 * 2, np.float32)
        from moss_rt.align.base import AlignJob

        await asyncio.gather(*(service.align(AlignJob(warm, ("a",))) for _ in range(min(8, args.takes))))
        diff = await asyncio.to_thread(check_vs_hf)
        counters = {"jobs": 0, "skipped": 0, "words": 0, "audio_sec": 0.0}
        t0 = time.perf_counter()
        measure["from"] = t0 + args.warmup_sec
        stop = measure["from"] + args.seconds
        takes = asyncio.gather(*(take(i, stop, counters) for i in range(args.takes)))
        await asyncio.sleep(args.warmup_sec)
        before = aligner.gpu_seconds
        calls_before = dict(calls)
        graphs_before = aligner.graph_stats or {}
        await takes
        wall = time.perf_counter() - measure["from"]
        busy = aligner.gpu_seconds - before
        for key, value in calls_before.items():
            calls[key] -= value
        graphs = aligner.graph_stats
        params = sum(p.numel() for p in aligner._model.parameters())  # before close() lets the model go
        take_sec = counters.pop("audio_sec")
        turnaround.sort()
        pick = lambda q: round(turnaround[min(len(turnaround) - 1, int(q * len(turnaround)))], 3)  # noqa: E731
        return {"wall_sec": round(wall, 2), "aligner_gpu_sec": round(busy, 3), "params_m": round(params / 1e6, 1),
                "gpu_share": round(busy / wall, 4), **counters,
                # The jobs' audio (bounded by the track's window) and how much audio the network computed over
                # for each second of the takes' audio (the jobs overlap: the unsettled tail is read again).
                "job_window_sec": {"mean": round(statistics.fmean(job_sec), 2) if job_sec else None,
                                   "max": round(max(job_sec), 2) if job_sec else None},
                "job_turnaround_sec": {"p50": pick(0.5), "p95": pick(0.95), "max": round(turnaround[-1], 3)}
                if turnaround else None,
                "network_sec_per_take_sec": round(calls["padded_sec"] / max(1e-9, take_sec), 2),
                # Network calls, windows per call, and the audio they held (padded: what the batch computed)
                "forwards": calls["forwards"],
                "windows_per_forward": round(calls["rows"] / max(1, calls["forwards"]), 2),
                "audio_sec_per_window": round(calls["audio_sec"] / max(1, calls["rows"]), 2),
                "padded_share": round(1 - calls["audio_sec"] / max(1e-9, calls["padded_sec"]), 3),
                "ms_per_forward": round(1000 * busy / max(1, calls["forwards"]), 2),
                # CUDA graphs: all of the run's, and the captures within the measured time (their cost is in it)
                "graphs": graphs, "captures_measured": None if graphs is None
                else graphs["captures"] - graphs_before.get("captures", 0),
                "max_abs_diff_vs_hf": None if diff is None else round(diff, 5)}  # fmt: skip

    try:
        result = asyncio.run(drive())
    finally:
        service.close()
    name = torch.cuda.get_device_name() if cuda else "cpu"
    return {
        "bench": "words gpu", "results": regime, "device": name, "size": args.size,
        "dtype": str(aligner._dtype).removeprefix("torch."), "takes": args.takes,
        "gather_ms": round(aligner.gather_sec * 1000), "max_gather_ms": round(aligner.max_gather_sec * 1000),
        "window_sec": window_sec, "warmup_sec": args.warmup_sec, **result, "target_share": 0.05,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="which", required=True)
    cpu = sub.add_parser("cpu")
    cpu.add_argument("--repeats", type=int, default=5)
    lat = sub.add_parser("latency")
    lat.add_argument("--takes", type=int, default=4)
    lat.add_argument("--frames", type=int, default=100, help="80 ms frames per take")
    lat.add_argument("--device", default="cpu")
    lat.add_argument("--model", default="tiny")
    lat.add_argument("--aligner", default="pocketsphinx")
    lat.add_argument("--verbose", action="store_true", help="print every word's lag (stderr)")
    lat.add_argument("--max-lead", type=float, default=2.0, help="audio a client may hold unplayed (pacing)")
    gpu = sub.add_parser("gpu")
    gpu.add_argument("--takes", type=int, default=64)
    gpu.add_argument("--seconds", type=float, default=60.0)
    gpu.add_argument("--size", default="mms-300m", choices=("mms-300m", "tiny"))
    gpu.add_argument("--device", default="cuda")
    gpu.add_argument("--gather-ms", type=float, default=None,
                     help="how long the aligner waits for jobs to join a batch (default: the aligner's own)")
    gpu.add_argument("--max-gather-ms", type=float, default=None,
                     help="how long it waits at most under load (default: the aligner's own; with --gather-ms: that)")
    gpu.add_argument("--warmup-sec", type=float, default=10.0,
                     help="takes stream this long before the measurement (the graphs of the shapes get captured)")
    gpu.add_argument("--no-graphs", action="store_true", help="the HF module eagerly (the path before CUDA graphs)")
    gpu.add_argument("--window-sec", type=float, default=None,
                     help="a streaming job's audio at most (default: the track's own, STREAM_WINDOW_SEC)")
    gpu.add_argument("--results", default="both", choices=("random", "truth", "both"),
                     help="what the track is told: the random network's Viterbi (nothing settles), the fixture's "
                          "word times (as a trained checkpoint), or one run of each")
    args = parser.parse_args()
    result = {"cpu": bench_cpu, "latency": bench_latency, "gpu": bench_gpu}[args.which](args)
    for line in result if isinstance(result, list) else [result]:
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
