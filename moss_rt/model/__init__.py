"""Our own PyTorch implementation of MOSS-TTS-Local-Transformer v1.5 (see docs/model.md).

The names below are imported on first use (PEP 562): a process that needs only the torch-free parts
(the prompt rows and config, the KV block bookkeeping: a cluster's front end) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moss_rt.model.config import ConfigError, MossTTSConfig
    from moss_rt.model.loader import LoadedModel, ModelSource, ModelSourceError, load_model, resolve_model_source
    from moss_rt.model.runner import ModelRunner, SlotError, StepResult

_HOMES = {
    "ConfigError": "moss_rt.model.config",
    "MossTTSConfig": "moss_rt.model.config",
    "LoadedModel": "moss_rt.model.loader",
    "ModelSource": "moss_rt.model.loader",
    "ModelSourceError": "moss_rt.model.loader",
    "load_model": "moss_rt.model.loader",
    "resolve_model_source": "moss_rt.model.loader",
    "ModelRunner": "moss_rt.model.runner",
    "SlotError": "moss_rt.model.runner",
    "StepResult": "moss_rt.model.runner",
}

__all__ = [
    "ConfigError",
    "LoadedModel",
    "ModelRunner",
    "ModelSource",
    "ModelSourceError",
    "MossTTSConfig",
    "SlotError",
    "StepResult",
    "load_model",
    "resolve_model_source",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
