"""Fused q/k/v and gate/up weights (moss_rt/model/fused_weights.py): views into one tensor, names and values kept."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from moss_rt.model import load_model
from moss_rt.model.fused_weights import fuse_linears, fused_weight, projection_groups
from moss_rt.model.tiny import checkpoint_specs
from tests.model.conftest import TINY


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projection_weights_are_views_of_one_tensor_with_the_checkpoint_values(dtype: torch.dtype) -> None:
    model = load_model(TINY, dtype=dtype).model
    file = load_file(str(TINY / "model.safetensors"))
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for owner, linears in projection_groups(model):
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


def test_weights_already_side_by_side_are_fused_as_a_view_and_loading_writes_through_it() -> None:
    """build_model's layout (materialize): a projection's weights, then its biases, one after another in one storage;
    fusing them allocates and copies nothing, and a weight loaded afterwards is what the fused GEMM reads. Weights that
    are not so laid out get a new tensor with their values copied."""
    flat = torch.zeros(4 * 8 + 6 * 8 + 4 + 6)
    a, b = nn.Linear(8, 4, bias=True), nn.Linear(8, 6, bias=True)
    a.weight, b.weight = nn.Parameter(flat[:32].view(4, 8)), nn.Parameter(flat[32:80].view(6, 8))
    a.bias, b.bias = nn.Parameter(flat[80:84]), nn.Parameter(flat[84:])
    owner = nn.Module()
    fuse_linears(owner, [a, b])
    fused = fused_weight(owner, [a, b])
    assert fused is not None and fused[1] is not None
    assert fused[0].data_ptr() == flat.data_ptr() and fused[1].data_ptr() == flat[80:].data_ptr()  # views, no copy
    with torch.no_grad():
        b.weight.copy_(torch.ones(6, 8))
        a.bias.copy_(torch.full((4,), 2.0))
    assert torch.equal(fused[0][4:], torch.ones(6, 8)) and torch.equal(fused[1][:4], torch.full((4,), 2.0))
    apart = nn.Module()
    c, d = nn.Linear(8, 4, bias=False), nn.Linear(8, 6, bias=False)
    values = torch.cat([c.weight, d.weight]).detach().clone()
    fuse_linears(apart, [c, d])  # separate tensors: copied into a new one
    moved = fused_weight(apart, [c, d])
    assert moved is not None and torch.equal(moved[0], values)
