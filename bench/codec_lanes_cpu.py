"""The codec's two lanes under a flow of directors, on the CPU: do running streams starve, what do directors pay?

    python bench/codec_lanes_cpu.py [--patience 60000,40,0] [--codec-ms 40] [--seconds 3] [--out FILE]

The tiny engine (CPU) with its codec slowed to ``--codec-ms`` a call (a sleep in each decode call, so the codec is
the busy side, as on an H200 with 64 directors), three running takes streaming, and for ``--seconds`` a new director's
8-frame take whenever fewer than two wait or prepare (each one's ramp: one-frame chunks in the codec's priority
lane). For each ``codec_bulk_patience_ms`` it reports the running takes' chunks in that time (starved: few), the
codec's calls by lane, and the directors' first audio (admission to first PCM, ms p50 / p95). Session 14 found the
starvation on the H200 (bench/RESULTS.md); this reproduces it without one, to compare rules for the lanes. The
codec here is backed up throughout, so the patience decides; ``codec_bulk_longest_wait_ms`` (the bound while
nothing is parked) is the server's default, and never shorter than the patience (60,000: both off).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moss_rt.engine.codec_calls import Chunk, CodecCalls  # noqa: E402
from tests.engine.harness import Rounds, engine_settings, loaded_engine, spec  # noqa: E402

TEXT = "Line: the rain had stopped an hour ago."


def run(data: Path, patience_ms: float, codec_ms: float, seconds: float) -> dict[str, Any]:
    real = CodecCalls.decode_and_push

    def slow(self: CodecCalls, chunks: list[Chunk]) -> None:
        time.sleep(codec_ms / 1000.0)  # the codec as the busy side
        real(self, chunks)

    CodecCalls.decode_and_push = slow  # type: ignore[method-assign]
    try:
        settings = engine_settings(data, overlap=True, max_slots=16, max_queue=64, max_seq_len=512,
                                   codec_bulk_patience_ms=patience_ms)
        with loaded_engine(settings) as engine:
            rounds = Rounds(engine)
            running = rounds.add(*[spec(f"r{i}", i, 4000, 4, text=f"{TEXT} {i}") for i in range(3)])
            rounds.until(lambda: all(len(t.channel.chunks) >= 10 for t in running))
            before = [len(t.channel.chunks) for t in running]
            sample = engine.metrics.registry.get_sample_value
            calls0 = {lane: sample("moss_rt_codec_calls_total", {"lane": lane}) or 0.0 for lane in ("priority", "bulk")}
            directors = []
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                if len(rounds.sched.waiting) + len(rounds.sched.preparing) < 2:
                    directors += rounds.add(spec(f"d{len(directors)}", 100 + len(directors), 8, 4,
                                                 text=f"{TEXT} Director {len(directors)}."))
                engine._wake.clear()
                if not rounds.sched.iterate():
                    engine._wake.wait(0.005)
            chunks = [len(t.channel.chunks) - b for t, b in zip(running, before, strict=True)]
            calls = {lane: (sample("moss_rt_codec_calls_total", {"lane": lane}) or 0.0) - calls0[lane]
                     for lane in ("priority", "bulk")}
            for take in running:
                take.channel.cancel()
            rounds.until(lambda: all(t.channel.finished for t in [*running, *directors]) and not rounds.sched.running)
            firsts = [1000.0 * (t.first_audio - t.admitted) for t in directors if t.first_audio is not None]
    finally:
        CodecCalls.decode_and_push = real  # type: ignore[method-assign]
    return {
        "patience_ms": patience_ms,
        "running_chunks": chunks,
        "running_audio_sec_per_sec": round(sum(chunks) * 4 * 0.08 / len(chunks) / seconds, 3),
        "codec_calls": calls,
        "directors": len(directors),
        "director_first_audio_ms": [round(float(np.percentile(firsts, q)), 1) for q in (50, 95)] if firsts else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--patience", default="60000,40,0", help="codec_bulk_patience_ms values, one run each")
    p.add_argument("--codec-ms", type=float, default=40.0)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for value in (float(v) for v in args.patience.split(",")):
            results.append(run(Path(tmp), value, args.codec_ms, args.seconds))
            print(json.dumps(results[-1]), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
