"""Modules built on the ``meta`` device without their random init (the loaders build there, then read the weights).

On ``meta`` there are no values to initialise, yet ``nn.Embedding``'s init (``normal_``) runs there through a Python
reference that imports ``torch._dynamo`` on first use: about 1.5 s of the engine's start (issue 24), for nothing.
"""

from __future__ import annotations

import torch
from torch import nn


def embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """``nn.Embedding(num_embeddings, embedding_dim)``; under ``torch.device("meta")`` without its init."""
    if torch.empty(0).is_meta:
        return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
    return nn.Embedding(num_embeddings, embedding_dim)
