"""Codec streaming state per stream by the take's age, before and after paging (no GPU, nothing allocated).

    python bench/codec_state_bytes.py [--dtype bf16] [--chunk 8] [--context-duration 10]

The full-size MOSS-Audio-Tokenizer-v2 decoder shapes (meta tensors: no weights). "before" is what every stream
held before the K/V state was paged: each stage's whole ring (window + one chunk, rounded up to 64 entries) per
layer, from its first frame. "after" is what a stream holds after a 2 s, 10 s and 60 s take (the blocks its age
has reached), and at most (its ring: what the pools reserve per stream). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moss_rt.codec.config import CodecConfig, TransformerSpec  # noqa: E402
from moss_rt.codec.model import CodecModel  # noqa: E402
from moss_rt.codec.paged_state import geometries, scratch_state_bytes, stream_state_bytes  # noqa: E402
from moss_rt.codec.tiny import full_size_config  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def before_bytes(cfg: CodecConfig, chunk: int, itemsize: int) -> int:
    """Every stream's rings before paging: per stage ceil((context + chunk * tokens_per_frame) / 64) * 64 entries."""
    total = 0
    for s in cfg.decoder:
        if isinstance(s, TransformerSpec):
            tpf = int(round(s.rate_hz / cfg.frame_rate))
            ring = -(-(s.context + chunk * tpf) // 64) * 64
            total += 2 * s.num_layers * s.num_heads * ring * s.head_dim * itemsize
    return total


def report(dtype: torch.dtype, chunk: int, context_duration: float, ages: list[float]) -> dict[str, object]:
    cfg = CodecConfig.from_dict(full_size_config(context_duration))
    with torch.device("meta"):
        codec = CodecModel(cfg, with_encoder=False)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    before = before_bytes(cfg, chunk, itemsize)
    geoms = geometries(codec, chunk, dtype)
    return {
        "codec": "full-size v2 shapes", "dtype": str(dtype).replace("torch.", ""), "chunk_frames": chunk,
        "context_duration_s": context_duration,
        "block_frames_per_stage": [g.block // g.tokens_per_frame for g in geoms.values()],
        "ring_blocks_per_stage": [g.ring_blocks for g in geoms.values()],
        "before_MB_any_age": round(before / 1e6, 1),
        "after_MB_by_age": {
            f"{a:g}s": round(stream_state_bytes(codec, chunk, dtype, frames=round(a * cfg.frame_rate)) / 1e6, 1)
            for a in ages
        },
        "after_MB_at_most": round(stream_state_bytes(codec, chunk, dtype) / 1e6, 1),
        "scratch_MB_once_per_decoder": round(scratch_state_bytes(codec, chunk, dtype) / 1e6, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--chunk", type=int, default=8, help="max chunk frames (the engine's CODEC_CHUNK_FRAMES)")
    ap.add_argument("--context-duration", type=float, default=10.0)
    ap.add_argument("--ages", default="2,10,60", help="take ages in seconds")
    args = ap.parse_args()
    ages = [float(a) for a in args.ages.split(",")]
    print(json.dumps(report(DTYPES[args.dtype], args.chunk, args.context_duration, ages), indent=2))


if __name__ == "__main__":
    main()
