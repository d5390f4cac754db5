"""Residual LFQ quantizer of MOSS-Audio-Tokenizer-v2 (inference only, always fp32).

The checkpoint stores every projection as a weight-normalised 1x1 convolution
(``<name>.parametrizations.weight.original0`` = g ``[out, 1, 1]``, ``original1`` = v ``[out, in, 1]``,
plus ``<name>.bias``). The loader folds them once into plain ``<name>.weight`` ``[out, in]``
(weight = g * v / ||v|| per output channel), which is what these modules hold.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from moss_rt.meta_init import embedding

from .config import QuantizerSpec

__all__ = ["PointwiseProj", "ResidualLFQ", "fold_weight_norm"]


def fold_weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """weight = g * v / ||v||, the norm taken per output channel (dim 0) over all other dims.

    Args:
        g: ``[out, 1, ...]`` magnitudes. v: ``[out, in, ...]`` directions.
    Returns:
        ``[out, in, ...]`` float32.
    """
    g32, v32 = g.float(), v.float()
    norm = v32.flatten(1).norm(dim=1).view(-1, *([1] * (v32.dim() - 1)))
    return g32 * (v32 / norm)


class PointwiseProj(nn.Module):
    """A folded weight-normed Conv1d(k=1): ``y = x @ weight.T + bias`` on channels-last input."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_dim, in_dim))
        self.bias = nn.Parameter(torch.zeros(out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class LFQLevel(nn.Module):
    """One level: ``in_proj`` (rvq→cb), ``codebook.weight`` ``[size, cb]``, ``out_proj`` (cb→rvq)."""

    def __init__(self, rvq_dim: int, codebook_size: int, codebook_dim: int) -> None:
        super().__init__()
        self.in_proj = PointwiseProj(rvq_dim, codebook_dim)
        self.out_proj = PointwiseProj(codebook_dim, rvq_dim)
        self.codebook = embedding(codebook_size, codebook_dim)

    @torch.no_grad()
    def quantize(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Nearest code by squared distance between L2-normalised latent and L2-normalised codebook rows.

        Args:
            residual: ``[N, rvq_dim]`` fp32.
        Returns:
            (indices ``[N]`` int64, decoded ``[N, rvq_dim]`` = out_proj(raw codebook row)).
        """
        z_e = self.in_proj(residual)
        enc = F.normalize(z_e)
        cb = F.normalize(self.codebook.weight.float())
        # Same expansion of the squared distance as upstream, so near-ties break identically.
        dist = enc.pow(2).sum(1, keepdim=True) - 2 * enc @ cb.t() + cb.pow(2).sum(1, keepdim=True).t()
        idx = (-dist).max(1)[1]
        z_q = self.codebook.weight[idx].float()
        # Upstream's straight-through form z_e + (z_q - z_e) is not bitwise z_q in floating point;
        # keep it so the residual (and therefore every later level's code) matches exactly.
        z_q = z_e + (z_q - z_e)
        return idx, self.out_proj(z_q)


class ResidualLFQ(nn.Module):
    """``quantizer.*``: input_proj, ``quantizers.<i>``, output_proj.

    ``levels`` may be fewer than ``spec.num_quantizers`` (the decoder only ever needs the first 12;
    level i depends only on levels < i, so the first codes are identical either way).
    """

    def __init__(self, spec: QuantizerSpec, levels: int | None = None, with_encoder: bool = True) -> None:
        super().__init__()
        self.spec = spec
        n = spec.num_quantizers if levels is None else min(levels, spec.num_quantizers)
        self.with_encoder = with_encoder
        if with_encoder:
            self.input_proj = PointwiseProj(spec.input_dim, spec.rvq_dim)
        self.output_proj = PointwiseProj(spec.rvq_dim, spec.output_dim)
        self.quantizers = nn.ModuleList(
            LFQLevel(spec.rvq_dim, spec.codebook_size, spec.codebook_dim) for _ in range(n)
        )
        self._lut: torch.Tensor | None = None
        self._lut_bias: torch.Tensor | None = None

    @property
    def levels_list(self) -> list[LFQLevel]:
        """``quantizers`` as what they are (a ModuleList indexes and iterates like this list)."""
        return cast("list[LFQLevel]", self.quantizers)

    @property
    def levels(self) -> int:
        return len(self.quantizers)

    @torch.no_grad()
    def build_lut(self) -> None:
        """Precompute per-level decode tables ``[levels, size, output_dim]`` = output_proj.W · out_proj_i(codebook_i).

        Decoding then is a gather and a sum. Call again if the weights change.
        """
        tables = []
        for q in self.levels_list:
            dec = q.out_proj(q.codebook.weight)  # [size, rvq]
            tables.append(F.linear(dec, self.output_proj.weight))  # [size, out]
        # fp32 (the quantizer's dtype; fp64 only when a test casts the whole codec to double)
        self._lut = torch.stack(tables)
        self._lut_bias = self.output_proj.bias.detach().clone()

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes ``[B, T, nq]`` int64 (nq <= levels) → latents ``[B, T, output_dim]`` fp32."""
        nq = codes.shape[-1]
        if nq > self.levels:
            raise ValueError(f"codes have {nq} levels but only {self.levels} quantizers are loaded")
        if self._lut is None or self._lut.device != codes.device:
            self.build_lut()
        assert self._lut is not None and self._lut_bias is not None
        level_ids = torch.arange(nq, device=codes.device)
        return self._lut[level_ids, codes].sum(dim=-2) + self._lut_bias

    @torch.no_grad()
    def encode(self, z: torch.Tensor, nq: int) -> torch.Tensor:
        """Latents ``[B, T, input_dim]`` → codes ``[B, T, nq]`` int64 by residual quantization."""
        if not self.with_encoder:
            raise RuntimeError("codec was loaded decode-only; encoding needs the quantizer input_proj")
        if nq > self.levels:
            raise ValueError(f"asked for {nq} levels but only {self.levels} quantizers are loaded")
        B, T, _ = z.shape
        residual = self.input_proj(z.float().reshape(B * T, -1))
        codes = []
        for q in self.levels_list[:nq]:
            idx, dec = q.quantize(residual)
            residual = residual - dec
            codes.append(idx)
        return torch.stack(codes, dim=-1).view(B, T, nq)
