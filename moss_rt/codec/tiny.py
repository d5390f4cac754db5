"""Random-weight codecs written in the real on-disk layout (config.json + sharded safetensors + index).

``write_tiny_codec`` keeps every structural feature of v2 (48 kHz stereo interleave, 12 + 12 modules,
patch ladder 240·2^5, causal local windows, 32-level residual LFQ with 1024-entry codebooks) at toy
width, with 0.16 s attention windows so short test clips already cross every window
(decoder windows 2, 4, 8, 16, 32, 64 tokens).

``write_full_size_random_codec`` writes the real shapes (2.1 B parameters fp32; decoder-only ≈ 4.2 GB)
for benchmarks. Audio from either is noise.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .config import CodecConfig, TransformerSpec

__all__ = [
    "checkpoint_manifest",
    "full_size_config",
    "tiny_config",
    "write_codec",
    "write_full_size_random_codec",
    "write_tiny_codec",
]

log = logging.getLogger(__name__)

_TRANSFORMER_COMMON = {
    "causal": True,
    "norm": "layer_norm",
    "positional_embedding": "rope",
    "max_period": 10000,
    "gating": "none",
    "layer_scale": 0.01,
    "conv_layout": True,
}


def _t(i: int, o: int, d: int, heads: int, layers: int, ff: int) -> dict[str, Any]:
    return {
        "module_type": "Transformer",
        "input_dimension": i,
        "output_dimension": o,
        "d_model": d,
        "num_heads": heads,
        "num_layers": layers,
        "dim_feedforward": ff,
        **_TRANSFORMER_COMMON,
    }


def _p(n: int) -> dict[str, Any]:
    return {"module_type": "PatchedPretransform", "patch_size": n}


def _config(enc: list[dict[str, Any]], dec: list[dict[str, Any]], q: dict[str, Any], duration: float) -> dict[str, Any]:
    return {
        "architectures": ["MossAudioTokenizerModel"],
        "model_type": "moss-audio-tokenizer",
        "version": "v2",
        "sampling_rate": 48000,
        "downsample_rate": 3840,
        "number_channels": 2,
        "enable_channel_interleave": True,
        "causal_transformer_context_duration": duration,
        "attention_implementation": "sdpa",
        "compute_dtype": "fp32",
        "codec_weight_dtype": "fp32",
        "quantizer_type": "rlfq",
        "quantizer_kwargs": {**q, "quantizer_type": "rlfq"},
        "encoder_kwargs": enc,
        "decoder_kwargs": dec,
        "torch_dtype": "float32",
    }


def tiny_config(context_duration: float = 0.16) -> dict[str, Any]:
    """Config dict of the tiny codec (section 8.3 of the internals doc; two layers in the 12.5 Hz stages)."""
    d, h, ff = 32, 2, 64
    enc = [
        _p(240), _t(240, 12, d, h, 1, ff), _p(2), _t(24, 12, d, h, 1, ff), _p(2), _t(24, 12, d, h, 1, ff),
        _p(2), _t(24, 12, d, h, 1, ff), _p(2), _t(24, 20, d, h, 1, ff), _p(2), _t(40, 32, d, h, 2, ff),
    ]
    dec = [
        _t(32, 40, d, h, 2, ff), _p(2), _t(20, 24, d, h, 1, ff), _p(2), _t(12, 24, d, h, 1, ff),
        _p(2), _t(12, 24, d, h, 1, ff), _p(2), _t(12, 24, d, h, 1, ff), _p(2), _t(12, 240, d, h, 1, ff), _p(240),
    ]
    q = {"input_dim": 32, "rvq_dim": 16, "output_dim": 32, "num_quantizers": 32, "codebook_size": 1024,
         "codebook_dim": 8}
    return _config(enc, dec, q, context_duration)


def full_size_config(context_duration: float = 10.0) -> dict[str, Any]:
    """Config dict with the real v2 shapes (section 5.3). v2's real context duration is not published;
    10 s is the upstream default."""
    big = (1280, 20, 32, 5120)
    enc = [_p(240), _t(240, 384, 768, 12, 12, 3072)]
    for o in (384, 384, 384, 640):
        enc += [_p(2), _t(768, o, 768, 12, 12, 3072)]
    enc += [_p(2), _t(1280, 768, *big)]
    dec = [_t(768, 1280, *big), _p(2), _t(640, 768, 768, 12, 12, 3072)]
    for o in (768, 768, 768, 240):
        dec += [_p(2), _t(384, o, 768, 12, 12, 3072)]
    dec += [_p(240)]
    q = {"input_dim": 768, "rvq_dim": 512, "output_dim": 768, "num_quantizers": 32, "codebook_size": 1024,
         "codebook_dim": 8}
    return _config(enc, dec, q, context_duration)


def checkpoint_manifest(cfg: CodecConfig, *, with_encoder: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor key of a v2 checkpoint for ``cfg`` and its shape (no data), in the writer's order."""
    out: dict[str, tuple[int, ...]] = {}

    def stage(prefix: str, s: TransformerSpec) -> None:
        d = s.d_model
        out[f"{prefix}.input_proj.weight"] = (d, s.input_dimension)
        out[f"{prefix}.output_proj.weight"] = (s.output_dimension, d)
        for li in range(s.num_layers):
            p = f"{prefix}.transformer.layers.{li}"
            for n in ("norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias"):
                out[f"{p}.{n}"] = (d,)
            out[f"{p}.self_attn.in_proj.weight"] = (3 * d, d)
            out[f"{p}.self_attn.out_proj.weight"] = (d, d)
            out[f"{p}.ffn.0.weight"] = (s.dim_feedforward, d)
            out[f"{p}.ffn.2.weight"] = (d, s.dim_feedforward)
            out[f"{p}.layer_scale_1.scale"] = (d,)
            out[f"{p}.layer_scale_2.scale"] = (d,)

    def wn_conv(prefix: str, o: int, i: int) -> None:
        out[f"{prefix}.parametrizations.weight.original0"] = (o, 1, 1)
        out[f"{prefix}.parametrizations.weight.original1"] = (o, i, 1)
        out[f"{prefix}.bias"] = (o,)

    if with_encoder:
        for idx, s in enumerate(cfg.encoder):
            if isinstance(s, TransformerSpec):
                stage(f"encoder.{idx}", s)
    q = cfg.quantizer
    if with_encoder:
        wn_conv("quantizer.input_proj", q.rvq_dim, q.input_dim)
    wn_conv("quantizer.output_proj", q.output_dim, q.rvq_dim)
    for li in range(q.num_quantizers):
        p = f"quantizer.quantizers.{li}"
        wn_conv(f"{p}.in_proj", q.codebook_dim, q.rvq_dim)
        wn_conv(f"{p}.out_proj", q.rvq_dim, q.codebook_dim)
        out[f"{p}.codebook.weight"] = (q.codebook_size, q.codebook_dim)
    for idx, s in enumerate(cfg.decoder):
        if isinstance(s, TransformerSpec):
            stage(f"decoder.{idx}", s)
    return out


