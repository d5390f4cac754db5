"""One fixed multi-take scenario on the tiny model, used to check the paged KV cache against the codes the
contiguous cache (one max_seq_len row per slot, the design before paging) produced.

``python -m tests.model.paged_scenario`` rewrote ``tests/fixtures/model/contiguous_codes.npz`` once, with the
contiguous cache of commit 71f6f37 (the last before paging); the file is not to be regenerated with the
paged cache, or the comparison would prove nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from moss_rt.generation import SamplingParams
from moss_rt.model import ModelRunner, load_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "model"
GOLDEN = FIXTURES / "contiguous_codes.npz"


def run_scenario(runner: ModelRunner) -> dict[str, np.ndarray]:
    """Three takes with different prompts and seeds stepping together, one truncated (a seek) and continued,
    one freed mid-way and its slot reused; returns every step's codes per take."""
    sampling = SamplingParams(audio_temperature=1.0, audio_top_k=25, audio_top_p=0.9, audio_repetition_penalty=1.1,
                              text_temperature=0.0)
    texts = ["Hello there.", "A somewhat longer line of text to speak, with a comma.", "Short."]
    slots = [runner.alloc_slot() for _ in texts]
    prompts = [runner.build_prompt(text=t, instruction="Calm.") for t in texts]
    for slot, prompt, seed in zip(slots, prompts, (11, 22, 33), strict=True):
        runner.prefill(slot, prompt)
        runner.set_sampling(slot, sampling, seed)
    out: dict[str, list[np.ndarray]] = {"a": [], "b": [], "c": [], "d": [], "a2": []}
    for _ in range(20):
        res = runner.step(slots)
        for key, codes in zip("abc", res.codes, strict=True):
            out[key].append(codes)
    # A seek: take a back to frame 7 and continue it with another seed.
    a = slots[0]
    runner.truncate(a, len(prompts[0]) + 7)
    history = np.stack(out["a"][:7])
    runner.set_sampling(a, sampling, 44, frame_index=7, history=history)
    # c ends; d takes its slot with a fresh prompt.
    runner.free_slot(slots[2])
    d = runner.alloc_slot()
    prompt_d = runner.build_prompt(text="Another take in a reused slot.", instruction="")
    runner.prefill(d, prompt_d)
    runner.set_sampling(d, sampling, 55)
    for _ in range(25):
        res = runner.step([a, slots[1], d])
        for key, codes in zip(("a2", "b", "d"), res.codes, strict=True):
            out[key].append(codes)
    return {k: np.stack(v) for k, v in out.items()}


def make_runner(max_slots: int = 4, max_seq_len: int = 320, **paging: int) -> ModelRunner:
    loaded = load_model(FIXTURES / "tiny", device="cpu", dtype=torch.float32)
    return ModelRunner(loaded.model, loaded.tokenizer, loaded.config, max_slots=max_slots, max_seq_len=max_seq_len,
                       device="cpu", dtype=torch.float32, **paging)


if __name__ == "__main__":
    torch.set_num_threads(1)
    codes = run_scenario(make_runner())
    np.savez_compressed(GOLDEN, **codes)
    print(f"wrote {GOLDEN}: " + ", ".join(f"{k} {v.shape}" for k, v in codes.items()))
