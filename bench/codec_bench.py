"""Codec benchmark (CUDA): streaming decode per chunk and reference-encoding time, full-size random weights.

    python bench/codec_bench.py --out bench_codec.json

1. Self-check on the device: tiny codec in fp32, streaming (eager and CUDA-graph) == whole-clip decode.
2. Full-size v2 shapes with random weights (built directly on the GPU; ``--via-disk`` writes and loads the
   real on-disk layout instead), bf16 compute, K/V pools for ``--streams`` slots.
3. For each mode (eager, graphs), streams S in {1, 16} and chunk T in {1, 5, 18}: ms per decode call,
   ms per frame (call / T). Then whole-clip decode of 10 s and encode of 10 s of audio.

Needs only torch + numpy + safetensors (no soundfile/soxr): the encode timing is the codec part of
reference encoding; decoding/resampling the upload is CPU work not measured here.

Streams by age (``--ages 1,5,12``): ``--age-streams`` streams (64) decoded to each age in turn, then calls of
``--age-chunks`` frames (1 and 8) timed through CUDA graphs with the window-attention kernel and with
``MOSS_RT_CODEC_KERNEL=0`` (masked SDPA over gathered rings), each stream reset to its age after every timed call;
also the K/V bytes each stream holds at that age and how far the two attention paths' audio differ (bf16).
``--age-modes`` picks the paths (``kernel,sdpa``; ``kernel-fp8``: the kernel over fp8 state, and how far its audio is
from bf16 state's); with ``--profile`` each path's last age and chunk is profiled eagerly, kernel by kernel, into
``codec_ages_<mode>.profile.txt`` next to ``--out``. The bounded run for the H200 (about 2-3 minutes)::

    python bench/codec_bench.py --modes none --skip-whole --ages 1,5,12 --out codec_ages.json

Where a 128-stream call's time goes (bench/RESULTS.md, session 33; about a minute)::

    python bench/codec_bench.py --modes none --skip-whole --ages 6,11 --age-streams 128 --age-chunks 1,8 \
        --age-modes kernel,kernel-fp8 --profile --out ages.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moss_rt.codec import CodecModel, fused, load_codec  # noqa: E402
from moss_rt.codec.config import CodecConfig  # noqa: E402
from moss_rt.codec.streaming import StreamingDecoder  # noqa: E402
from moss_rt.codec.tiny import (  # noqa: E402
    full_size_config,
    tiny_config,
    write_full_size_random_codec,
    write_tiny_codec,
)

log = logging.getLogger("codec_bench")


def self_check(device: str, graphs: bool = True) -> dict[str, float]:
    """Streaming == whole on the device, fp32, tiny codec (windows 2 frames; 40 frames)."""
    with tempfile.TemporaryDirectory() as d:
        codec = load_codec(write_tiny_codec(Path(d) / "tiny"), device=device)
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 1024, (40, 12)).astype(np.int64)
    whole = codec.decode(torch.from_numpy(codes).to(device)[None])[0].cpu().numpy()
    out: dict[str, float] = {}
    for use_graphs in (False, True) if graphs else (False,):
        dec = StreamingDecoder(codec, device=device, dtype=torch.float32, max_streams=3, max_chunk_frames=8,
                               cuda_graphs=use_graphs)
        for n in (1, 5, 7):
            st = dec.new_state()
            parts = [dec.decode([st], [codes[i : i + n]])[0] for i in range(0, 40, n)]
            st.close()
            out[f"{'graph' if use_graphs else 'eager'}_chunk{n}_maxabs"] = float(
                np.abs(np.concatenate(parts, -1) - whole).max()
            )
        # two streams batched, different ages; alternate slot order so both the contiguous-view and
        # the gather paths (and graphs) are exercised
        a, b = dec.new_state(), dec.new_state()
        dec.decode([a], [codes[:3]])
        pa, pb = [], []
        for k, i in enumerate(range(0, 35, 5)):
            if k % 2:
                rb, ra = dec.decode([b, a], [codes[i : i + 5], codes[3 + i : 8 + i]])
            else:
                ra, rb = dec.decode([a, b], [codes[3 + i : 8 + i], codes[i : i + 5]])
            pa.append(ra)
            pb.append(rb)
        out[f"{'graph' if use_graphs else 'eager'}_batched_maxabs"] = float(
            max(np.abs(np.concatenate(pa, -1) - whole[:, 3 * 3840 : 38 * 3840]).max(),
                np.abs(np.concatenate(pb, -1) - whole[:, : 35 * 3840]).max())
        )
    return out


@torch.no_grad()
def random_full_size(device: str, context_duration: float, with_encoder: bool, tiny: bool = False) -> CodecModel:
    """Full-size codec with random weights made on the GPU (no 8 GB file round trip); ``tiny`` for dry runs."""
    cfg = CodecConfig.from_dict((tiny_config if tiny else full_size_config)(context_duration))
    with torch.device("meta"):
        model = CodecModel(cfg, with_encoder=with_encoder)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith(("norm1.weight", "norm2.weight")):
            p.fill_(1.0)
        elif name.endswith(("norm1.bias", "norm2.bias", ".bias")):
            p.zero_()
        elif name.endswith(".scale"):
            p.fill_(0.01)
        elif name.endswith("codebook.weight"):
            p.normal_(generator=gen)
        else:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
    return model.eval().requires_grad_(False)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, iters: int, warm: int) -> float:
    """Mean ms per call (CUDA-synchronised)."""
    for _ in range(warm):
        fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return (time.perf_counter() - t0) * 1000 / iters


def profile_step(dec: StreamingDecoder, states: list, codes: list, path: Path) -> None:
    """Kernel-level breakdown of 3 eager decode calls (top ops by CUDA time) written to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            dec.decode_tensors(states, codes)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    n_kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    path.write_text(f"CUDA kernels over 3 calls: {n_kernels}\n{table}\n")


