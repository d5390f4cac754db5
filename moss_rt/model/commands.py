"""CLI entry points of the model package, wired into ``python -m moss_rt`` by moss_rt/cli.py.

``make_tiny_command(args)``: args.dir (Path), args.seed (int), optional args.dtype ("fp32"|"bf16").
``say_codes_command(args)``: args.model, args.text, args.instruction, args.language, args.reference
("none" or a .npy file of [T,12] codes), args.seed, args.tokens, args.temperature, args.max_new_tokens,
args.codes_out, args.device, optional args.codec + args.output (WAV through the codec), args.channels.
Both return a process exit code; they print a one-line summary (CLI output).
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
import time
from pathlib import Path

import numpy as np
import torch

from moss_rt.generation import SamplingParams
from moss_rt.model.loader import ModelSourceError, load_model
from moss_rt.model.prompt import build_prompt_rows
from moss_rt.model.runner import ModelRunner

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def make_tiny_command(args: argparse.Namespace) -> int:
    from moss_rt.model.tiny import write_tiny_checkpoint

    dtype = _DTYPES[str(getattr(args, "dtype", None) or "fp32")]
    folder = write_tiny_checkpoint(Path(args.dir), seed=int(getattr(args, "seed", 0) or 0), dtype=dtype)
    print(f"wrote tiny random MOSS-TTS-Local checkpoint to {folder}")
    return 0


def say_codes_command(args: argparse.Namespace) -> int:
    """Generate one take with the model alone; save its codes [T,12] (and a WAV when a codec is given)."""
    device = torch.device(getattr(args, "device", "cpu") or "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        loaded = load_model(args.model, device=device, dtype=dtype)
    except (ModelSourceError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    reference = None
    ref_arg = str(getattr(args, "reference", "none") or "none")
    if ref_arg.lower() != "none":
        if not ref_arg.endswith(".npy"):
            print("error: with --model, --reference must be 'none' or a .npy file of [T,12] codes", file=sys.stderr)
            return 2
        reference = np.load(ref_arg)
    max_frames = int(getattr(args, "max_new_tokens", None) or 4096)
    temperature = getattr(args, "temperature", None)
    params = SamplingParams()
    if temperature is not None:
        # --temperature 0 is fully greedy: the stop head too, like upstream do_sample=False.
        params = params.replace(audio_temperature=float(temperature))
        if float(temperature) == 0.0:
            params = params.replace(text_temperature=0.0)
    seed = args.seed if getattr(args, "seed", None) is not None else secrets.randbits(31)
    rows = build_prompt_rows(
        loaded.tokenizer,
        loaded.config,
        text=args.text,
        instruction=getattr(args, "instruction", "") or "",
        language=getattr(args, "language", "") or "",
        tokens=getattr(args, "tokens", None),
        reference_codes=reference,
    )
    runner = ModelRunner(
        loaded.model,
        loaded.tokenizer,
        loaded.config,
        max_slots=1,
        max_seq_len=len(rows) + max_frames + 1,
        device=device,
        dtype=dtype,
    )
    slot = runner.alloc_slot()
    t0 = time.perf_counter()
    runner.prefill(slot, rows)
    runner.set_sampling(slot, params, seed)
    frames: list[np.ndarray] = []
    reason = "max_frames"
    for _ in range(max_frames):
        result = runner.step([slot])
        if result.stop[0]:
            reason = "done"
            break
        frames.append(result.codes[0])
    codes = np.stack(frames) if frames else np.zeros((0, loaded.config.n_vq), dtype=np.int64)
    seconds = time.perf_counter() - t0
    if getattr(args, "codes_out", None):
        np.save(args.codes_out, codes)
    wrote = _maybe_write_wav(args, codes, device)
    print(
        f"{len(codes)} frames ({len(codes) * 0.08:.2f} s of audio, {reason}) in {seconds:.2f} s, seed {seed}"
        + (f", codes -> {args.codes_out}" if getattr(args, "codes_out", None) else "")
        + (f", audio -> {wrote}" if wrote else "")
        + (" [tiny random model: noise]" if loaded.source.demo else "")
    )
    return 0


def _maybe_write_wav(args: argparse.Namespace, codes: np.ndarray, device: torch.device) -> Path | None:
    codec_src = getattr(args, "codec", None)
    output = getattr(args, "output", None)
    if not codec_src or not output or len(codes) == 0:
        return None
    from moss_rt.audio import to_int16_pcm, wav_bytes
    from moss_rt.codec.loader import load_codec

    codec = load_codec(codec_src, device=device, decode_only=True)
    audio = codec.decode(torch.as_tensor(codes, device=device)[None])[0].cpu().numpy()
    channels = int(getattr(args, "channels", 1) or 1)
    Path(output).write_bytes(wav_bytes(to_int16_pcm(audio, channels), codec.config.sampling_rate, channels))
    return Path(output)
