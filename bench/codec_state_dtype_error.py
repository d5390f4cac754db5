"""Error of the codec's streaming state dtypes against the fp32 reference (CPU by default, CUDA if present).

    python bench/codec_state_dtype_error.py [--device cpu|cuda] [--frames 40] [--full-frames 12] [--no-full]

Streams the same random codes through StreamingDecoder four ways and compares the PCM with the fp32 decode (fp32
compute, fp32 K/V state): bf16 compute with bf16 state (production before fp8), bf16 compute with fp8 state (the
``--codec-state-dtype fp8`` path), and fp32 compute with fp8 state (the quantization alone). Codecs: the committed
tiny codec (tests/fixtures/codec/tiny, head_dim 16) and the full-size codec with random weights (head_dim 64;
bench/codec_bench.py's ``random_full_size``, decode-only) for a few frames (CPU minutes; its windows are 10 s, so
a few frames cover young streams only: on CUDA give --full-frames 200 to go past the windows). Also prints the
state one stream reserves at full size (chunks of 8, the engine's) in each dtype. Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moss_rt.codec import CodecModel, load_codec  # noqa: E402
from moss_rt.codec.config import CodecConfig  # noqa: E402
from moss_rt.codec.kv_quant import FP8  # noqa: E402
from moss_rt.codec.paged_state import stream_state_bytes  # noqa: E402
from moss_rt.codec.streaming import StreamingDecoder  # noqa: E402
from moss_rt.codec.tiny import full_size_config  # noqa: E402

TINY = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "codec" / "tiny"
CASES = [  # (label, compute dtype, state dtype)
    ("bf16 compute, bf16 state", torch.bfloat16, None),
    ("bf16 compute, fp8 state", torch.bfloat16, FP8),
    ("fp32 compute, fp8 state", torch.float32, FP8),
]
ENGINE_CHUNK = 8

log = logging.getLogger("codec_state_dtype_error")


def stream(codec: CodecModel, device: str, dtype: torch.dtype, state: torch.dtype | None, codes: np.ndarray,
           chunk: int) -> np.ndarray:
    dec = StreamingDecoder(codec, device=device, dtype=dtype, max_streams=1, max_chunk_frames=ENGINE_CHUNK,
                           state_dtype=state)
    st = dec.new_state()
    parts = [dec.decode([st], [codes[i : i + chunk]])[0] for i in range(0, len(codes), chunk)]
    st.close()
    return np.concatenate(parts, -1)


def measure(name: str, make: object, device: str, frames: int, chunk: int) -> list[dict[str, object]]:
    codes = np.random.default_rng(7).integers(0, 1024, (frames, 12))
    t0 = time.perf_counter()
    ref = stream(make(), device, torch.float32, None, codes, chunk)  # type: ignore[operator]
    peak = float(np.abs(ref).max())
    rows = []
    for label, dtype, state in CASES:
        err = np.abs(stream(make(), device, dtype, state, codes, chunk) - ref)  # type: ignore[operator]
        rows.append({
            "codec": name, "case": label, "frames": frames, "max_abs": float(err.max()),
            "mean_abs": float(err.mean()), "max_rel_to_peak": float(err.max()) / peak,
            "snr_db": float(10 * np.log10(np.mean(ref**2) / max(np.mean(err**2), 1e-30))),
        })
    log.info("%s: %d frames in %.0f s", name, frames, time.perf_counter() - t0)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--frames", type=int, default=40, help="frames of the tiny codec (its rings: ~10 frames)")
    ap.add_argument("--full-frames", type=int, default=12, help="frames of the full-size random codec")
    ap.add_argument("--chunk", type=int, default=4, help="frames per decode call")
    ap.add_argument("--no-full", action="store_true", help="the tiny codec only")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    rows = measure("tiny", lambda: load_codec(TINY, device=args.device), args.device, args.frames, args.chunk)
    from codec_bench import random_full_size  # bench/codec_bench.py

    with torch.device("meta"):  # shapes only: the bytes one full-size stream reserves
        meta = CodecModel(CodecConfig.from_dict(full_size_config(10.0)), with_encoder=False)
    mb = {}
    for label, dt in (("bf16", torch.bfloat16), ("fp8", FP8)):
        mb[label] = round(stream_state_bytes(meta, ENGINE_CHUNK, dt) / 1e6, 1)
    if not args.no_full:
        rows += measure("full-size random", lambda: random_full_size(args.device, 10.0, with_encoder=False),
                        args.device, args.full_frames, args.chunk)
    width = max(len(r["case"]) for r in rows)  # type: ignore[arg-type]
    print(f"{'codec':<18} {'case':<{width}} {'frames':>6} {'max abs':>9} {'mean abs':>9} {'max/peak':>9} {'SNR dB':>7}")
    for r in rows:
        print(f"{r['codec']:<18} {r['case']:<{width}} {r['frames']:>6} {r['max_abs']:>9.2e} {r['mean_abs']:>9.2e} "
              f"{r['max_rel_to_peak']:>9.2e} {r['snr_db']:>7.1f}")
    print(f"full-size state one stream reserves (10 s windows, chunks of {ENGINE_CHUNK}): {mb} MB")
    print(json.dumps({"device": args.device, "errors_vs_fp32": rows, "full_size_MB_per_stream": mb}))


if __name__ == "__main__":
    main()
