"""Model benchmark (issue 3): load, 400-row prefill, per-frame decode at batch 1 and 32 with penalty 1.1.

On a CUDA machine:
    python bench/model_bench.py --out results.json [--upstream DIR]
writes a full-size (4.55B, bf16) random checkpoint in the real layout (or reuses --ckpt), loads it
with moss_rt's loader, and times our runner (CUDA graphs). With --upstream pointing at an unmodified
copy of OpenMOSS/MOSS-TTS's moss_tts_local_v1.5 folder it also times the upstream reference
``generate`` on the same weights and prompt. ``--tiny`` runs the same code on the tiny model (CPU
smoke test). Numbers go to stdout (one JSON object) and --out; a failing section is recorded as an
error and the rest still runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moss_rt.generation import SamplingParams  # noqa: E402
from moss_rt.model import ModelRunner, MossTTSConfig, load_model  # noqa: E402
from moss_rt.model.prompt import build_prompt_rows, load_tokenizer  # noqa: E402
from moss_rt.model.tiny import write_full_size_random_checkpoint, write_tiny_checkpoint  # noqa: E402

logger = logging.getLogger("model_bench")
PENALTY = SamplingParams(audio_repetition_penalty=1.1)  # 1.7 / 0.8 / 25 defaults + penalty 1.1
NO_PENALTY = SamplingParams()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompt_of(tokenizer, config: MossTTSConfig, rows: int, rng: np.random.Generator) -> np.ndarray:
    """A real-layout prompt of exactly ``rows`` rows: directed text plus a voice reference filling the rest."""
    text, instruction = "It was late, and the house was quiet.", "Tired, slow."
    one = build_prompt_rows(
        tokenizer, config, text=text, instruction=instruction, reference_codes=np.zeros((1, config.n_vq), np.int64)
    )
    ref = rng.integers(0, config.audio_vocab_size, size=(rows - len(one) + 1, config.n_vq))
    out = build_prompt_rows(tokenizer, config, text=text, instruction=instruction, reference_codes=ref)
    assert len(out) == rows, len(out)
    return out


def time_steps(runner: ModelRunner, slots: list[int], frames: int, prompt_len: int) -> dict[str, float]:
    """Per-frame wall time of runner.step (host sync included), each take restarted at the prompt's end."""
    for s in slots:
        runner.truncate(s, prompt_len)
    for _ in range(3):  # graph capture (if not done yet) and warm-up
        runner.step(slots)
    sync()
    per = []
    for _ in range(frames):
        t0 = time.perf_counter()
        result = runner.step(slots)
        per.append((time.perf_counter() - t0) * 1000.0)
        assert not result.stop.any(), "benchmark take stopped"
    arr = np.array(per)
    return {
        "ms_per_frame_mean": float(arr.mean()),
        "ms_per_frame_p50": float(np.median(arr)),
        "ms_per_frame_p90": float(np.percentile(arr, 90)),
        "frames": frames,
    }


