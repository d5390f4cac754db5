"""Decode step time of the model runner: paged KV cache (this tree) vs the contiguous cache (an older tree).

    PYTHONPATH=<tree> python bench/paged_step_bench.py --model <full-size checkpoint> --label paged
runs ``ModelRunner.step`` (CUDA graphs, bf16) for batch sizes x context lengths and prints one JSON line of
ms per frame (mean of 30 steps after the same 30 + 5 untimed, which capture every graph they use: a
key-length bucket crossed inside the timed steps used to time a capture, and a Triton compile, too). Whichever
``moss_rt`` is first on PYTHONPATH is measured, so the same script times both designs.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--contexts", default="600,1800")
    args = ap.parse_args()
    import moss_rt
    from moss_rt.model import ModelRunner, load_model
    from moss_rt.protocol.messages import SamplingParams

    loaded = load_model(args.model, device="cuda", dtype=torch.bfloat16)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    runner = ModelRunner(loaded.model, loaded.tokenizer, loaded.config, max_slots=max(batches),
                         max_seq_len=max(contexts) + 64, device="cuda", dtype=torch.bfloat16)
    rng = np.random.default_rng(0)
    cfg = loaded.config
    slots = [runner.alloc_slot() for _ in range(max(batches))]
    out: dict[str, object] = {"label": args.label, "moss_rt": moss_rt.__file__,
                              "state_gib": round(runner.state.nbytes() / 2**30, 2)}
    sampling = SamplingParams(audio_repetition_penalty=1.1)
    for ctx in contexts:
        for s in slots:
            rows = np.full((ctx, 13), cfg.audio_pad_token_id, dtype=np.int64)
            rows[:, 0] = rng.integers(0, 1000, ctx)
            runner.prefill(s, rows)
            runner.set_sampling(s, sampling, int(s))
        for b in batches:
            active = slots[:b]
            for s in active:
                runner.truncate(s, ctx)
            for _ in range(35):  # untimed: captures (and compiles) every graph the timed steps use
                runner.step(active)
            for s in active:
                runner.truncate(s, ctx)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(30):
                runner.step(active)
            torch.cuda.synchronize()
            out[f"b{b}_ctx{ctx}_ms"] = round((time.perf_counter() - t0) / 30 * 1000, 2)
    out["peak_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
