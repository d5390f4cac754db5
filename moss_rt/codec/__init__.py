"""MOSS-Audio-Tokenizer-v2 codec: whole-clip encode/decode, exact streaming decode, reference encoding.

48 kHz stereo, 12.5 code frames per second (3840 samples per channel per frame), 12 codebooks used.

The names below are imported on first use (PEP 562), as the model package's are: a process that needs only the
package's torch-free parts (a compile worker importing the codec's Triton kernels: engine/compile_workers.py) does
not import torch and the codec's loader.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moss_rt.codec.config import CodecConfig, CodecConfigError
    from moss_rt.codec.loader import DEFAULT_CODEC_REPO, CodecLoadError, load_codec
    from moss_rt.codec.model import CodecModel

_HOMES = {
    "CodecConfig": "moss_rt.codec.config",
    "CodecConfigError": "moss_rt.codec.config",
    "DEFAULT_CODEC_REPO": "moss_rt.codec.loader",
    "CodecLoadError": "moss_rt.codec.loader",
    "load_codec": "moss_rt.codec.loader",
    "CodecModel": "moss_rt.codec.model",
}

__all__ = [
    "DEFAULT_CODEC_REPO",
    "CodecConfig",
    "CodecConfigError",
    "CodecLoadError",
    "CodecModel",
    "load_codec",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
