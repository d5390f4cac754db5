"""Modules built on the ``meta`` device without their random init (the loaders build there, then read the weights),
and given their memory in one allocation.

On ``meta`` there are no values to initialise, yet ``nn.Embedding``'s init (``normal_``) runs there through a Python
reference that imports ``torch._dynamo`` on first use: about 1.5 s of the engine's start (issue 24), for nothing.

``materialize`` instead of ``Module.to_empty``: one allocation for every parameter instead of one each. On a GPU each
new allocation the caching allocator cannot serve from memory it already holds is a ``cudaMalloc``, and hundreds of
them cost seconds: the model's ~500 made its "model opened" 4.5-4.9 s on an H200, 0.5-0.9 s as one allocation
(bench/RESULTS.md, sessions 13 and 14); the codec has ~2,000.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """``nn.Embedding(num_embeddings, embedding_dim)``; under ``torch.device("meta")`` without its init."""
    if torch.empty(0).is_meta:
        return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
    return nn.Embedding(num_embeddings, embedding_dim)


def materialize(module: nn.Module, device: torch.device | str, *, runs: Sequence[Sequence[torch.Tensor]] = (),
                align: int = 256) -> None:
    """Every parameter of a ``meta`` module, uninitialised, in its own dtype, as a view into ONE allocation on
    ``device`` (ties kept: a tied parameter is one view); buffers get an allocation each (they are few). The tensors of
    each of ``runs`` lie one after another without a gap (a fused projection's members: their concatenation is then a
    view too), the run's first ``align`` bytes aligned, as every other parameter is."""
    device = torch.device(device)
    params = dict(module.named_parameters())  # each tied parameter once
    placed: dict[int, int] = {}  # id(param) -> byte offset
    offset = 0

    def place(p: torch.Tensor, aligned: bool) -> None:
        nonlocal offset
        if aligned:
            offset = -(-offset // align) * align
        offset = -(-offset // p.element_size()) * p.element_size()
        placed[id(p)] = offset
        offset += p.numel() * p.element_size()

    for run in runs:
        for i, p in enumerate(run):
            place(p, aligned=i == 0)
    for p in params.values():
        if id(p) not in placed:
            place(p, aligned=True)
    flat = torch.empty(max(offset, 1), dtype=torch.uint8, device=device)
    made: dict[int, nn.Parameter] = {}
    for p in params.values():
        start = placed[id(p)]
        view = flat[start : start + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
        made[id(p)] = nn.Parameter(view, requires_grad=p.requires_grad)
    for sub in module.modules():
        for name, old in list(sub._parameters.items()):
            if old is not None:
                sub._parameters[name] = made[id(old)]  # the same new parameter wherever the old one was (ties)
        for name, buf in list(sub._buffers.items()):
            if buf is not None and buf.is_meta:
                sub._buffers[name] = torch.empty_like(buf, device=device)
