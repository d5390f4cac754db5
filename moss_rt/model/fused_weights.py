"""One weight tensor per fused projection, with the per-projection parameters as views into it.

Why: a backbone layer's q/k/v projections read the same input, as do the MLP's gate/up projections; one GEMM
over the concatenated weight replaces three (two) launches. Allocating the concatenation once and making
``q_proj.weight`` / ``k_proj.weight`` / ``v_proj.weight`` row slices of it (row slices of a contiguous
``[N_total, H]`` tensor are contiguous) keeps weight memory single, loading by name (``param.copy_`` writes
through the view) and ``state_dict`` unchanged.

``fuse_projections`` runs in ``network.build_model`` right after the parameters are materialised on their device
and dtype, before any weights are read. ``fused_weight`` hands a forward the concatenation only while the views
still point into it (a later ``module.to(...)`` would replace them with separate tensors; the forward then
falls back to concatenating the separate GEMMs' outputs).
"""

from __future__ import annotations

import torch
from torch import nn

FUSED_WEIGHT = "_fused_weight"  # plain attributes (not parameters or buffers): state_dict keeps its names
FUSED_BIAS = "_fused_bias"


def fuse_linears(owner: nn.Module, linears: list[nn.Linear], *, copy: bool = True) -> None:
    """Re-home the weights (and biases) of ``linears`` as consecutive row slices of one new tensor on ``owner``.

    Values are copied (unless ``copy`` is False: parameters just allocated, whose values are not read yet), so this
    may run before or after loading; the old tensors are released.
    """
    first = linears[0].weight
    rows = sum(lin.weight.shape[0] for lin in linears)
    weight = torch.empty((rows, first.shape[1]), dtype=first.dtype, device=first.device)
    has_bias = all(lin.bias is not None for lin in linears)
    bias = torch.empty((rows,), dtype=first.dtype, device=first.device) if has_bias else None
    start = 0
    with torch.no_grad():
        for lin in linears:
            n = lin.weight.shape[0]
            if copy:
                weight[start : start + n].copy_(lin.weight)
            lin.weight = nn.Parameter(weight[start : start + n], requires_grad=lin.weight.requires_grad)
            if bias is not None and lin.bias is not None:
                if copy:
                    bias[start : start + n].copy_(lin.bias)
                lin.bias = nn.Parameter(bias[start : start + n], requires_grad=lin.bias.requires_grad)
            start += n
    object.__setattr__(owner, FUSED_WEIGHT, weight)  # bypass nn.Module: not a buffer, not in state_dict
    object.__setattr__(owner, FUSED_BIAS, bias)


def fused_weight(owner: nn.Module, linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of the concatenation if ``linears`` are still views into it, else None (host check only)."""
    weight: torch.Tensor | None = getattr(owner, FUSED_WEIGHT, None)
    if weight is None:
        return None
    bias: torch.Tensor | None = getattr(owner, FUSED_BIAS, None)
    row_bytes = weight.stride(0) * weight.element_size()
    ptr, bptr, start = weight.data_ptr(), None if bias is None else bias.data_ptr(), 0
    for lin in linears:
        if lin.weight.data_ptr() != ptr + start * row_bytes or lin.weight.dtype != weight.dtype:
            return None
        if (lin.bias is None) != (bias is None):
            return None
        if bias is not None and bptr is not None and lin.bias is not None:
            if lin.bias.data_ptr() != bptr + start * bias.element_size():
                return None
        start += lin.weight.shape[0]
    return weight, bias


def fuse_projections(model: nn.Module, *, copy: bool = True) -> None:
    """q/k/v and gate/up of every backbone layer of a ``MossTTSLocalModel`` (``copy``: as fuse_linears)."""
    for layer in model.transformer.layers:  # type: ignore[union-attr]
        attn, mlp = layer.self_attn, layer.mlp
        fuse_linears(attn, [attn.q_proj, attn.k_proj, attn.v_proj], copy=copy)
        fuse_linears(mlp, [mlp.gate_proj, mlp.up_proj], copy=copy)
