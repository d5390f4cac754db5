"""Reference voices: built-in audio files from a folder, and uploads that persist on disk.

Each uploaded voice is stored as its original audio file plus a small JSON record, both written
atomically (temporary file, fsync, rename), so a crash mid-upload leaves either the whole voice
or nothing. Voice ids are derived from the audio's content hash: uploading the same file twice
gives the same id, and an id can never name a path outside the store.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import os
import re
import tempfile
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from moss_rt.protocol import FRAME_RATE, ErrorCode, Limits, ProtocolError

log = logging.getLogger(__name__)

UPLOAD_EXTENSIONS = ("wav", "flac", "mp3", "ogg")
BUILTIN_EXTENSIONS = UPLOAD_EXTENSIONS
REF_ID_PATTERN = re.compile(r"^ref_[0-9a-f]{24}$")
BUILTIN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 192000
MAX_CHANNELS = 8

Encoder = Callable[[bytes], Awaitable[np.ndarray]]


@dataclass(frozen=True)
class Voice:
    id: str
    name: str
    kind: str  # builtin | uploaded
    duration: float
    frames: int
    sample_rate: int
    channels: int
    path: Path

    def public(self) -> dict[str, object]:
        d = asdict(self)
        d.pop("path")
        return d


class InvalidUpload(ProtocolError):
    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_FIELD) -> None:
        super().__init__(code, message, field="audio")


def probe_audio(data: bytes, limits: Limits) -> tuple[float, int, int]:
    """Validate audio bytes by decoding their header: returns (duration s, sample rate, channels)."""
    if not data:
        raise InvalidUpload("the upload is empty")
    try:
        info = sf.info(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise InvalidUpload(f"not a readable audio file: {exc}") from None
    if not MIN_SAMPLE_RATE <= info.samplerate <= MAX_SAMPLE_RATE:
        raise InvalidUpload(f"sample rate {info.samplerate} Hz is outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE}")
    if not 1 <= info.channels <= MAX_CHANNELS:
        raise InvalidUpload(f"{info.channels} channels; at most {MAX_CHANNELS} are accepted")
    duration = float(info.frames) / info.samplerate if info.frames > 0 else 0.0
    if duration > limits.max_upload_seconds:
        raise InvalidUpload(f"audio lasts {duration:.1f} s; the limit is {limits.max_upload_seconds:.0f} s")
    if duration < limits.min_upload_seconds:
        raise InvalidUpload(f"audio lasts {duration:.2f} s; at least {limits.min_upload_seconds} s is needed")
    # The header can lie about its length (truncated files): decode it all to be sure.
    try:
        samples, _ = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, ValueError) as exc:
        raise InvalidUpload(f"the audio could not be decoded: {exc}") from None
    if samples.shape[0] == 0:
        raise InvalidUpload("the audio holds no samples")
    if not np.isfinite(samples).all():
        raise InvalidUpload("the audio holds non-finite samples")
    duration = samples.shape[0] / info.samplerate
    if duration < limits.min_upload_seconds:
        raise InvalidUpload(f"audio lasts {duration:.2f} s; at least {limits.min_upload_seconds} s is needed")
    return duration, int(info.samplerate), int(info.channels)


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class VoiceStore:
    """Lists, stores and encodes reference voices. File work runs off the event loop."""

    def __init__(self, store_dir: Path, builtin_dir: Path | None, limits: Limits, *, codes_cache: int = 64) -> None:
        self._dir = store_dir
        self._builtin_dir = builtin_dir
        self._limits = limits
        self._codes: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        self._codes_cache = codes_cache
        self._voices: dict[str, Voice] = {}
        self._lock = asyncio.Lock()

    async def load(self) -> None:
        self._voices = await asyncio.to_thread(self._scan)
        log.info("voices: %d built-in, %d uploaded", *self._count())

    def _count(self) -> tuple[int, int]:
        kinds = [v.kind for v in self._voices.values()]
        return kinds.count("builtin"), kinds.count("uploaded")

    def _scan(self) -> dict[str, Voice]:
        voices: dict[str, Voice] = {}
        if self._builtin_dir is not None and self._builtin_dir.is_dir():
            for path in sorted(self._builtin_dir.iterdir()):
                if path.suffix.lower().lstrip(".") not in BUILTIN_EXTENSIONS or not BUILTIN_ID_PATTERN.match(path.stem):
                    continue
                try:
                    info = sf.info(str(path))
                except (sf.LibsndfileError, RuntimeError) as exc:
                    log.warning("skipping built-in voice %s: %s", path.name, exc)
                    continue
                duration = info.frames / info.samplerate
                voices[path.stem] = Voice(
                    path.stem, path.stem, "builtin", duration, int(duration * FRAME_RATE),
                    int(info.samplerate), int(info.channels), path,
                )
        self._dir.mkdir(parents=True, exist_ok=True)
        for meta_path in sorted(self._dir.glob("ref_*.json")):
            try:
                meta = json.loads(meta_path.read_text())
                audio = self._dir / meta["file"]
                if not REF_ID_PATTERN.match(meta["id"]) or not audio.is_file() or audio.parent != self._dir:
                    raise ValueError("inconsistent record")
                voices[meta["id"]] = Voice(
                    meta["id"], meta.get("name", meta["id"]), "uploaded", float(meta["duration"]),
                    int(meta["frames"]), int(meta["sample_rate"]), int(meta["channels"]), audio,
                )
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("skipping damaged voice record %s: %s", meta_path.name, exc)
        # Leftover temporaries are from a crash mid-write; the voice they belonged to is absent.
        for tmp in self._dir.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
        return voices

    def list(self) -> list[Voice]:
        return sorted(self._voices.values(), key=lambda v: (v.kind != "builtin", v.name))

    def get(self, voice_id: str) -> Voice:
        voice = self._voices.get(voice_id)
        if voice is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"unknown reference voice {voice_id!r}", field="reference")
        return voice

    def resolve(self, reference: str) -> Voice | None:
        """``none`` / empty → no reference; otherwise a built-in id or an uploaded ref_id."""
        if reference.strip().lower() in ("", "none"):
            return None
        return self.get(reference.strip())

    async def add_upload(self, data: bytes, ext: str, *, name: str | None = None) -> Voice:
        ext = ext.lower().lstrip(".")
        if ext not in UPLOAD_EXTENSIONS:
            raise InvalidUpload(f"ext must be one of {list(UPLOAD_EXTENSIONS)}, got {ext!r}")
        if len(data) > self._limits.max_upload_bytes:
            raise InvalidUpload(f"upload exceeds {self._limits.max_upload_bytes} bytes", ErrorCode.TOO_LARGE)
        duration, sr, channels = await asyncio.to_thread(probe_audio, data, self._limits)
        voice_id = "ref_" + hashlib.sha256(data).hexdigest()[:24]
        async with self._lock:
            if voice_id in self._voices:
                return self._voices[voice_id]
            audio_path = self._dir / f"{voice_id}.{ext}"
            record = {
                "id": voice_id, "name": name or voice_id, "file": audio_path.name, "duration": duration,
                "frames": int(duration * FRAME_RATE), "sample_rate": sr, "channels": channels,
            }

            def _persist() -> None:
                # Audio first, record second: a record always points at a complete file.
                atomic_write(audio_path, data)
                atomic_write(self._dir / f"{voice_id}.json", json.dumps(record).encode())

            await asyncio.to_thread(_persist)
            voice = Voice(voice_id, record["name"], "uploaded", duration, record["frames"], sr, channels, audio_path)
            self._voices[voice_id] = voice
            log.info("stored voice %s (%.1f s, %d Hz, %d ch)", voice_id, duration, sr, channels)
            return voice

    async def codes(self, voice: Voice, encoder: Encoder, codec_tag: str) -> np.ndarray:
        """Codes [T, 12] of a voice under the current codec, cached in memory and on disk."""
        key = (voice.id, codec_tag)
        cached = self._codes.get(key)
        if cached is not None:
            self._codes.move_to_end(key)
            return cached
        safe_tag = re.sub(r"[^A-Za-z0-9_.-]", "_", codec_tag)[:64]
        cache_path = self._dir / "codes" / f"{voice.id}.{safe_tag}.npy"
        codes = await asyncio.to_thread(_load_npy, cache_path)
        if codes is None:
            data = await asyncio.to_thread(voice.path.read_bytes)
            codes = await encoder(data)
            buf = io.BytesIO()
            np.save(buf, codes)
            await asyncio.to_thread(atomic_write, cache_path, buf.getvalue())
        self._codes[key] = codes
        while len(self._codes) > self._codes_cache:
            self._codes.popitem(last=False)
        return codes


def _load_npy(path: Path) -> np.ndarray | None:
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