def count_kernels(dec: StreamingDecoder, states: list, codes: list) -> int:
    """CUDA kernels launched by one eager decode call (what a graph of the same step replays, give or take)."""
    from torch.profiler import ProfilerActivity, profile

    graphs, dec.cuda_graphs = dec.cuda_graphs, False
    try:
        dec.decode_tensors(states, codes)  # warm (Triton compiles, cuBLAS plans) outside the profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dec.decode_tensors(states, codes)
            torch.cuda.synchronize()
    finally:
        dec.cuda_graphs = graphs
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def bench_mode(
    mode: str, codec: CodecModel, device: str, streams: list[int], chunks: list[int],
    rng: np.random.Generator, res: dict[str, object], profile_dir: Path | None = None,
    cases: list[tuple[int, int]] | None = None,
) -> list[dict[str, object]]:
    """Time one decoder mode over every (streams, chunk) pair (or only ``cases``).

    ``mode`` is ``eager`` or ``graph``, optionally with suffixes: an attention kernel (``-matmul``, ``-auto``) and
    ``-nofuse`` (plain PyTorch elementwise ops instead of the fused Triton kernels), e.g. ``graph-nofuse``.
    """
    parts = mode.split("-")
    ctx = fused.disabled() if "nofuse" in parts else contextlib.nullcontext()
    with ctx:
        return _bench_mode(mode, parts, codec, device, streams, chunks, rng, res, profile_dir, cases)