def _random_tensors(cfg: CodecConfig, gen: torch.Generator, *, with_encoder: bool) -> dict[str, torch.Tensor]:
    """Random fp32 tensors under the real checkpoint keys.

    Linear weights ~ N(0, 1/fan_in) keep activations O(1); LayerScale is drawn in [0.5, 1) rather than
    the 0.01 init so attention visibly shapes the output (a window bug then shows up in tests).
    """
    out: dict[str, torch.Tensor] = {}

    def lin(o: int, i: int) -> torch.Tensor:
        return torch.randn(o, i, generator=gen) / i**0.5

    def stage(prefix: str, s: TransformerSpec) -> None:
        d = s.d_model
        out[f"{prefix}.input_proj.weight"] = lin(d, s.input_dimension)
        out[f"{prefix}.output_proj.weight"] = lin(s.output_dimension, d)
        for li in range(s.num_layers):
            p = f"{prefix}.transformer.layers.{li}"
            out[f"{p}.norm1.weight"] = 1 + 0.1 * torch.randn(d, generator=gen)
            out[f"{p}.norm1.bias"] = 0.1 * torch.randn(d, generator=gen)
            out[f"{p}.norm2.weight"] = 1 + 0.1 * torch.randn(d, generator=gen)
            out[f"{p}.norm2.bias"] = 0.1 * torch.randn(d, generator=gen)
            out[f"{p}.self_attn.in_proj.weight"] = lin(3 * d, d) * 2.0  # sharper attention than 1/fan_in
            out[f"{p}.self_attn.out_proj.weight"] = lin(d, d)
            out[f"{p}.ffn.0.weight"] = lin(s.dim_feedforward, d)
            out[f"{p}.ffn.2.weight"] = lin(d, s.dim_feedforward)
            out[f"{p}.layer_scale_1.scale"] = 0.5 + 0.5 * torch.rand(d, generator=gen)
            out[f"{p}.layer_scale_2.scale"] = 0.5 + 0.5 * torch.rand(d, generator=gen)

    def wn_conv(prefix: str, o: int, i: int) -> None:
        v = torch.randn(o, i, 1, generator=gen)
        # g = ||v|| * 1/sqrt(i) * jitter, so the folded weight is ~ N(0, 1/i) and folding is non-trivial.
        g = v.flatten(1).norm(dim=1).view(o, 1, 1) / i**0.5 * (0.5 + torch.rand(o, 1, 1, generator=gen))
        out[f"{prefix}.parametrizations.weight.original0"] = g
        out[f"{prefix}.parametrizations.weight.original1"] = v
        out[f"{prefix}.bias"] = 0.05 * torch.randn(o, generator=gen)

    if with_encoder:
        for idx, s in enumerate(cfg.encoder):
            if isinstance(s, TransformerSpec):
                stage(f"encoder.{idx}", s)
    q = cfg.quantizer
    if with_encoder:
        wn_conv("quantizer.input_proj", q.rvq_dim, q.input_dim)
    wn_conv("quantizer.output_proj", q.output_dim, q.rvq_dim)
    for li in range(q.num_quantizers):
        p = f"quantizer.quantizers.{li}"
        wn_conv(f"{p}.in_proj", q.codebook_dim, q.rvq_dim)
        wn_conv(f"{p}.out_proj", q.rvq_dim, q.codebook_dim)
        out[f"{p}.codebook.weight"] = torch.randn(q.codebook_size, q.codebook_dim, generator=gen)
    last = 0
    for idx, s in enumerate(cfg.decoder):
        if isinstance(s, TransformerSpec):
            stage(f"decoder.{idx}", s)
            last = idx
    # Bring the waveform to audio scale (|x| ~ 1) so absolute tolerances in tests mean something.
    out[f"decoder.{last}.output_proj.weight"] *= 0.02
    return out


