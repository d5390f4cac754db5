"""Session archives: a whole directing session as one zip, written as a stream and read back within bounds.

Layout (version 1)::

    session.json               {"moss_rt_session": 1, "sample_rate": 48000, "next_number": 8, "takes": [records]}
    takes/<take id>.wav        the audio as it was heard: 16-bit PCM WAV, 48 kHz, mono or stereo
    takes/<take id>.codes.npy  its codes, [n_frames, 12] integers (none for a take with ``"has_codes": false``)

A record keeps the take's number (``number``, never reused: ``next_number`` is the session's next one) and, for a
splice or comp, where its audio came from (``kind``, ``parts``, ``crossfade``; moss_rt/splices.py). Archives
written before numbers existed are numbered in their order on import.

Writing (:func:`write_archive`) copies each take from its files in pieces into any writable stream, so an
export never holds more than a piece of audio, whatever the session's size.

Reading (:func:`unpack_archive`) trusts nothing in the zip. Before a byte of audio is unpacked: only stored or
deflated members (no encryption; bzip2/LZMA could make a decoder allocate gigabytes), ``session.json`` within its
byte, depth and value bounds (:mod:`moss_rt.bounded_json`), every record checked field by field (the request
parsed as a ``start`` under the service's limits, numbers finite and in range). Then each take in turn: its codes'
header (shape ``[n, 12]`` with ``n`` at most the frame cap, an integer type), its codes (every one within the
codebook), its WAV header (48 kHz, 16-bit, the channels, exactly ``n`` frames of audio). Audio is copied into the
staging folder in pieces, and every byte written is counted against the import's budget as it is written, so a
zip bomb ends at the budget. Every failure is a :class:`~moss_rt.protocol.ProtocolError` (4xx, or 507 when the
data dir has no room); the caller discards the staging folder. Sans-I/O in the aiohttp sense: plain blocking
file work, meant for a worker thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import math
import os
import re
import secrets
import shutil
import struct
import time
import wave
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO

import numpy as np

from moss_rt.audio import wav_header
from moss_rt.bounded_json import loads_bounded
from moss_rt.protocol import FRAME_SAMPLES, N_CODEBOOKS, SAMPLE_RATE, ErrorCode, Limits, ProtocolError, StartTake
from moss_rt.session_records import NOTE_FIELDS, TAKE_ID, StorageFull, StoredTake, TakeKind, check_notes

ARCHIVE_VERSION = 1
MANIFEST = "session.json"
COPY_CHUNK = 256 * 1024  # bytes per read/write when copying audio
MAX_STATS = 64  # numbers in a take's stats
MAX_REASON = 64  # characters of an end reason
MAX_NUMBER = 2**31 - 1  # a take's number in its session
# Integer codes up to 8 bytes wide (int8 … uint64); anything else (floats, objects, strings) is refused.
CODE_KINDS = "iu"


def bad(why: str, *, code: ErrorCode = ErrorCode.INVALID_FIELD) -> ProtocolError:
    return ProtocolError(code, f"not a valid moss_rt session archive: {why}", field="archive")


@dataclass(frozen=True)
class ArchiveBounds:
    """What one import may hold and unpack to."""

    limits: Limits  # the service's request limits: every take's request must parse under them
    max_session_takes: int  # takes in one session
    max_take_frames: int  # frames of one take (its kept frames included)
    codebook_size: int  # every code must lie in [0, codebook_size)
    max_unpacked_bytes: int  # audio + codes written while unpacking: past it, 413 too_large
    room_bytes: int | None = None  # what the data dir can still take for this client: past it, 507

    @property
    def max_json_values(self) -> int:
        # A record is ~40 values plus two per marker (MAX_MARKERS of them): ~1000 per take bounds a real archive.
        return 1000 * (self.max_session_takes + 1)


@dataclass(frozen=True)
class UnpackedTake:
    """One take of an archive, checked and unpacked: its record (take id issued anew) and the bytes it takes."""

    take: StoredTake
    nbytes: int


# --------------------------------------------------------------------------- writing


def write_archive(
    out: IO[bytes],
    takes: list[StoredTake],
    next_number: int,
    open_pcm: Callable[[str], BinaryIO],
    codes_path: Callable[[str], Path],
) -> None:
    """Write the archive of ``takes`` (records as stored) into ``out``, which need not be seekable;
    ``next_number`` is the session's next take number.

    ``open_pcm(take_id)`` opens a take's raw PCM, ``codes_path(take_id)`` names its codes file; both were
    checked by the caller (a take whose files are damaged is left out before the first byte goes out).
    """
    manifest = {
        "moss_rt_session": ARCHIVE_VERSION,
        "sample_rate": SAMPLE_RATE,
        "next_number": next_number,
        "takes": [t.public() for t in takes],
    }
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        z.writestr(MANIFEST, json.dumps(manifest, indent=1, allow_nan=False))
        for t in takes:
            pcm_bytes = t.n_frames * FRAME_SAMPLES * t.channels * 2
            info = zipfile.ZipInfo(f"takes/{t.take_id}.wav", date_time=time.localtime(t.created)[:6])
            info.compress_type = zipfile.ZIP_DEFLATED
            info.file_size = 44 + pcm_bytes  # known up front: the zip64 decision needs it on a stream
            with z.open(info, "w") as dst, open_pcm(t.take_id) as src:
                dst.write(wav_header(pcm_bytes, SAMPLE_RATE, t.channels))
                left = pcm_bytes
                while left > 0:
                    piece = src.read(min(COPY_CHUNK, left))
                    if not piece:
                        raise OSError(f"take {t.take_id}: its audio ended {left} bytes early")
                    dst.write(piece)
                    left -= len(piece)
            if t.has_codes:
                z.write(codes_path(t.take_id), f"takes/{t.take_id}.codes.npy")


# --------------------------------------------------------------------------- reading


_REPR = re.compile(r"<[^<>]*\bat 0x[0-9a-fA-F]+>")

# What reading a damaged or hostile zip raises, member by member (decoders, headers, truncation, CRC).
_READ_ERRORS: tuple[type[BaseException], ...] = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    NotImplementedError,
    RuntimeError,  # an encrypted member
    zlib.error,
    EOFError,
    wave.Error,
    struct.error,
    ValueError,
    KeyError,
    OSError,
)


@contextmanager
def _reading(what: str) -> Iterator[None]:
    """Errors raised while reading ``what`` from the archive become a 422 naming it."""
    try:
        yield
    except ProtocolError:
        raise
    except _READ_ERRORS as exc:
        detail = _REPR.sub("…", str(exc))[:120]  # said for a person: no object reprs from parsers
        raise bad(f"{what} is missing or damaged ({type(exc).__name__}: {detail})") from None


class _Budget:
    """Bytes written while unpacking, checked before every write."""

    def __init__(self, bounds: ArchiveBounds) -> None:
        self.used = 0
        self._max = bounds.max_unpacked_bytes
        self._room = bounds.room_bytes

    def spend(self, n: int) -> None:
        self.used += n
        if self.used > self._max:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"the archive unpacks to more than {self._max} bytes (max_session_archive_unpacked_bytes)",
                field="archive",
            )
        if self._room is not None and self.used > self._room:
            raise StorageFull(f"the data dir has no room for this archive ({self.used} bytes unpacked so far)")


def unpack_archive(
    source: str | Path | IO[bytes], staging: Path, bounds: ArchiveBounds
) -> tuple[list[UnpackedTake], int]:
    """Check the archive and unpack its takes into ``staging`` as ``<new take id>.pcm`` / ``.codes.npy``; the
    takes and the session's next take number.

    Take ids are issued anew (lineage and a splice's parts kept within the archive), numbers kept. Raises
    ProtocolError; what it wrote to ``staging`` is then the caller's to discard.
    """
    with _reading("the zip file"):
        z = zipfile.ZipFile(source)
    with z:
        members = _members(z, bounds)
        records, next_number = _records(z, members, bounds)
        renamed = {r["take_id"]: "t_" + secrets.token_urlsafe(9) for r in records}
        budget = _Budget(bounds)
        staging.mkdir(parents=True, exist_ok=True)
        out = []
        for r in records:
            old, new = r["take_id"], renamed[r["take_id"]]
            if r["has_codes"]:
                codes = _read_codes(z, members, old, bounds)
                codes_file = io.BytesIO()
                np.save(codes_file, codes, allow_pickle=False)
                budget.spend(codes_file.tell())
                _write_file(staging / f"{new}.codes.npy", [codes_file.getvalue()])
                codes_bytes, n_frames = codes_file.tell(), int(codes.shape[0])
            else:
                codes_bytes, n_frames = 0, _audio_frames(z, members, old, bounds)
            channels, pcm_bytes = _copy_audio(z, members, old, n_frames, staging / f"{new}.pcm", budget)
            if r["branch_frame"] > n_frames:
                raise bad(f"take {old}: branch_frame {r['branch_frame']} is past its {n_frames} frames")
            if r["parts"] and sum(p["to"] - p["from"] for p in r["parts"]) != n_frames * FRAME_SAMPLES:
                raise bad(f"take {old}: its parts do not add up to its {n_frames} frames")
            parts = [{**p, "take": renamed.get(p["take"]) if p["take"] is not None else None} for p in r["parts"]]
            take = StoredTake(
                take_id=new,
                request=r["request"],
                seed=r["seed"],
                n_frames=n_frames,
                channels=channels,
                parent=renamed.get(r["parent"]) if r["parent"] is not None else None,
                branch_frame=r["branch_frame"],
                reason=r["reason"],
                stats=r["stats"],
                created=r["created"],
                number=r["number"],
                kind=r["kind"],
                parts=parts,
                crossfade=r["crossfade"],
                has_codes=r["has_codes"],
                **r["notes"],
            )
            out.append(UnpackedTake(take, pcm_bytes + codes_bytes))
    return out, next_number


def _members(z: zipfile.ZipFile, bounds: ArchiveBounds) -> dict[str, zipfile.ZipInfo]:
    infos = z.infolist()
    if len(infos) > 2 * bounds.max_session_takes + 16:
        raise bad(f"{len(infos)} members; a session of at most {bounds.max_session_takes} takes has far fewer")
    members: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        if info.filename in members:
            raise bad(f"the member {info.filename[:80]!r} appears twice")
        members[info.filename] = info
        if info.filename != MANIFEST and not info.filename.startswith("takes/"):
            continue  # never read
        if info.flag_bits & 0x1:
            raise bad(f"{info.filename[:80]!r} is encrypted")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise bad(f"{info.filename[:80]!r} uses compression method {info.compress_type}; only stored or deflate")
    if MANIFEST not in members:
        raise bad(f"{MANIFEST} is missing")
    return members


def _records(
    z: zipfile.ZipFile, members: dict[str, zipfile.ZipInfo], bounds: ArchiveBounds
) -> tuple[list[dict[str, Any]], int]:
    limits = bounds.limits
    info = members[MANIFEST]
    if info.file_size > limits.max_session_json_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"{MANIFEST} is {info.file_size} bytes; at most {limits.max_session_json_bytes} (max_session_json_bytes)",
            field="archive",
        )
    with _reading(MANIFEST), z.open(info) as f:
        data = f.read(limits.max_session_json_bytes + 1)
    try:
        manifest = loads_bounded(
            data,
            max_bytes=limits.max_session_json_bytes,
            max_depth=limits.max_json_depth,
            max_values=bounds.max_json_values,
            what=MANIFEST,
        )
    except ProtocolError as err:
        code = ErrorCode.TOO_LARGE if err.code == ErrorCode.TOO_LARGE else ErrorCode.INVALID_FIELD
        raise bad(err.message, code=code) from None
    if not isinstance(manifest, dict) or manifest.get("moss_rt_session") != ARCHIVE_VERSION:
        raise bad(f"unknown version (this service reads version {ARCHIVE_VERSION})")
    if manifest.get("sample_rate", SAMPLE_RATE) != SAMPLE_RATE:
        raise bad(f"sample_rate must be {SAMPLE_RATE}")
    raw = manifest.get("takes")
    if not isinstance(raw, list) or len(raw) > bounds.max_session_takes:
        raise bad(f"'takes' must be a list of at most {bounds.max_session_takes} (max_session_takes)")
    records = [_record(r, i, bounds) for i, r in enumerate(raw)]
    seen: set[str] = set()
    for r in records:
        if r["take_id"] in seen:
            raise bad(f"take {r['take_id']} appears twice")
        seen.add(r["take_id"])
    return records, _number(records, manifest.get("next_number"))


def _number(records: list[dict[str, Any]], declared: Any) -> int:
    """Each record's number kept (an archive from before numbers: numbered in its order, after any given); the
    session's next number, past every one of them."""
    given = [r["number"] for r in records if r["number"]]
    if len(set(given)) != len(given):
        raise bad("two takes have the same number")
    last = max(given, default=0)
    for r in records:
        if not r["number"]:
            last += 1
            r["number"] = last
    if declared is not None:
        _int(declared, "next_number", 1, MAX_NUMBER, MANIFEST)
        last = max(last, declared - 1)
    return last + 1


def _int(value: Any, name: str, lo: int, hi: int, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise bad(f"{where}: '{name}' must be an integer in [{lo}, {hi}]")
    return value


def _record(r: Any, index: int, bounds: ArchiveBounds) -> dict[str, Any]:
    """One take record, every field checked and in its stored form (never more than the fields below)."""
    where = f"take record {index}"
    if not isinstance(r, dict):
        raise bad(f"{where} is not an object")
    take_id = r.get("take_id")
    if not isinstance(take_id, str) or not TAKE_ID.match(take_id):
        raise bad(f"{where} has no valid take_id")
    where = f"take {take_id}"
    seed = _int(r.get("seed"), "seed", 0, 2**63 - 1, where)
    request = r.get("request")
    if not isinstance(request, dict):
        raise bad(f"{where}: 'request' must be an object")
    try:
        start = dataclasses.replace(StartTake.parse(request, bounds.limits), seed=seed)
    except ProtocolError as err:
        raise bad(f"{where}: its request is not valid here ({err.message})") from None
    parent = r.get("parent")
    if parent is not None and (not isinstance(parent, str) or not TAKE_ID.match(parent)):
        raise bad(f"{where}: 'parent' must be a take id or null")
    reason = r.get("reason")
    if reason is not None and (not isinstance(reason, str) or len(reason) > MAX_REASON):
        raise bad(f"{where}: 'reason' must be short text or null")
    stats = r.get("stats") or {}
    if not isinstance(stats, dict) or len(stats) > MAX_STATS:
        raise bad(f"{where}: 'stats' must be an object of at most {MAX_STATS} numbers")
    kept_stats: dict[str, float] = {}
    for k, v in stats.items():
        if len(k) > 64:
            raise bad(f"{where}: a stats name is too long")
        if isinstance(v, bool) or not isinstance(v, int | float):
            continue  # not a number: dropped, as the live path drops them
        if not math.isfinite(v) or abs(v) > 1e15:
            raise bad(f"{where}: stats {k[:40]!r} is out of range")
        kept_stats[k] = v
    created = r.get("created")
    if created is None:
        created = time.time()
    if isinstance(created, bool) or not isinstance(created, int | float) or not 0 <= created <= 1e11:
        raise bad(f"{where}: 'created' must be a time in seconds")
    branch_frame = _int(r.get("branch_frame") or 0, "branch_frame", 0, bounds.max_take_frames, where)
    try:
        notes = check_notes({k: r[k] for k in NOTE_FIELDS if k in r})
    except ProtocolError as err:
        raise bad(f"{where}: {err.message}") from None
    number = _int(r.get("number") or 0, "number", 0, MAX_NUMBER, where)
    kind = r.get("kind", TakeKind.TAKE.value)
    if kind not in {k.value for k in TakeKind}:
        raise bad(f"{where}: 'kind' must be one of {', '.join(k.value for k in TakeKind)}")
    has_codes = r.get("has_codes", True)
    if not isinstance(has_codes, bool) or (not has_codes and kind == TakeKind.TAKE.value):
        raise bad(f"{where}: 'has_codes' must be true or false (false only for a splice or comp)")
    crossfade = _int(r.get("crossfade") or 0, "crossfade", 0, FRAME_SAMPLES, where)
    parts = _parts(r.get("parts") or [], kind, where, bounds)
    return {
        "take_id": take_id,
        "seed": seed,
        # As asked: a seed the server picked stays out of the request (the record's ``seed`` is the take's).
        "request": start.to_dict() if "seed" in request else {k: v for k, v in start.to_dict().items() if k != "seed"},
        "parent": parent,
        "reason": reason,
        "stats": kept_stats,
        "created": float(created),
        "branch_frame": branch_frame,
        "notes": notes,
        "number": number,
        "kind": kind,
        "parts": parts,
        "crossfade": crossfade,
        "has_codes": has_codes,
    }


def _parts(raw: Any, kind: str, where: str, bounds: ArchiveBounds) -> list[dict[str, Any]]:
    """A splice's or comp's parts, checked: ``{"take": id or null, "number", "from", "to"}``, whole frames."""
    limit = bounds.limits.max_splice_parts
    if kind == TakeKind.TAKE.value:
        if raw:
            raise bad(f"{where}: only a splice or comp has 'parts'")
        return []
    if not isinstance(raw, list) or not 1 <= len(raw) <= limit:
        raise bad(f"{where}: 'parts' must be a list of 1 to {limit} regions (max_splice_parts)")
    out = []
    for i, p in enumerate(raw):
        at = f"{where}, part {i}"
        if not isinstance(p, dict):
            raise bad(f"{at} is not an object")
        take = p.get("take")
        if take is not None and (not isinstance(take, str) or not TAKE_ID.match(take)):
            raise bad(f"{at}: 'take' must be a take id or null")
        top = bounds.max_take_frames * FRAME_SAMPLES
        start, end = _int(p.get("from"), "from", 0, top, at), _int(p.get("to"), "to", 0, top, at)
        if start % FRAME_SAMPLES or end % FRAME_SAMPLES or end <= start:
            raise bad(f"{at}: 'from' and 'to' must be whole frames, 'to' after 'from'")
        number = _int(p.get("number") or 0, "number", 0, MAX_NUMBER, at)
        out.append({"take": take, "number": number, "from": start, "to": end})
    return out


def _member(members: dict[str, zipfile.ZipInfo], name: str, take_id: str) -> zipfile.ZipInfo:
    info = members.get(name)
    if info is None:
        raise bad(f"take {take_id}: its audio or codes are missing or damaged ({name} is missing)")
    return info


def _read_codes(z: zipfile.ZipFile, members: dict[str, zipfile.ZipInfo], take_id: str, bounds: ArchiveBounds) -> Any:
    """A take's codes as int64 [n, 12], from the header's promise first, every code within the codebook."""
    name = f"takes/{take_id}.codes.npy"
    info = _member(members, name, take_id)
    with _reading(name), z.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise bad(f"{name}: .npy version {version} is not supported")
        if dtype.kind not in CODE_KINDS or dtype.itemsize > 8 or dtype.hasobject:
            raise bad(f"{name}: codes must be integers, not {dtype}")
        if len(shape) != 2 or shape[1] != N_CODEBOOKS:
            raise bad(f"{name}: codes must be [frames, {N_CODEBOOKS}], not {list(shape)[:4]}")
        n = int(shape[0])
        if n > bounds.max_take_frames:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"take {take_id} holds {n} frames; a take holds at most {bounds.max_take_frames}",
                field="archive",
            )
        size = n * N_CODEBOOKS * dtype.itemsize
        data = f.read(size)
        if len(data) != size:
            raise bad(f"{name}: the codes end early")
    codes = np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran else "C")
    if n and (int(codes.min()) < 0 or int(codes.max()) >= bounds.codebook_size):
        raise ProtocolError(
            ErrorCode.INVALID_FIELD,
            f"take {take_id}: codes must lie in [0, {bounds.codebook_size - 1}] (the codebook of this model); "
            f"found {int(codes.min())} … {int(codes.max())}",
            field="archive",
        )
    return np.ascontiguousarray(codes, dtype=np.int64)


