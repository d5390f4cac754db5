"""The codec network: encoder stack, residual LFQ quantizer, decoder stack (whole-clip paths).

Stereo at 48 kHz is carried as one sample-interleaved stream (L0, R0, L1, R1, ... = 96 kHz mono)
through both stacks. One code frame = ``downsample_rate`` (3840) samples per channel = 80 ms.

The whole-clip ``decode`` here is the reference the streaming decoder (``streaming.py``) is tested
against; it shares the layer maths but not the cache/mask logic.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from .config import CodecConfig, PatchSpec, TransformerSpec
from .modules import ProjectedTransformer, patch_fold, patch_unfold
from .quantizer import ResidualLFQ

__all__ = ["CodecModel", "Patch"]

log = logging.getLogger(__name__)

DEFAULT_DECODE_LEVELS = 12


class Patch(nn.Module):
    """Weightless patch stage; exists so module indices line up with checkpoint keys."""

    def __init__(self, spec: PatchSpec, downsample: bool) -> None:
        super().__init__()
        self.patch_size = spec.patch_size
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return patch_fold(x, self.patch_size) if self.downsample else patch_unfold(x, self.patch_size)


class CodecModel(nn.Module):
    """MOSS-Audio-Tokenizer-v2.

    Args:
        config: parsed config.
        with_encoder: build the encoder and the quantizer's encode-side weights (False saves ~half the memory).
        quantizer_levels: how many residual levels to hold (None = all in config).
    """

    def __init__(self, config: CodecConfig, *, with_encoder: bool = True, quantizer_levels: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.with_encoder = with_encoder
        if with_encoder:
            self.encoder = nn.ModuleList(_build(s, downsample=True) for s in config.encoder)
        self.quantizer = ResidualLFQ(config.quantizer, levels=quantizer_levels, with_encoder=with_encoder)
        self.decoder = nn.ModuleList(_build(s, downsample=False) for s in config.decoder)

    @property
    def device(self) -> torch.device:
        return self.quantizer.output_proj.weight.device

    @property
    def compute_dtype(self) -> torch.dtype:
        for m in self.decoder:
            if isinstance(m, ProjectedTransformer):
                return m.input_proj.weight.dtype
        return torch.float32

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        """Store the transformer linear weights in ``dtype`` (bf16 compute); LayerNorm, LayerScale and
        the quantizer stay fp32 (the upstream autocast policy)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.data = m.weight.data.to(dtype)

    # ----------------------------------------------------------------- decode
    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Whole-clip decode from position 0.

        Args:
            codes: ``[B, T, nq]`` int64 (typically nq = 12).
        Returns:
            audio ``[B, channels, T * downsample_rate]`` float32 in [-1, 1]-ish, at ``sampling_rate``.
        """
        x = self.quantizer.decode(codes)
        for m in self.decoder:
            x = m(x)
        return self.deinterleave(x)

    def deinterleave(self, x: torch.Tensor) -> torch.Tensor:
        """Decoder output ``[B, S * ch, 1]`` (interleaved) → ``[B, ch, S]`` float32 (float64 for a double codec)."""
        B = x.shape[0]
        ch = self.config.interleave_factor
        if x.dtype != torch.float64:
            x = x.float()
        if ch == 1:
            return x.reshape(B, 1, -1)
        return x.reshape(B, -1, ch).transpose(1, 2).contiguous()

    # ----------------------------------------------------------------- encode
    @torch.no_grad()
    def encode(self, audio: torch.Tensor, num_quantizers: int = DEFAULT_DECODE_LEVELS) -> torch.Tensor:
        """Encode whole clips.

        Args:
            audio: ``[B, channels, S]`` float at ``sampling_rate``. S is zero-padded up to a multiple of
                ``downsample_rate``; only complete frames (floor(S / downsample_rate)) are returned, as upstream.
        Returns:
            codes ``[B, floor(S / downsample_rate), num_quantizers]`` int64.
        """
        if not self.with_encoder:
            raise RuntimeError("codec was loaded decode-only (with_encoder=False); reload it with the encoder")
        cfg = self.config
        if audio.dim() != 3 or audio.shape[1] != cfg.number_channels:
            raise ValueError(f"expected audio [B, {cfg.number_channels}, S], got {tuple(audio.shape)}")
        B, _, S = audio.shape
        n_frames = S // cfg.downsample_rate
        pad = (-S) % cfg.downsample_rate
        x = F.pad(audio.float(), (0, pad))
        # [B, ch, S] → [B, S * ch, 1]: sample-interleave the channels into one stream.
        x = x.transpose(1, 2).reshape(B, -1, 1) if cfg.interleave_factor > 1 else x.reshape(B, -1, 1)
        for m in self.encoder:
            x = m(x)
        return self.quantizer.encode(x[:, :n_frames], num_quantizers)


def _build(spec: PatchSpec | TransformerSpec, downsample: bool) -> nn.Module:
    if isinstance(spec, PatchSpec):
        return Patch(spec, downsample)
    return ProjectedTransformer(spec)
