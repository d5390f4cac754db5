"""Configuration of MOSS-Audio-Tokenizer-v2, parsed from the checkpoint's ``config.json``.

Field names are the ones the real checkpoint uses (``sampling_rate``, ``downsample_rate``,
``causal_transformer_context_duration``, ``encoder_kwargs``, ``decoder_kwargs``,
``number_channels``, ``enable_channel_interleave``, ``quantizer_type``, ``quantizer_kwargs``),
plus the legacy aliases upstream accepts (``sample_rate``, ``channels_numbers``).

Only the features v2 actually uses are supported (causal layer-norm transformers with RoPE,
no gating, patch pretransforms, residual LFQ). Anything else raises :class:`CodecConfigError`
at parse time instead of silently computing something different.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CodecConfig",
    "CodecConfigError",
    "PatchSpec",
    "QuantizerSpec",
    "TransformerSpec",
    "StageSpec",
]


class CodecConfigError(ValueError):
    """config.json describes a codec this implementation does not support, or is malformed."""


@dataclass(frozen=True)
class PatchSpec:
    """Weightless patch fold/unfold (``module_type: PatchedPretransform``).

    ``patch_size`` consecutive time steps are folded into channels (encoder) or unfolded
    from channels (decoder), channel-major: folded channel ``c * patch_size + o`` holds
    time step ``t * patch_size + o`` of channel ``c``.
    """

    patch_size: int


@dataclass(frozen=True)
class TransformerSpec:
    """One ``ProjectedTransformer`` stage (``module_type: Transformer``).

    ``context`` is the causal local attention window in tokens of this stage:
    a query at position p sees keys at positions p - context + 1 .. p.
    ``rate_hz`` is the token rate of this stage (tokens per second of audio).
    """

    input_dimension: int
    output_dimension: int
    d_model: int
    num_heads: int
    num_layers: int
    dim_feedforward: int
    max_period: float
    layer_scale: float | None
    context: int
    rate_hz: float

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


StageSpec = PatchSpec | TransformerSpec


@dataclass(frozen=True)
class QuantizerSpec:
    """Residual LFQ: ``input_dim`` → ``rvq_dim`` → per level ``codebook_dim`` → ``output_dim``."""

    input_dim: int
    rvq_dim: int
    output_dim: int
    num_quantizers: int
    codebook_size: int
    codebook_dim: int


@dataclass(frozen=True)
class CodecConfig:
    """Parsed codec configuration (see module docstring)."""

    sampling_rate: int
    downsample_rate: int
    number_channels: int
    enable_channel_interleave: bool
    context_duration: float
    encoder: tuple[StageSpec, ...]
    decoder: tuple[StageSpec, ...]
    quantizer: QuantizerSpec
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def interleave_factor(self) -> int:
        """How many channels are sample-interleaved into the single codec stream."""
        return self.number_channels if (self.enable_channel_interleave and self.number_channels > 1) else 1

    @property
    def frame_rate(self) -> float:
        """Code frames per second (12.5 for v2)."""
        return self.sampling_rate / self.downsample_rate

    @property
    def samples_per_frame(self) -> int:
        """Audio samples per channel per code frame (3840 for v2)."""
        return self.downsample_rate

    @property
    def tokens_per_frame_decoder(self) -> list[int]:
        """Tokens per code frame at each decoder transformer stage, in execution order."""
        return [int(round(s.rate_hz / self.frame_rate)) for s in self.decoder if isinstance(s, TransformerSpec)]

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> CodecConfig:
        """Parse a config.json dict. Raises CodecConfigError on unsupported or malformed input."""
        try:
            return _parse(cfg)
        except CodecConfigError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise CodecConfigError(f"malformed codec config: {exc!r}") from exc

    @classmethod
    def from_file(cls, path: str | Path) -> CodecConfig:
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))


def _parse(cfg: dict[str, Any]) -> CodecConfig:
    sampling_rate = int(cfg.get("sampling_rate", cfg.get("sample_rate", 48000)))
    downsample_rate = int(cfg.get("downsample_rate", 3840))
    if "number_channels" in cfg:
        number_channels = int(cfg["number_channels"])
    elif "channels_numbers" in cfg:
        number_channels = int(cfg["channels_numbers"])
    else:
        # v1 checkpoints have no channel key; this package implements v2 only.
        raise CodecConfigError("config has no 'number_channels': this looks like a v1 (mono) codec, not v2")
    interleave = bool(cfg.get("enable_channel_interleave", True))
    context_duration = float(cfg.get("causal_transformer_context_duration", 10.0))

    qkw = dict(cfg.get("quantizer_kwargs") or {})
    qtype = qkw.get("quantizer_type", cfg.get("quantizer_type", "rlfq"))
    if qtype not in ("rlfq", "random_prefix_rlfq"):
        raise CodecConfigError(f"unsupported quantizer_type {qtype!r} (only residual LFQ is implemented)")
    input_dim = int(qkw.get("input_dim", 768))
    quantizer = QuantizerSpec(
        input_dim=input_dim,
        rvq_dim=int(qkw.get("rvq_dim") or input_dim),
        output_dim=int(qkw.get("output_dim") or input_dim),
        num_quantizers=int(qkw.get("num_quantizers", 32)),
        codebook_size=int(qkw.get("codebook_size", 1024)),
        codebook_dim=int(qkw.get("codebook_dim", 8)),
    )
    if quantizer.rvq_dim in (quantizer.input_dim, quantizer.output_dim) or quantizer.codebook_dim == quantizer.rvq_dim:
        # Upstream swaps equal-dim projections for Identity; v2 never has equal dims and
        # the checkpoint then lacks those tensors. Refuse instead of guessing.
        raise CodecConfigError("quantizer with identity projections (equal dims) is not supported")

    factor = number_channels if (interleave and number_channels > 1) else 1
    rate = float(sampling_rate * factor)
    encoder: list[StageSpec] = []
    for i, kw in enumerate(cfg["encoder_kwargs"]):
        spec = _parse_stage(kw, rate, context_duration, where=f"encoder_kwargs[{i}]")
        encoder.append(spec)
        if isinstance(spec, PatchSpec):
            rate /= spec.patch_size
    decoder: list[StageSpec] = []
    for i, kw in enumerate(cfg["decoder_kwargs"]):
        spec = _parse_stage(kw, rate, context_duration, where=f"decoder_kwargs[{i}]")
        decoder.append(spec)
        if isinstance(spec, PatchSpec):
            rate *= spec.patch_size
    if int(round(rate)) != int(round(sampling_rate * factor)):
        raise CodecConfigError(f"decoder does not invert the encoder rate: ends at {rate} Hz")

    enc_down = math.prod(s.patch_size for s in encoder if isinstance(s, PatchSpec))
    if enc_down != downsample_rate * factor:
        raise CodecConfigError(
            f"encoder patch product {enc_down} != downsample_rate*channels {downsample_rate * factor}"
        )
    _check_dims(encoder, first_in=1, last_out=quantizer.input_dim, side="encoder")
    _check_dims(decoder, first_in=quantizer.output_dim, last_out=1, side="decoder")
    return CodecConfig(
        sampling_rate=sampling_rate,
        downsample_rate=downsample_rate,
        number_channels=number_channels,
        enable_channel_interleave=interleave,
        context_duration=context_duration,
        encoder=tuple(encoder),
        decoder=tuple(decoder),
        quantizer=quantizer,
        raw=dict(cfg),
    )


def _parse_stage(kw: dict[str, Any], rate: float, default_duration: float, where: str) -> StageSpec:
    mtype = kw.get("module_type")
    if mtype == "PatchedPretransform":
        return PatchSpec(patch_size=int(kw["patch_size"]))
    if mtype != "Transformer":
        raise CodecConfigError(f"{where}: unsupported module_type {mtype!r}")
    # Reject every option that would change the maths we implement.
    checks = {
        "causal": (kw.get("causal", False), True),
        "norm": (kw.get("norm", "layer_norm"), "layer_norm"),
        "positional_embedding": (kw.get("positional_embedding", "sin"), "rope"),
        "gating": (kw.get("gating", "none"), "none"),
    }
    for name, (got, want) in checks.items():
        if got != want:
            raise CodecConfigError(f"{where}: {name}={got!r} is not supported (need {want!r})")
    if kw.get("weights_per_step"):
        raise CodecConfigError(f"{where}: weights_per_step is not supported")
    if kw.get("conv_layout", True) is not True:
        raise CodecConfigError(f"{where}: conv_layout=False is not supported")
    d_model = int(kw["d_model"])
    num_heads = int(kw["num_heads"])
    if d_model % num_heads or (d_model // num_heads) % 2:
        raise CodecConfigError(f"{where}: d_model {d_model} / heads {num_heads} must give an even head_dim")
    duration = float(kw.get("context_duration", default_duration))
    context = int(round(rate * duration))
    if context < 1:
        raise CodecConfigError(f"{where}: attention window rounds to {context} tokens")
    ls = kw.get("layer_scale")
    return TransformerSpec(
        input_dimension=int(kw["input_dimension"]),
        output_dimension=int(kw["output_dimension"]),
        d_model=d_model,
        num_heads=num_heads,
        num_layers=int(kw["num_layers"]),
        dim_feedforward=int(kw.get("dim_feedforward", 2048)),
        max_period=float(kw.get("max_period", 10000)),
        layer_scale=None if ls is None else float(ls),
        context=context,
        rate_hz=rate,
    )


def _check_dims(stages: list[StageSpec], first_in: int, last_out: int, side: str) -> None:
    """Walk the channel counts through the stack so a bad config fails here, not mid-forward."""
    ch = first_in
    for i, s in enumerate(stages):
        if isinstance(s, PatchSpec):
            if side == "encoder":
                ch *= s.patch_size
            else:
                if ch % s.patch_size:
                    raise CodecConfigError(f"{side}[{i}]: {ch} channels not divisible by patch {s.patch_size}")
                ch //= s.patch_size
        else:
            if s.input_dimension != ch:
                raise CodecConfigError(f"{side}[{i}]: input_dimension {s.input_dimension} != incoming {ch}")
            ch = s.output_dimension
    if ch != last_out:
        raise CodecConfigError(f"{side}: ends with {ch} channels, expected {last_out}")
