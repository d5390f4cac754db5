"""MOSS-Audio-Tokenizer-v2 codec: whole-clip encode/decode, exact streaming decode, reference encoding.

48 kHz stereo, 12.5 code frames per second (3840 samples per channel per frame), 12 codebooks used.
"""

from .config import CodecConfig, CodecConfigError
from .loader import DEFAULT_CODEC_REPO, CodecLoadError, load_codec
from .model import CodecModel

__all__ = [
    "DEFAULT_CODEC_REPO",
    "CodecConfig",
    "CodecConfigError",
    "CodecLoadError",
    "CodecModel",
    "load_codec",
]