def cuda_checks(args: argparse.Namespace, device: str = "cuda") -> dict:
    """On CUDA (fp32, graphs): the committed tiny fixture against the upstream golden greedy codes, and
    graph replay against the eager step."""
    fixtures = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "model"
    golden = np.load(fixtures / "golden.npz")
    cases = json.loads((fixtures / "golden_cases.json").read_text())
    case = next(c for c in cases["prompts"] if c["name"] == "directed")
    loaded = load_model(fixtures / "tiny", device=device, dtype=torch.float32)
    out: dict = {}
    for graphs in (True, False):
        runner = ModelRunner(
            loaded.model,
            loaded.tokenizer,
            loaded.config,
            max_slots=8,
            max_seq_len=320,
            device=device,
            dtype=torch.float32,
            use_cuda_graphs=graphs,
        )
        rows = runner.build_prompt(
            text=case["text"], instruction=case["instruction"], language=case["language"], tokens=case["tokens"]
        )
        slots = [runner.alloc_slot() for _ in range(8)]
        for s in slots:
            runner.prefill(s, rows if s == 0 else rows[:-s])
            runner.set_sampling(s, SamplingParams(audio_temperature=0.0, text_temperature=0.0), seed=s)
        alone = np.stack([runner.step([0]).codes[0] for _ in range(48)])
        out[f"greedy_matches_upstream_graphs_{graphs}"] = bool(np.array_equal(alone, golden["greedy_directed"]))
        # sampled takes with penalty, alone and in a batch of 8
        runner.truncate(0, len(rows))
        runner.set_sampling(0, PENALTY.replace(text_temperature=0.0), seed=5)
        solo = np.stack([runner.step([0]).codes[0] for _ in range(20)])
        for s in slots:
            runner.truncate(s, len(rows) if s == 0 else len(rows) - s)
            runner.set_sampling(s, PENALTY.replace(text_temperature=0.0), seed=5 if s == 0 else s)
        batch = np.stack([runner.step(slots).codes[0] for _ in range(20)])
        out[f"sampled_batch8_equals_alone_graphs_{graphs}"] = bool(np.array_equal(solo, batch))
        out[f"sampled_codes_graphs_{graphs}"] = solo[:3].tolist()
    out["graph_equals_eager"] = out["sampled_codes_graphs_True"] == out["sampled_codes_graphs_False"]
    return out


