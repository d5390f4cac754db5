"""One weight tensor per fused projection, with the per-projection parameters as views into it.

Why: a backbone layer's q/k/v projections read the same input, as do the MLP's gate/up projections; one GEMM
over the concatenated weight replaces three (two) launches. Allocating the concatenation once and making
``q_proj.weight`` / ``k_proj.weight`` / ``v_proj.weight`` row slices of it (row slices of a contiguous
``[N_total, H]`` tensor are contiguous) keeps weight memory single, loading by name (``param.copy_`` writes
through the view) and ``state_dict`` unchanged.

``fuse_projections`` runs in ``network.build_model`` right after the parameters are materialised on their device
and dtype (``materialize``: one allocation, each projection's members laid out one after another, so the
concatenation is a view of them), before any weights are read. ``fused_weight`` hands a forward the concatenation
only while the views still point into it (a later ``module.to(...)`` would replace them with separate tensors; the
forward then falls back to concatenating the separate GEMMs' outputs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from moss_rt.meta_init import materialize as materialize_module

FUSED_WEIGHT = "_fused_weight"  # plain attributes (not parameters or buffers): state_dict keeps its names
FUSED_BIAS = "_fused_bias"


def fuse_linears(owner: nn.Module, linears: list[nn.Linear]) -> None:
    """Re-home the weights (and biases) of ``linears`` as consecutive row slices of one tensor on ``owner``.

    Where they already lie one after another in one storage (``materialize``'s layout: what ``build_model`` makes),
    the concatenation is a view of them and nothing moves. Otherwise it is a new tensor their values are copied into
    (so this may run before or after loading) and the old tensors are released.
    """
    if _adopt(owner, linears):
        return
    first = linears[0].weight
    rows = sum(lin.weight.shape[0] for lin in linears)
    weight = torch.empty((rows, first.shape[1]), dtype=first.dtype, device=first.device)
    has_bias = all(lin.bias is not None for lin in linears)
    bias = torch.empty((rows,), dtype=first.dtype, device=first.device) if has_bias else None
    start = 0
    with torch.no_grad():
        for lin in linears:
            n = lin.weight.shape[0]
            weight[start : start + n].copy_(lin.weight)
            lin.weight = nn.Parameter(weight[start : start + n], requires_grad=lin.weight.requires_grad)
            if bias is not None and lin.bias is not None:
                bias[start : start + n].copy_(lin.bias)
                lin.bias = nn.Parameter(bias[start : start + n], requires_grad=lin.bias.requires_grad)
            start += n
    object.__setattr__(owner, FUSED_WEIGHT, weight)  # bypass nn.Module: not a buffer, not in state_dict
    object.__setattr__(owner, FUSED_BIAS, bias)


def _span(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One view over ``tensors`` concatenated along dim 0, where they already lie so (contiguous, one storage, each
    right after the previous); None otherwise."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or t.untyped_storage().data_ptr() != storage or t.data_ptr() != end):
            return None
        end += t.numel() * t.element_size()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _adopt(owner: nn.Module, linears: list[nn.Linear]) -> bool:
    """The concatenation as a view of weights (and biases) already laid out one after another; False: they are not."""
    weight = _span([lin.weight for lin in linears])
    biases = [lin.bias for lin in linears if lin.bias is not None]
    if weight is None or len(biases) not in (0, len(linears)):
        return False
    bias = _span(biases) if biases else None
    if biases and bias is None:
        return False
    object.__setattr__(owner, FUSED_WEIGHT, weight.detach())
    object.__setattr__(owner, FUSED_BIAS, None if bias is None else bias.detach())
    return True


def projection_groups(model: nn.Module) -> list[tuple[nn.Module, list[nn.Linear]]]:
    """(owner, linears) of every fused projection of a ``MossTTSLocalModel``: each backbone layer's q/k/v and
    gate/up."""
    groups: list[tuple[nn.Module, list[nn.Linear]]] = []
    for layer in model.transformer.layers:  # type: ignore[union-attr]
        attn, mlp = layer.self_attn, layer.mlp
        groups += [(attn, [attn.q_proj, attn.k_proj, attn.v_proj]), (mlp, [mlp.gate_proj, mlp.up_proj])]
    return groups


def materialize(model: nn.Module, device: torch.device, align: int = 256) -> None:
    """Every parameter of a ``meta`` model, uninitialised, as a view into ONE allocation on ``device`` (ties kept: a
    tied parameter is one view), each fused projection's weights (then biases) one after another so that
    ``fuse_projections`` only has to name their span. One allocation instead of one per parameter (about 500 at
    full size, the tied heads and the unfused projections allocated and given back on top) and none of
    ``to_empty``'s per-tensor Python (meta_init.materialize)."""
    runs: list[list[torch.Tensor]] = []
    for _, linears in projection_groups(model):
        runs.append([lin.weight for lin in linears])
        runs.append([lin.bias for lin in linears if lin.bias is not None])
    materialize_module(model, device, runs=runs, align=align)


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


def fuse_projections(model: nn.Module) -> None:
    """q/k/v and gate/up of every backbone layer of a ``MossTTSLocalModel``."""
    for owner, linears in projection_groups(model):
        fuse_linears(owner, linears)