def _bench_mode(
    mode: str, parts: list[str], codec: CodecModel, device: str, streams: list[int], chunks: list[int],
    rng: np.random.Generator, res: dict[str, object], profile_dir: Path | None,
    cases: list[tuple[int, int]] | None,
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    kind = parts[0]
    attn = next((p for p in parts[1:] if p in ("sdpa", "matmul", "auto")), "sdpa")
    if cases is None:
        cases = [(S, T) for S in streams for T in chunks]
    dec = StreamingDecoder(codec, device=device, dtype=torch.bfloat16, max_streams=max(S for S, _ in cases),
                           max_chunk_frames=max(T for _, T in cases), cuda_graphs=(kind == "graph"),
                           attention=attn)
    pool_mb = sum(t.numel() * t.element_size() for s in dec._stages.values() for t in s.k_pool + s.v_pool) / 1e6
    res[f"{mode}_kv_pool_MB"] = round(pool_mb, 1)
    for S, T in cases:
        states = [dec.new_state() for _ in range(S)]
        codes = [rng.integers(0, 1024, (T, 12)) for _ in range(S)]
        t_cap = time.perf_counter()
        dec.warmup([S], [T])
        cap_s = time.perf_counter() - t_cap
        iters = 10 if T == 18 else 20
        ms = timed(lambda: dec.decode_tensors(states, codes), iters=iters, warm=2)  # noqa: B023
        ms_np = timed(lambda: dec.decode(states, codes), iters=5, warm=1)  # noqa: B023
        ms_gather = None
        if S > 1:  # reversed order is not a contiguous ascending range: the gather path
            ms_gather = timed(lambda: dec.decode_tensors(states[::-1], codes[::-1]), iters=iters, warm=2)  # noqa: B023
        if profile_dir is not None and kind == "eager":
            profile_step(dec, states, codes, profile_dir / f"profile_{mode}_S{S}_T{T}.txt")
        n_kern = count_kernels(dec, states, codes) if device == "cuda" and T == 1 else None
        for st in states:
            st.close()
        row = {"mode": mode, "streams": S, "chunk_frames": T, "ms_per_call": round(ms, 2),
               "ms_per_frame_step": round(ms / T, 3), "ms_per_call_numpy_out": round(ms_np, 2),
               "realtime_x_per_stream": round(80.0 * T / ms, 1), "capture_s": round(cap_s, 2),
               "ms_per_call_gathered_slots": None if ms_gather is None else round(ms_gather, 2),
               "cuda_kernels_per_call": n_kern}
        rows.append(row)
        log.info("%s", row)
    return rows


@torch.no_grad()
def bench_ages(
    codec: CodecModel, device: str, ages_s: list[float], n_streams: int, chunks: list[int], iters: int,
    res: dict[str, object], modes: tuple[str, ...] = ("kernel", "sdpa"), profile_dir: Path | None = None,
) -> list[dict[str, object]]:
    """ms per graphed call of ``n_streams`` streams x T frames at each age, by attention mode (see the docstring):
    ``kernel`` (the window kernel over bf16 state), ``sdpa`` (masked SDPA), ``kernel-fp8`` (the kernel over fp8
    state, ``--codec-state-dtype fp8``). ``profile_dir``: an eager kernel profile of each mode's last age and chunk."""
    import os

    from moss_rt.codec.kv_quant import FP8
    from moss_rt.codec.paged_state import stream_state_bytes

    rows: list[dict[str, object]] = []
    rate = codec.config.frame_rate
    ages = sorted({max(1, round(a * rate)) for a in ages_s})
    rng = np.random.default_rng(5)
    history = [rng.integers(0, 1024, (ages[-1], 12)) for _ in range(n_streams)]  # the same codes in both modes
    probe = {t: [rng.integers(0, 1024, (t, 12)) for _ in range(n_streams)] for t in chunks}
    audio: dict[tuple[str, int, int], torch.Tensor] = {}
    saved = os.environ.get("MOSS_RT_CODEC_KERNEL")
    try:
        for mode in modes:
            os.environ["MOSS_RT_CODEC_KERNEL"] = "0" if mode == "sdpa" else "1"
            if device == "cuda":
                torch.cuda.empty_cache()
            dec = StreamingDecoder(codec, device=device, dtype=torch.bfloat16, max_streams=n_streams,
                                   max_chunk_frames=max(8, *chunks), cuda_graphs=device == "cuda",
                                   state_dtype=FP8 if mode.endswith("fp8") else None)
            res[f"ages_{mode}_uses_window_kernel"] = all(dec._kernel_for(st) for st in dec._stages.values())
            states = [dec.new_state() for _ in range(n_streams)]
            t_cap = time.perf_counter()
            dec.warmup([n_streams], sorted({*chunks, 8}))
            res[f"ages_{mode}_capture_s"] = round(time.perf_counter() - t_cap, 2)
            for age in ages:
                while states[0].frames < age:  # decode every stream up to this age, 8 frames a call
                    f = states[0].frames
                    t = min(8, age - f)
                    if t not in (8, *chunks):
                        t = 1
                    dec.decode_tensors(states, [h[f : f + t] for h in history])
                held = [dec.state_bytes(st) for st in states]

                for t in chunks:
                    def call(
                        t: int = t, age: int = age, dec: StreamingDecoder = dec, states: list = states
                    ) -> torch.Tensor:
                        out = dec.decode_tensors(states, probe[t])
                        for st in states:
                            st.frames = age  # the next call decodes the same positions again: the age holds
                        return out[0]

                    audio[(mode, age, t)] = torch.stack(dec.decode_tensors(states, probe[t])).float().cpu()
                    for st in states:
                        st.frames = age
                    ms = timed(call, iters=iters, warm=2)
                    row = {
                        "attention": mode, "streams": n_streams, "chunk_frames": t, "age_s": round(age / rate, 2),
                        "ms_per_call": round(ms, 2), "ms_per_frame_step": round(ms / t, 3),
                        "MB_held_per_stream": round(sum(held) / len(held) / 1e6, 1),
                        "MB_per_stream_by_formula": round(stream_state_bytes(codec, dec.max_chunk_frames,
                                                                             torch.bfloat16, frames=age) / 1e6, 1),
                        "MB_per_stream_at_most": round(dec.stream_bytes / 1e6, 1),
                    }
                    rows.append(row)
                    log.info("%s", row)
            res[f"ages_{mode}_pool_GB"] = round(dec.pool_bytes / 1e9, 2)
            if profile_dir is not None and device == "cuda":
                graphs, dec.cuda_graphs = dec.cuda_graphs, False
                try:
                    profile_step(dec, states, probe[chunks[-1]], profile_dir / f"codec_ages_{mode}.profile.txt")
                finally:
                    dec.cuda_graphs = graphs
            for st in states:
                st.close()
            del dec, states
    finally:
        if saved is None:
            os.environ.pop("MOSS_RT_CODEC_KERNEL", None)
        else:
            os.environ["MOSS_RT_CODEC_KERNEL"] = saved
    # kernel vs SDPA on the same codes from the same history: bf16 rounding only
    diffs = {}
    for (mode, age, t), a in audio.items():
        if mode == "kernel" and ("sdpa", age, t) in audio:
            b = audio[("sdpa", age, t)]
            diffs[f"age{age}_T{t}"] = float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
    res["ages_kernel_vs_sdpa_rel_maxabs"] = diffs
    # fp8 state against bf16 state, the same codes: the storage's rounding (lossy, docs/codec.md)
    res["ages_fp8_vs_kernel_rel_maxabs"] = {
        f"age{age}_T{t}": float((a - audio[("kernel", age, t)]).abs().max()
                                / audio[("kernel", age, t)].abs().max().clamp_min(1e-12))
        for (mode, age, t), a in audio.items() if mode == "kernel-fp8" and ("kernel", age, t) in audio
    }
    return rows


def whole_clip_timings(codec: CodecModel, device: str, rng: np.random.Generator, res: dict[str, object]) -> None:
    try:
        codes10 = torch.from_numpy(rng.integers(0, 1024, (1, 125, 12))).to(device)
        res["whole_decode_10s_ms"] = round(timed(lambda: codec.decode(codes10), iters=3, warm=1), 1)
        wav = (0.1 * torch.randn(1, 2, 480000, generator=torch.Generator().manual_seed(0))).to(device)
        res["encode_10s_ms_bf16"] = round(timed(lambda: codec.encode(wav, 12), iters=3, warm=1), 1)
        res["encode_10s_frames"] = int(codec.encode(wav, 12).shape[1])
    except Exception as exc:
        log.exception("whole-clip timings failed")
        res["whole_error"] = repr(exc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="codec_bench.json")
    ap.add_argument("--context-duration", type=float, default=10.0)
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--chunks", default="1,5,18")
    ap.add_argument("--modes", default="eager,graph")
    ap.add_argument("--cases", default=None, help="only these streams x chunk pairs, e.g. 16x1,16x5,1x5")
    ap.add_argument("--via-disk", action="store_true", help="write + load the real layout instead of GPU init")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="dry run with the tiny config")
    ap.add_argument("--profile", action="store_true", help="write eager kernel profiles next to --out")
    ap.add_argument("--bf16-check", action="store_true", help="compare bf16 with fp32 on the same random weights")
    ap.add_argument("--ages", default=None, help="stream ages in seconds for the by-age cases, e.g. 1,5,12")
    ap.add_argument("--age-streams", type=int, default=64)
    ap.add_argument("--age-chunks", default="1,8")
    ap.add_argument("--age-iters", type=int, default=10)
    ap.add_argument("--age-modes", default="kernel,sdpa",
                    help="attention of the by-age cases: kernel (bf16 state), sdpa, kernel-fp8 (fp8 state)")
    ap.add_argument("--skip-whole", action="store_true", help="skip the whole-clip decode/encode timings")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = args.device
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    res: dict[str, object] = {"gpu": gpu, "torch": torch.__version__, "context_duration_s": args.context_duration}
    out = Path(args.out)
    try:
        res["self_check"] = self_check(device, graphs=device == "cuda")
    except Exception as exc:  # keep going: the timings are still worth having
        log.exception("self-check failed")
        res["self_check"] = {"error": repr(exc)}
    log.info("self-check: %s", res["self_check"])

    t0 = time.perf_counter()
    if args.via_disk:
        with tempfile.TemporaryDirectory() as d:
            write_full_size_random_codec(d, context_duration=args.context_duration)
            codec = load_codec(d, device=device, compute_dtype=torch.bfloat16)
    else:
        codec = random_full_size(device, args.context_duration, with_encoder=True, tiny=args.tiny)
        codec.set_compute_dtype(torch.bfloat16)
        codec.quantizer.build_lut()
    res["build_s"] = round(time.perf_counter() - t0, 2)
    res["params_M"] = round(sum(p.numel() for p in codec.parameters()) / 1e6, 1)
    streams = [int(s) for s in args.streams.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    cases = None
    if args.cases:
        cases = [(int(a), int(b)) for a, b in (c.split("x") for c in args.cases.split(","))]
    rng = np.random.default_rng(1)
    rows: list[dict[str, object]] = []
    for mode in [m for m in args.modes.split(",") if m and m != "none"]:
        if device == "cuda":
            torch.cuda.empty_cache()
        try:
            rows += bench_mode(mode, codec, device, streams, chunks, rng, res,
                               out.parent if (args.profile and device == "cuda") else None, cases)
        except Exception as exc:
            log.exception("mode %s failed", mode)
            res[f"{mode}_error"] = repr(exc)
        res["decode"] = rows
        out.write_text(json.dumps(res, indent=2) + "\n")  # partial results survive a later failure
    if args.ages:
        try:
            res["ages"] = bench_ages(codec, device, [float(a) for a in args.ages.split(",")], args.age_streams,
                                     [int(c) for c in args.age_chunks.split(",")], args.age_iters, res,
                                     tuple(args.age_modes.split(",")),
                                     out.parent if (args.profile and device == "cuda") else None)
        except Exception as exc:
            log.exception("by-age cases failed")
            res["ages_error"] = repr(exc)
        out.write_text(json.dumps(res, indent=2) + "\n")
    if device == "cuda":
        res["peak_mem_GB"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    if args.bf16_check and not args.via_disk:
        # Same random weights in fp32: how far is bf16 compute from fp32 on the full-size network?
        ref = random_full_size(device, args.context_duration, with_encoder=True, tiny=args.tiny)  # same draw order
        ref.quantizer.build_lut()
        c = torch.from_numpy(rng.integers(0, 1024, (1, 20, 12))).to(device)
        a32, a16 = ref.decode(c), codec.decode(c)
        res["bf16_vs_fp32_whole_decode_rel_maxabs"] = float((a16 - a32).abs().max() / a32.abs().max())
        res["bf16_finite"] = bool(torch.isfinite(a16).all())
        del ref
    if not args.skip_whole:
        whole_clip_timings(codec, device, rng, res)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