def bench_ours(args: argparse.Namespace, ckpt: Path, device: torch.device, dtype: torch.dtype) -> dict:
    res: dict = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loaded = load_model(ckpt, device=device, dtype=dtype)
    sync()
    res["load_s"] = time.perf_counter() - t0
    runner = ModelRunner(
        loaded.model,
        loaded.tokenizer,
        loaded.config,
        max_slots=args.batch,
        max_seq_len=args.max_seq_len,
        device=device,
        dtype=dtype,
    )
    rng = np.random.default_rng(0)
    rows = prompt_of(loaded.tokenizer, loaded.config, args.prompt_rows, rng)
    slots = [runner.alloc_slot() for _ in range(args.batch)]
    prefill_ms = []
    for _ in range(4):
        sync()
        t0 = time.perf_counter()
        runner.prefill(slots[0], rows)
        sync()
        prefill_ms.append((time.perf_counter() - t0) * 1000.0)
    res["prefill_400_ms_first"] = prefill_ms[0]
    res["prefill_400_ms"] = float(np.median(prefill_ms[1:]))
    # The tiny model's stop head fires ~1.6 %/frame: keep it greedy there so takes run the full length.
    penalty = PENALTY.replace(text_temperature=0.0) if args.tiny else PENALTY
    for i, s in enumerate(slots):
        runner.prefill(s, rows)
        runner.set_sampling(s, penalty, seed=i)
    t0 = time.perf_counter()
    runner.warmup(batch_sizes=[1, args.batch], key_lengths=[args.prompt_rows + args.frames + 4])
    sync()
    res["graph_capture_s"] = time.perf_counter() - t0
    n = args.prompt_rows
    res["batch1_penalty"] = time_steps(runner, [slots[0]], args.frames, n)
    res[f"batch{args.batch}_penalty"] = time_steps(runner, slots, args.frames, n)
    if args.batch >= 16:
        res["batch16_penalty"] = time_steps(runner, slots[:16], args.frames, n)
    runner.set_sampling(slots[0], NO_PENALTY.replace(text_temperature=0.0) if args.tiny else NO_PENALTY, seed=0)
    res["batch1_no_penalty"] = time_steps(runner, [slots[0]], args.frames, n)
    if device.type == "cuda":
        # the same step, eagerly (what the graphs save)
        runner.use_cuda_graphs = False
        res["batch1_eager"] = time_steps(runner, [slots[0]], 10, n)
        res[f"batch{args.batch}_eager"] = time_steps(runner, slots, 10, n)
        runner.use_cuda_graphs = True
        res["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        res["runner_state_gib"] = runner.state.nbytes() / 2**30
    del runner, loaded
    return res


def bench_upstream(args: argparse.Namespace, ckpt: Path, device: torch.device, dtype: torch.dtype) -> dict:
    """The unmodified upstream implementation on the same weights and prompt (imported, never copied)."""
    import transformers  # noqa: F401  (import before the torchaudio stand-in: transformers probes it)
    from safetensors.torch import load_file

    link = Path(tempfile.mkdtemp()) / "moss_local"
    link.symlink_to(Path(args.upstream).resolve())
    sys.path.insert(0, str(link.parent))
    sys.modules.setdefault("torchaudio", types.ModuleType("torchaudio"))
    from moss_local.configuration_moss_tts import MossTTSLocalConfig
    from moss_local.modeling_moss_tts import MossTTSLocalModel

    raw = json.loads((ckpt / "config.json").read_text())
    raw["attn_implementation"] = "sdpa"
    cfg = MossTTSLocalConfig(**raw)
    res: dict = {}
    t0 = time.perf_counter()
    with torch.device(device):
        model = MossTTSLocalModel(cfg).to(dtype).eval()
    state = load_file(str(ckpt / "model.safetensors"), device=str(device))
    model.load_state_dict(state, strict=False)
    del state
    sync()
    res["load_s"] = time.perf_counter() - t0
    # same prompt rows as ours (our builder is checked against theirs by the golden tests)
    rows = prompt_of(load_tokenizer(ckpt), MossTTSConfig.from_file(ckpt), args.prompt_rows, np.random.default_rng(0))
    ids = torch.as_tensor(rows, device=device)[None]
    mask = torch.ones(ids.shape[:2], dtype=torch.bool, device=device)

    def run(frames: int, penalty: float, batch: int = 1) -> float:
        sync()
        t = time.perf_counter()
        model.generate(
            input_ids=ids.expand(batch, -1, -1),
            attention_mask=mask.expand(batch, -1),
            max_new_frames=frames,
            audio_temperature=1.7,
            audio_top_p=0.8,
            audio_top_k=25,
            audio_repetition_penalty=penalty,
        )
        sync()
        return time.perf_counter() - t

    run(3, 1.0)  # warm-up
    for penalty in (1.0, 1.1):
        short, long = run(5, penalty), run(5 + args.upstream_frames, penalty)
        res[f"batch1_penalty{penalty}_ms_per_frame"] = (long - short) / args.upstream_frames * 1000.0
    if args.upstream_batch:
        short, long = run(3, 1.1, args.upstream_batch), run(3 + 10, 1.1, args.upstream_batch)
        res[f"batch{args.upstream_batch}_penalty1.1_ms_per_frame"] = (long - short) / 10 * 1000.0
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ckpt", type=Path, default=None, help="existing checkpoint folder (else one is written)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "moss_bench")
    parser.add_argument("--tiny", action="store_true", help="tiny model (smoke test on CPU)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-rows", type=int, default=400)
    parser.add_argument("--frames", type=int, default=100)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--upstream", type=Path, default=None, help="moss_tts_local_v1.5 folder to compare with")
    parser.add_argument("--upstream-frames", type=int, default=20)
    parser.add_argument("--upstream-batch", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    results: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "batch": args.batch,
        "prompt_rows": args.prompt_rows,
    }

    def save() -> None:
        text = json.dumps(results, indent=2)
        if args.out:
            args.out.write_text(text)
        print(text, flush=True)

    ckpt = args.ckpt
    if ckpt is None:
        ckpt = args.workdir / ("tiny" if args.tiny else "full")
        if not (ckpt / "model.safetensors").is_file():
            t0 = time.perf_counter()
            if args.tiny:
                write_tiny_checkpoint(ckpt)
            else:
                write_full_size_random_checkpoint(ckpt)
            results["write_checkpoint_s"] = time.perf_counter() - t0
    if cuda:
        try:
            results["cuda_checks"] = cuda_checks(args)
        except Exception as exc:
            results["cuda_checks"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        save()
    for name, fn in (("ours", bench_ours), ("upstream", bench_upstream)):
        if name == "upstream" and args.upstream is None:
            continue
        try:
            results[name] = fn(args, ckpt, device, dtype)
        except Exception as exc:  # keep what the other sections measured
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        if cuda:
            torch.cuda.empty_cache()
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
