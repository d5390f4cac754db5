"""Fused q/k/v and gate/up weights (moss_rt/model/fused_weights.py): views into one tensor, names and values kept."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from moss_rt.model import load_model
from moss_rt.model.fused_weights import fuse_linears, fused_weight
from moss_rt.model.tiny import checkpoint_specs
from tests.model.conftest import TINY


def _groups(model: nn.Module) -> list[tuple[nn.Module, list[nn.Linear]]]:
    out = []
    for layer in model.transformer.layers:  # type: ignore[union-attr]
        a, m = layer.self_attn, layer.mlp
        out += [(a, [a.q_proj, a.k_proj, a.v_proj]), (m, [m.gate_proj, m.up_proj])]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projection_weights_are_views_of_one_tensor_with_the_checkpoint_values(dtype: torch.dtype) -> None:
    model = load_model(TINY, dtype=dtype).model
    file = load_file(str(TINY / "model.safetensors"))
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for owner, linears in _groups(model):
        fused = fused_weight(owner, linears)
        assert fused is not None
        weight, bias = fused
        assert bias is None and weight.is_contiguous()
        assert weight.shape[0] == sum(lin.weight.shape[0] for lin in linears)
        start = 0
        for lin in linears:
            w = lin.weight
            # The parameter lives inside the fused tensor's storage, at its rows: no second copy.
            assert w.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
            assert w.data_ptr() == weight[start].data_ptr() and w.is_contiguous()
            assert torch.equal(w, weight[start : start + w.shape[0]])
            assert torch.equal(w, file[names[id(w)]].to(dtype)), names[id(w)]
            start += w.shape[0]
    # Names unchanged: state_dict is exactly the checkpoint layout, no fused entries.
    assert set(model.state_dict()) == {n for n, _ in checkpoint_specs(model.config)}
    # Memory: one allocation holds every parameter (fused_weights.materialize: tied copies once, the fused
    # projections as views of their members), the checkpoint's bytes plus alignment only, no two parameters overlap.
    params = list(model.parameters())  # each tied parameter once
    tied = set(model.tied_keys())
    expected = sum(t.numel() for n, t in file.items() if n not in tied) * torch.empty((), dtype=dtype).element_size()
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    assert sum(p.numel() * p.element_size() for p in params) == expected
    assert expected <= params[0].untyped_storage().nbytes() <= expected + 256 * len(params)
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in params)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    assert model.text_lm_head.weight is model.transformer.embed_tokens.weight  # ties kept


def test_a_moved_layer_falls_back_instead_of_using_stale_fused_weights() -> None:
    owner = nn.Module()
    a, b = nn.Linear(8, 4, bias=True), nn.Linear(8, 6, bias=True)
    fuse_linears(owner, [a, b])
    fused = fused_weight(owner, [a, b])
    assert fused is not None and fused[1] is not None
    assert torch.equal(fused[1], torch.cat([a.bias, b.bias]))
    b.weight = nn.Parameter(b.weight.detach().clone())  # what module.to(...) does to each parameter
    assert fused_weight(owner, [a, b]) is None
    assert fused_weight(nn.Module(), [a, b]) is None  # never fused


def test_fusing_just_allocated_weights_copies_nothing_and_loading_then_writes_through_the_views() -> None:
    """build_model fuses before any value is read (copy=False): the views are in place, and a weight copied into a
    parameter afterwards (what the loader does) is what the fused GEMM reads."""
    owner = nn.Module()
    a, b = nn.Linear(8, 4, bias=True), nn.Linear(8, 6, bias=True)
    fuse_linears(owner, [a, b], copy=False)
    fused = fused_weight(owner, [a, b])
    assert fused is not None and fused[1] is not None
    with torch.no_grad():
        a.weight.copy_(torch.ones(4, 8))
        b.bias.copy_(torch.full((6,), 2.0))
    assert torch.equal(fused[0][:4], torch.ones(4, 8)) and torch.equal(fused[1][4:], torch.full((6,), 2.0))
