"""Reference voices: built-in audio files from a folder, and uploads that persist on disk.

Each uploaded voice is stored as its original audio file plus a small JSON record, both written
atomically (temporary file, fsync, rename), so a crash mid-upload leaves either the whole voice
or nothing. Voice ids are derived from the audio's content hash: uploading the same file twice
gives the same id, and an id can never name a path outside the store.
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import io
import json
import logging
import re
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import soundfile as sf

from moss_rt.atomic_files import atomic_write, fsync_dir
from moss_rt.protocol import FRAME_RATE, ErrorCode, Limits, ProtocolError

log = logging.getLogger(__name__)

UPLOAD_EXTENSIONS = ("wav", "flac", "mp3", "ogg")
BUILTIN_EXTENSIONS = UPLOAD_EXTENSIONS
# libsndfile's container names → the extension an upload is stored under.
SNIFFED_EXTENSIONS = {"WAV": "wav", "WAVEX": "wav", "FLAC": "flac", "MP3": "mp3", "OGG": "ogg"}
REF_ID_PATTERN = re.compile(r"^ref_[0-9a-f]{24}$")
BUILTIN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# Uploads decoded at once: each holds at most one decode block, but decoding is CPU work.
MAX_CONCURRENT_PROBES = 2

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
    # Who uploaded it (the client's address); None for built-ins and voices stored before owners.
    owner: str | None = None

    def public(self) -> dict[str, object]:
        """What any client may see (not where it is stored, nor who owns it)."""
        d = asdict(self)
        d.pop("path")
        d.pop("owner")
        return d


class InvalidUpload(ProtocolError):
    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_FIELD) -> None:
        super().__init__(code, message, field="audio")


# Formats whose header states the exact length: fewer decoded frames than declared is truncation.
_EXACT_LENGTH_FORMATS = ("WAV", "WAVEX", "FLAC", "AIFF", "W64", "RF64")
_DECODE_BLOCK = 65536  # frames per block when decoding: bounds the memory one upload can take
NAME_PATTERN = re.compile(r"^[^\x00-\x1f\x7f]{1,64}$")


def _wav_truncated(data: bytes) -> bool:
    """True when a RIFF/WAVE file's ``data`` chunk declares more bytes than the file holds.

    libsndfile derives a truncated WAV's length from the file size and decodes it silently, so
    this one check needs the header itself. Streaming writers put 0 or 0xFFFFFFFF there: not truncated.
    """
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return False
    pos = 12
    while pos + 8 <= len(data):
        chunk_id, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        if chunk_id == b"data":
            return size not in (0, 0xFFFFFFFF) and pos + 8 + size > len(data)
        pos += 8 + size + (size & 1)
    return False


def _decode_failure(exc: Exception) -> str:
    """Why libsndfile refused the bytes, without its ``Error opening <_io.BytesIO object at 0x...>:`` preamble
    (the object's repr means nothing to the person who uploaded the file)."""
    reason = getattr(exc, "error_string", None) or str(exc)
    return reason.split(">: ", 1)[-1].strip() if "object at 0x" in reason else reason.strip()


def probe_audio(data: bytes, limits: Limits) -> tuple[float, int, int, str]:
    """Validate audio bytes: returns (duration s, sample rate, channels, file extension of the
    format the content really has) or raises InvalidUpload.

    Everything the header says is checked first (rate, channels, duration, frames x channels),
    so a small file that declares hours of audio is refused without decoding any of it. Then
    the audio is decoded block by block (memory stays bounded) to prove it is really there.
    Runs on a worker thread: decoding is CPU work.
    """
    if not data:
        raise InvalidUpload("the upload is empty")
    try:
        info = sf.info(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise InvalidUpload(f"not a readable audio file: {_decode_failure(exc)}") from None
    sr, channels, declared = int(info.samplerate), int(info.channels), int(info.frames)
    # The content decides the stored type, whatever ``ext`` claimed (a WAV sent as ext=flac is a WAV).
    sniffed_ext = SNIFFED_EXTENSIONS.get(str(info.format))
    if sniffed_ext is None:
        raise InvalidUpload(f"the audio is {str(info.format)[:16]}; accepted are {list(UPLOAD_EXTENSIONS)}")
    if not limits.min_upload_sample_rate <= sr <= limits.max_upload_sample_rate:
        raise InvalidUpload(
            f"sample rate {sr} Hz is outside {limits.min_upload_sample_rate}..{limits.max_upload_sample_rate}"
        )
    if not 1 <= channels <= limits.max_upload_channels:
        raise InvalidUpload(f"{channels} channels; at most {limits.max_upload_channels} are accepted")
    duration = declared / sr if declared > 0 else 0.0
    if duration > limits.max_upload_seconds:
        raise InvalidUpload(f"audio lasts {duration:.1f} s; the limit is {limits.max_upload_seconds:.0f} s")
    if declared * channels > limits.max_upload_samples:
        raise InvalidUpload(
            f"{declared} frames x {channels} channels would decode to more than {limits.max_upload_samples} samples",
            ErrorCode.TOO_LARGE,
        )
    if declared > 0 and duration < limits.min_upload_seconds:
        raise InvalidUpload(f"audio lasts {duration:.2f} s; at least {limits.min_upload_seconds} s is needed")
    if info.format in ("WAV", "WAVEX") and _wav_truncated(data):
        raise InvalidUpload("the audio is truncated: its data chunk is shorter than its header says")
    # Never decode more than the limits allow, whatever the header claimed (it can lie).
    cap = min(int(limits.max_upload_seconds * sr), limits.max_upload_samples // channels) + 1
    decoded = 0
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            # A plain read loop, not SoundFile.blocks(): blocks() sizes its output from the header
            # and would hide a short (truncated) stream behind zero padding.
            while True:
                block = f.read(_DECODE_BLOCK, dtype="float32", always_2d=True)
                if block.shape[0] == 0:
                    break
                decoded += block.shape[0]
                if decoded > cap:
                    raise InvalidUpload(
                        f"audio decodes to more than {limits.max_upload_seconds:.0f} s; its header understated it"
                    )
                if not np.isfinite(block).all():
                    raise InvalidUpload("the audio holds non-finite samples")
    except (sf.LibsndfileError, RuntimeError, ValueError) as exc:
        raise InvalidUpload(f"the audio could not be decoded (truncated or damaged?): {_decode_failure(exc)}") from None
    if decoded == 0:
        raise InvalidUpload("the audio holds no samples")
    exact = info.format in _EXACT_LENGTH_FORMATS
    # Lossy formats state an estimate (MP3: from the Xing header); allow 2 % plus a few codec frames.
    if declared > 0 and decoded < (declared if exact else declared * 0.98 - 4096):
        raise InvalidUpload(f"the audio is truncated: the header declares {declared} frames, {decoded} decode")
    duration = decoded / sr
    if duration < limits.min_upload_seconds:
        raise InvalidUpload(f"audio lasts {duration:.2f} s; at least {limits.min_upload_seconds} s is needed")
    return duration, sr, channels, sniffed_ext


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
        self._probes = asyncio.Semaphore(MAX_CONCURRENT_PROBES)

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
                    path.stem,
                    path.stem,
                    "builtin",
                    duration,
                    int(duration * FRAME_RATE),
                    int(info.samplerate),
                    int(info.channels),
                    path,
                )
        self._dir.mkdir(parents=True, exist_ok=True)
        # The per-voice JSON records are the manifest: a voice exists exactly when its record
        # parses and points at a complete audio file. The record is renamed into place only after
        # the audio file is durable, so a crash at any point leaves the voice whole or absent.
        referenced: set[str] = set()
        for meta_path in sorted(self._dir.glob("ref_*.json")):
            try:
                meta = json.loads(meta_path.read_text())
                voice_id, file_name = meta["id"], meta["file"]
                if (
                    not isinstance(voice_id, str)
                    or not REF_ID_PATTERN.match(voice_id)
                    or meta_path.stem != voice_id
                    or not isinstance(file_name, str)
                    or Path(file_name).name != file_name
                    or not file_name.startswith(voice_id + ".")
                ):
                    raise ValueError("inconsistent record")
                audio = self._dir / file_name
                if not audio.is_file():
                    raise ValueError("its audio file is missing")
                if "bytes" in meta and audio.stat().st_size != int(meta["bytes"]):
                    raise ValueError("its audio file has the wrong size")
                voices[voice_id] = Voice(
                    voice_id,
                    str(meta.get("name", voice_id)),
                    "uploaded",
                    float(meta["duration"]),
                    int(meta["frames"]),
                    int(meta["sample_rate"]),
                    int(meta["channels"]),
                    audio,
                    meta["owner"] if isinstance(meta.get("owner"), str) else None,
                )
                referenced.add(file_name)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("skipping damaged voice record %s: %s", meta_path.name, exc)
        # Leftover temporaries are from a crash mid-write; the voice they belonged to is absent.
        leftovers = list(self._dir.glob(".*.tmp"))
        # Audio without a record was never acknowledged to its uploader (the crash came first).
        leftovers += [
            p
            for p in self._dir.glob("ref_*.*")
            if p.suffix.lstrip(".") in UPLOAD_EXTENSIONS and p.name not in referenced
        ]
        for path in leftovers:
            path.unlink(missing_ok=True)
        if leftovers:
            log.warning("removed %d file(s) left by interrupted voice writes", len(leftovers))
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

    def owned_by(self, owner: str) -> builtins.list[Voice]:  # (``list`` is a method here)
        return [v for v in self._voices.values() if v.kind == "uploaded" and v.owner == owner]

    async def add_upload(self, data: bytes, ext: str, *, name: str | None = None, owner: str | None = None) -> Voice:
        """Validate and store an upload; returns only once the voice is durable on disk.

        Re-uploading stored bytes returns the stored voice (it keeps its first owner).
        """
        given = ext
        ext = ext.lower().lstrip(".")
        if ext not in UPLOAD_EXTENSIONS:
            raise InvalidUpload(f"ext must be one of {list(UPLOAD_EXTENSIONS)}, got {given[:16]!r}")
        if name is not None and not NAME_PATTERN.match(name):
            raise ProtocolError(
                ErrorCode.INVALID_FIELD, "name must be 1-64 characters without control characters", field="name"
            )
        if len(data) > self._limits.max_upload_bytes:
            raise InvalidUpload(f"upload exceeds {self._limits.max_upload_bytes} bytes", ErrorCode.TOO_LARGE)
        voice_id = "ref_" + hashlib.sha256(data).hexdigest()[:24]
        existing = self._voices.get(voice_id)
        if existing is not None:  # same bytes as a stored voice: nothing to decode or write
            return existing
        self._check_capacity(owner)
        async with self._probes:
            duration, sr, channels, ext = await asyncio.to_thread(probe_audio, data, self._limits)
        async with self._lock:
            if voice_id in self._voices:
                return self._voices[voice_id]
            self._check_capacity(owner)
            audio_path = self._dir / f"{voice_id}.{ext}"
            voice_name, frames = name or voice_id, int(duration * FRAME_RATE)
            record = {
                "id": voice_id,
                "name": voice_name,
                "file": audio_path.name,
                "duration": duration,
                "frames": frames,
                "sample_rate": sr,
                "channels": channels,
                "bytes": len(data),
                "owner": owner,
            }

            def _persist() -> None:
                # Audio first, record second: a record always points at a complete file.
                atomic_write(audio_path, data)
                atomic_write(self._dir / f"{voice_id}.json", json.dumps(record).encode())

            await asyncio.to_thread(_persist)
            voice = Voice(voice_id, voice_name, "uploaded", duration, frames, sr, channels, audio_path, owner)
            self._voices[voice_id] = voice
            log.info("stored voice %s (%.1f s, %d Hz, %d ch)", voice_id, duration, sr, channels)
            return voice

    def _check_capacity(self, owner: str | None) -> None:
        if self._count()[1] >= self._limits.max_stored_voices:
            raise ProtocolError(
                ErrorCode.RATE_LIMITED,
                f"the voice store is full ({self._limits.max_stored_voices} uploaded voices)",
                field="audio",
            )
        quota = self._limits.max_voices_per_owner
        if owner is not None and quota > 0 and len(self.owned_by(owner)) >= quota:
            raise ProtocolError(
                ErrorCode.RATE_LIMITED,
                f"this client already stores {quota} voices (max_voices_per_owner); delete one first "
                "(DELETE /api/voices/<ref_id>)",
                field="audio",
            )

    async def delete(self, voice_id: str, *, owner: str | None, admin: bool = False) -> Voice:
        """Remove an uploaded voice for its owner (or the admin): record first, then its files.

        Anyone else gets ``not_found``, as for a voice that does not exist (ids are not revealed).
        Without its record the voice is gone for good: a crash before the audio file is removed
        leaves an orphan that the next start deletes.
        """
        voice = self._voices.get(voice_id)
        if voice is None or voice.kind != "uploaded" or not (admin or (owner is not None and voice.owner == owner)):
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no uploaded voice {voice_id[:64]!r} of yours", field="voice")
        async with self._lock:
            if self._voices.pop(voice_id, None) is None:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"no uploaded voice {voice_id[:64]!r}", field="voice")
            for key in [k for k in self._codes if k[0] == voice_id]:
                del self._codes[key]

            def _remove() -> None:
                (self._dir / f"{voice_id}.json").unlink(missing_ok=True)
                fsync_dir(self._dir)
                voice.path.unlink(missing_ok=True)
                for cached in (self._dir / "codes").glob(f"{voice_id}.*.npy"):
                    cached.unlink(missing_ok=True)

            await asyncio.to_thread(_remove)
        log.info("deleted voice %s", voice_id)
        return voice

    async def rename(self, voice_id: str, name: str, *, owner: str | None, admin: bool = False) -> Voice:
        """Give an uploaded voice a new display name, for its owner (or the admin); kept in its record on disk.

        The name is trimmed and must be 1-64 characters without control characters (``invalid_field``). Anyone
        else, and built-in voices (named by their file), get ``not_found`` as for a voice that does not exist.
        The record is rewritten atomically: a crash leaves the old name or the new one.
        """
        voice = self._voices.get(voice_id)
        if voice is None or voice.kind != "uploaded" or not (admin or (owner is not None and voice.owner == owner)):
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no uploaded voice {voice_id[:64]!r} of yours", field="voice")
        name = name.strip() if isinstance(name, str) else name
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ProtocolError(
                ErrorCode.INVALID_FIELD, "name must be 1-64 characters without control characters", field="name"
            )
        async with self._lock:
            current = self._voices.get(voice_id)
            if current is None:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"no uploaded voice {voice_id[:64]!r}", field="voice")
            meta_path = self._dir / f"{voice_id}.json"

            def _persist() -> None:
                record = json.loads(meta_path.read_text())
                record["name"] = name
                atomic_write(meta_path, json.dumps(record).encode())

            await asyncio.to_thread(_persist)
            renamed = replace(current, name=name)
            self._voices[voice_id] = renamed
        log.info("renamed voice %s", voice_id)
        return renamed

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
        codes: np.ndarray = np.load(path, allow_pickle=False)
        return codes
    except (OSError, ValueError):
        return None
