"""Reference-voice encoding: uploaded audio bytes → codec codes ``[T, 12]``.

Pipeline (as the MOSS-TTS processor does it): decode with soundfile (WAV, FLAC, OGG/Vorbis/Opus and
MP3 where the installed libsndfile supports them) → resample to 48 kHz with soxr (very high quality)
→ mono duplicated to stereo, more than two channels cut to the first two → loudness normalised to
−20 dBFS (mean square over all samples, both channels) with the gain clamped to ±3 dB → codec encode
with 12 quantizers. Only whole 80 ms frames are encoded (a trailing partial frame is dropped).

Results are cached per codec by SHA-256 of the uploaded bytes (bounded LRU).
"""

from __future__ import annotations

import hashlib
import io
import logging
import threading
import weakref
from collections import OrderedDict

import numpy as np
import soundfile as sf
import soxr
import torch

from .model import DEFAULT_DECODE_LEVELS, CodecModel

__all__ = [
    "InvalidAudio",
    "ReferenceCache",
    "decode_audio_bytes",
    "encode_reference",
    "loudness_normalize",
    "prepare_reference",
]

log = logging.getLogger(__name__)

TARGET_DBFS = -20.0
GAIN_RANGE_DB = (-3.0, 3.0)


class InvalidAudio(ValueError):
    """The upload is not decodable audio, is empty or shorter than one codec frame, or holds non-finite samples."""


def decode_audio_bytes(data: bytes) -> tuple[np.ndarray, int]:
    """Decode any soundfile-readable container.

    Returns:
        (audio ``[channels, samples]`` float32, sample rate in Hz).
    Raises:
        InvalidAudio: undecodable, empty, or non-finite.
    """
    if not data:
        raise InvalidAudio("empty upload")
    try:
        audio, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise InvalidAudio(f"could not decode audio: {exc}") from exc
    if audio.size == 0 or audio.shape[0] == 0:
        raise InvalidAudio("audio has no samples")
    if not np.isfinite(audio).all():
        raise InvalidAudio("audio contains NaN or infinite samples")
    return np.ascontiguousarray(audio.T), int(sr)


def loudness_normalize(
    audio: np.ndarray, target_dbfs: float = TARGET_DBFS, gain_range: tuple[float, float] = GAIN_RANGE_DB
) -> np.ndarray:
    """Scale ``audio`` (any shape) towards ``target_dbfs`` (10·log10(mean square + 1e-9)), gain clamped to
    ``gain_range`` dB. Returns float32."""
    x = audio.astype(np.float32, copy=False)
    if x.size == 0:
        return x
    current = 10.0 * np.log10(float(np.mean(np.square(x, dtype=np.float64))) + 1e-9)
    gain_db = min(max(target_dbfs - current, gain_range[0]), gain_range[1])
    return (x * np.float32(10.0 ** (gain_db / 20.0))).astype(np.float32)


def prepare_reference(audio: np.ndarray, sr: int, target_sr: int = 48000) -> np.ndarray:
    """``[channels, samples]`` at ``sr`` → ``[2, samples']`` float32 at ``target_sr``, loudness-normalised."""
    if audio.ndim != 2 or audio.shape[0] < 1:
        raise InvalidAudio(f"expected [channels, samples] audio, got shape {audio.shape}")
    if audio.shape[0] == 1:
        audio = np.repeat(audio, 2, axis=0)
    elif audio.shape[0] > 2:
        audio = audio[:2]
    if sr != target_sr:
        # soxr wants [frames, channels].
        audio = soxr.resample(np.ascontiguousarray(audio.T), sr, target_sr, quality="VHQ").T
    return loudness_normalize(np.ascontiguousarray(audio, dtype=np.float32))


class ReferenceCache:
    """Bounded LRU: SHA-256 of the uploaded bytes → (codes, duration). Thread-safe."""

    def __init__(self, max_entries: int = 64) -> None:
        self.max_entries = int(max_entries)
        self._data: OrderedDict[str, tuple[np.ndarray, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0

    def get(self, key: str) -> tuple[np.ndarray, float] | None:
        with self._lock:
            item = self._data.get(key)
            if item is None:
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return item[0].copy(), item[1]

    def put(self, key: str, codes: np.ndarray, duration: float) -> None:
        with self._lock:
            self._data[key] = (codes.copy(), duration)
            self._data.move_to_end(key)
            while len(self._data) > self.max_entries:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)


# One cache per codec object; dropped with the codec.
_CACHES: weakref.WeakKeyDictionary[CodecModel, ReferenceCache] = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()


def cache_for(codec: CodecModel) -> ReferenceCache:
    with _CACHES_LOCK:
        cache = _CACHES.get(codec)
        if cache is None:
            cache = _CACHES[codec] = ReferenceCache()
        return cache


def encode_reference(
    codec: CodecModel,
    audio_bytes: bytes,
    *,
    num_quantizers: int = DEFAULT_DECODE_LEVELS,
    max_seconds: float | None = None,
    cache: ReferenceCache | None = None,
) -> tuple[np.ndarray, float]:
    """Encode an uploaded reference voice.

    Args:
        codec: a codec loaded with its encoder.
        audio_bytes: the uploaded file.
        max_seconds: reject longer audio (None: no limit here; the voice store enforces its own).
        cache: LRU to use (default: the codec's own).
    Returns:
        (codes ``[T, num_quantizers]`` int64 with T = floor(seconds × 12.5), duration of the upload in seconds).
    Raises:
        InvalidAudio: undecodable, empty, non-finite, shorter than one frame (80 ms) or longer than max_seconds.
    """
    cache = cache_for(codec) if cache is None else cache
    key = hashlib.sha256(audio_bytes).hexdigest() + f":{num_quantizers}"
    hit = cache.get(key)
    if hit is not None:
        return hit
    audio, sr = decode_audio_bytes(audio_bytes)
    duration = audio.shape[1] / sr
    if max_seconds is not None and duration > max_seconds:
        raise InvalidAudio(f"reference is {duration:.1f} s long; the limit is {max_seconds:.1f} s")
    cfg = codec.config
    wav = prepare_reference(audio, sr, cfg.sampling_rate)
    if wav.shape[1] < cfg.downsample_rate:
        raise InvalidAudio(f"reference is shorter than one codec frame ({1000 / cfg.frame_rate:.0f} ms)")
    x = torch.from_numpy(wav)[None].to(codec.device)
    codes = codec.encode(x, num_quantizers)[0].cpu().numpy().astype(np.int64)
    log.info("encoded reference: %.2f s at %d Hz, %d ch → %d frames", duration, sr, audio.shape[0], codes.shape[0])
    cache.put(key, codes, duration)
    return codes, duration