def _audio_frames(z: zipfile.ZipFile, members: dict[str, zipfile.ZipInfo], take_id: str, bounds: ArchiveBounds) -> int:
    """Frames of a take without codes, from its WAV header: whole frames, at most the frame cap."""
    name = f"takes/{take_id}.wav"
    info = _member(members, name, take_id)
    with _reading(name), z.open(info) as f, wave.open(f) as w:
        samples = int(w.getnframes())
    if samples % FRAME_SAMPLES:
        raise bad(f"{name}: holds {samples} samples, not whole {FRAME_SAMPLES}-sample frames")
    n = samples // FRAME_SAMPLES
    if n > bounds.max_take_frames:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"take {take_id} holds {n} frames; a take holds at most {bounds.max_take_frames}",
            field="archive",
        )
    return n


def _copy_audio(
    z: zipfile.ZipFile,
    members: dict[str, zipfile.ZipInfo],
    take_id: str,
    n_frames: int,
    dest: Path,
    budget: _Budget,
) -> tuple[int, int]:
    """Copy a take's WAV samples into ``dest`` in pieces; (channels, bytes written)."""
    name = f"takes/{take_id}.wav"
    info = _member(members, name, take_id)
    expected_samples = n_frames * FRAME_SAMPLES
    with contextlib.ExitStack() as stack:
        with _reading(name):
            w = stack.enter_context(wave.open(stack.enter_context(z.open(info))))
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            declared = w.getnframes()
        if rate != SAMPLE_RATE or width != 2 or channels not in (1, 2):
            raise bad(f"{name}: audio must be {SAMPLE_RATE} Hz 16-bit mono or stereo")
        if declared != expected_samples:
            raise bad(f"{name}: holds {declared} samples; its {n_frames} frames of codes need {expected_samples}")
        total = expected_samples * channels * 2
        budget.spend(total)  # refused before a byte is written when the take alone is over the budget
        _write_file(dest, _wav_pieces(w, expected_samples, name))
    return channels, total


def _wav_pieces(w: wave.Wave_read, samples: int, name: str) -> Iterator[bytes]:
    """The samples in pieces; reading errors (truncation, a bad CRC at the member's end) are the archive's."""
    frame_bytes = 2 * w.getnchannels()
    per_piece = max(1, COPY_CHUNK // frame_bytes)
    left = samples
    while left > 0:
        with _reading(name):
            piece = w.readframes(min(per_piece, left))
        if not piece or len(piece) % frame_bytes:
            raise bad(f"{name}: the audio ends {left} samples early")
        left -= len(piece) // frame_bytes
        yield piece


def _write_file(path: Path, pieces: Any) -> None:
    """Write ``pieces`` into a new file and fsync it; a full disk is a 507, not a 500."""
    try:
        with open(path, "wb") as out:
            for piece in pieces:
                out.write(piece)
            out.flush()
            os.fsync(out.fileno())
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageFull("the disk is full") from None
        raise


def discard(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
