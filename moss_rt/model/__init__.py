"""Our own PyTorch implementation of MOSS-TTS-Local-Transformer v1.5 (see docs/model.md)."""

from moss_rt.model.config import ConfigError, MossTTSConfig
from moss_rt.model.loader import LoadedModel, ModelSource, ModelSourceError, load_model, resolve_model_source
from moss_rt.model.runner import ModelRunner, SlotError, StepResult

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