def write_codec(
    directory: str | os.PathLike[str],
    config: dict[str, Any],
    *,
    seed: int = 0,
    num_shards: int = 3,
    with_encoder: bool = True,
) -> Path:
    """Write random weights for ``config`` as ``model-0000k-of-0000n.safetensors`` + index + config.json."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    parsed = CodecConfig.from_dict(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = _random_tensors(parsed, gen, with_encoder=with_encoder)
    keys = list(tensors)  # creation order: encoder, quantizer, decoder — like the real shards
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    per = total / max(1, num_shards)
    groups: list[list[str]] = [[]]
    acc = 0
    for k in keys:
        nbytes = tensors[k].numel() * tensors[k].element_size()
        if groups[-1] and acc + nbytes > per * len(groups) and len(groups) < num_shards:
            groups.append([])
        groups[-1].append(k)
        acc += nbytes
    n = len(groups)
    weight_map: dict[str, str] = {}
    for gi, group in enumerate(groups):
        name = f"model-{gi + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in group}, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in group})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    # The marker lets the service label a random-weight codec honestly (its audio is noise).
    marked = {**config, "moss_rt_random_weights": True}
    (folder / "config.json").write_text(json.dumps(marked, indent=2) + "\n", encoding="utf-8")
    log.info("wrote random codec (%d tensors, %.1f MB, %d shards) to %s", len(tensors), total / 1e6, n, folder)
    return folder


def write_tiny_codec(directory: str | os.PathLike[str], seed: int = 0, context_duration: float = 0.16) -> Path:
    """Tiny random codec in the real layout (≈1.4 MB; 3 shards)."""
    return write_codec(directory, tiny_config(context_duration), seed=seed, num_shards=3)


def write_full_size_random_codec(
    directory: str | os.PathLike[str], *, seed: int = 0, with_encoder: bool = True, context_duration: float = 10.0
) -> Path:
    """Full-size random codec (real shapes) for benchmarks. ``with_encoder=False`` writes only what
    decoding needs (≈4.2 GB instead of 8.5 GB); load it with ``decode_only=True``."""
    return write_codec(
        directory, full_size_config(context_duration), seed=seed, num_shards=3, with_encoder=with_encoder
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m moss_rt.codec.tiny OUT_DIR [--full-size] [--decode-only] [--seed N]``."""
    import argparse

    ap = argparse.ArgumentParser(description="write a random-weight MOSS-Audio-Tokenizer-v2 in the real layout")
    ap.add_argument("out_dir")
    ap.add_argument("--full-size", action="store_true", help="real shapes (8.5 GB; 4.2 GB with --decode-only)")
    ap.add_argument("--decode-only", action="store_true", help="full size: skip the encoder tensors")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.full_size:
        write_full_size_random_codec(args.out_dir, seed=args.seed, with_encoder=not args.decode_only)
    else:
        write_tiny_codec(args.out_dir, seed=args.seed)


if __name__ == "__main__":
    main()
