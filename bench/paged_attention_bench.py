"""Decode attention alone: the Triton paged kernel vs the gather path (gather + grouped_attention).

    python bench/paged_attention_bench.py [--batches 1,2,4,8,16,32,64,128] [--keys 1024]
Full-size backbone shapes (32 query heads, 8 KV heads, head_dim 128, bf16), keys spread over a shuffled pool of
16-position blocks; each variant is captured 36 times (one per layer) in a CUDA graph and replayed, so launch
overhead is what the decode step pays. Prints one JSON line of microseconds per layer.
"""

from __future__ import annotations

import argparse
import json

import torch

from moss_rt.model.layers import grouped_attention
from moss_rt.model.paged_attention import paged_decode_attention


def _time(fn, reps: int = 36, replays: int = 20) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--keys", type=int, default=1024)
    args = ap.parse_args()
    hq, hkv, dim, block, dev, dt = 32, 8, 128, 16, "cuda", torch.bfloat16
    keys = args.keys
    out: dict[str, object] = {"keys": keys}
    for batch in [int(b) for b in args.batches.split(",")]:
        blocks = batch * (keys // block) + 1
        k = torch.randn(blocks * block, hkv, dim, device=dev, dtype=dt)
        v = torch.randn_like(k)
        q = torch.randn(batch, hq, dim, device=dev, dtype=dt)
        table = torch.randperm(blocks - 1, device=dev)[: batch * (keys // block)].view(batch, -1) + 1
        s = torch.arange(keys, device=dev)
        pos = table[:, s // block] * block + s % block
        mask = torch.ones(batch, keys, dtype=torch.bool, device=dev)
        read = pos[:, None, :] * hkv + torch.arange(hkv, device=dev)[None, :, None]

        def gather(q=q, k=k, v=v, read=read, mask=mask) -> torch.Tensor:  # type: ignore[no-untyped-def]
            kk, vv = k.view(-1, dim)[read], v.view(-1, dim)[read]
            return grouped_attention(q[:, None], kk, vv, mask[:, None], dim**-0.5)

        def kernel(q=q, k=k, v=v, pos=pos, mask=mask) -> torch.Tensor:  # type: ignore[no-untyped-def]
            return paged_decode_attention(q, k, v, pos, mask, dim**-0.5)

        out[f"b{batch}_gather_us"] = round(_time(gather), 1)
        out[f"b{batch}_kernel_us"] = round(_time(kernel), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
