"""Session archives for tests and the soak: valid ones of any shape, and a corpus of hostile ones.

Built by hand (``zipfile``, ``wave``, ``numpy``), not by the service, so a test controls every byte: lying
headers, forged codes, JSON the service never writes.
"""

from __future__ import annotations

import io
import json
import struct
import warnings
import wave
import zipfile
from typing import Any

import numpy as np

from moss_rt.protocol import FRAME_SAMPLES, StartTake

SAMPLE_RATE = 48000


def take_record(take_id: str, *, seed: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "take_id": take_id,
        "seed": seed,
        "request": StartTake(text=f"line of {take_id}", seed=seed).to_dict(),
        "reason": "done",
        "stats": {"ttfa_ms": 50.0},
        **extra,
    }


def wav_of(n_frames: int, channels: int = 1, *, silent: bool = True, rate: int = SAMPLE_RATE, width: int = 2) -> bytes:
    samples = n_frames * FRAME_SAMPLES
    if silent:
        pcm = bytes(samples * channels * width)
    else:
        rng = np.random.default_rng(n_frames)
        pcm = rng.integers(-20000, 20000, size=samples * channels, dtype=np.int16).tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(pcm)
    return buf.getvalue()


def npy_of(codes: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, codes, allow_pickle=True)
    return buf.getvalue()


def codes_of(n_frames: int, *, value: int | None = None) -> np.ndarray:
    if value is not None:
        return np.full((n_frames, 12), value, dtype=np.int64)
    return np.random.default_rng(n_frames).integers(0, 1024, size=(n_frames, 12), dtype=np.int64)


def archive(
    takes: list[tuple[dict[str, Any], bytes | None, bytes | None]],
    *,
    manifest: Any = None,
    compression: int = zipfile.ZIP_DEFLATED,
) -> bytes:
    """A zip of ``session.json`` (the records, or ``manifest`` as given) and each take's wav and codes member
    (None: left out)."""
    buf = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(buf, "w", compression=compression) as z:
        warnings.simplefilter("ignore")  # duplicate member names are one of the hostile cases
        body = manifest if manifest is not None else {"moss_rt_session": 1, "takes": [t[0] for t in takes]}
        z.writestr("session.json", body if isinstance(body, str | bytes) else json.dumps(body))
        for record, wav, npy in takes:
            name = record.get("take_id", "t_unnamed")
            if wav is not None:
                z.writestr(f"takes/{name}.wav", wav)
            if npy is not None:
                z.writestr(f"takes/{name}.codes.npy", npy)
    return buf.getvalue()


def valid_archive(n_takes: int = 2, n_frames: int = 4, channels: int = 1, *, silent: bool = False) -> bytes:
    takes = [
        (take_record(f"t_take{i}", seed=i + 1), wav_of(n_frames, channels, silent=silent), npy_of(codes_of(n_frames)))
        for i in range(n_takes)
    ]
    return archive(takes)


def one_take(record: dict[str, Any] | None = None, *, frames: int = 2, wav: bytes | None = None,
             npy: bytes | None = None, **kw: Any) -> bytes:  # fmt: skip
    """An archive of one take, any part of which may be replaced."""
    record = record if record is not None else take_record("t_one")
    return archive(
        [(record, wav if wav is not None else wav_of(frames), npy if npy is not None else npy_of(codes_of(frames)))],
        **kw,
    )


def _encrypted_flag(data: bytes) -> bytes:
    """Set the 'encrypted' bit of every member (local and central headers) of a stored zip."""
    out = bytearray(data)
    for sig, offset in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        start = 0
        while (i := out.find(sig, start)) >= 0:
            flags = struct.unpack_from("<H", out, i + offset)[0] | 0x1
            struct.pack_into("<H", out, i + offset, flags)
            start = i + 4
    return bytes(out)


def _corrupt_crc(data: bytes) -> bytes:
    """Flip a byte in the middle of a stored member's data (CRC mismatch on read)."""
    out = bytearray(data)
    out[len(out) // 3] ^= 0xFF
    return bytes(out)


def deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


def hostile_archives() -> dict[str, bytes]:
    """Archives that must each be refused with a 4xx (never a 5xx), leaving nothing stored."""
    ok = take_record("t_one")
    out: dict[str, bytes] = {
        "empty body": b"",
        "not a zip": b"PK\x03\x04 nothing else",
        "truncated zip": valid_archive()[:-40],
        "bad crc": _corrupt_crc(one_take(frames=40, compression=zipfile.ZIP_STORED)),
        "encrypted member": _encrypted_flag(one_take(compression=zipfile.ZIP_STORED)),
        "bzip2 member": one_take(compression=zipfile.ZIP_BZIP2),
        "lzma member": one_take(compression=zipfile.ZIP_LZMA),
        "json not an object": archive([], manifest="[1, 2, 3]"),
        "json NaN": archive([], manifest='{"moss_rt_session": 1, "takes": [], "x": NaN}'),
        "json Infinity stats": one_take(take_record("t_one", stats={"rtf": 1e999})),
        "json 1e999 stats": archive(
            [(ok, wav_of(2), npy_of(codes_of(2)))],
            manifest=json.dumps({"moss_rt_session": 1, "takes": [{**ok, "stats": {"rtf": 1.5}}]}).replace(
                "1.5", "1e999"
            ),
        ),
        "json 100k deep": archive([], manifest='{"moss_rt_session": 1, "takes": ' + deep_json(100_000) + "}"),
        "json 50 MB": archive([], manifest=" " * (50 * 1024 * 1024) + "{}"),
        "json million values": archive([], manifest='{"moss_rt_session": 1, "takes": [' + "{}," * 10**6 + "{}]}"),
        "json huge int": one_take(take_record("t_one", branch_frame=10**30)),
        "json 5000-digit int": archive([], manifest='{"moss_rt_session": 1, "takes": [' + "9" * 5000 + "]}"),
        "seed too large": one_take(take_record("t_one", seed=2**70)),
        "seed text": one_take({**ok, "seed": "seven"}),
        "reason an object": one_take(take_record("t_one", reason={"a": 1})),
        "title null": one_take(take_record("t_one", title=None)),
        "parent a list": one_take(take_record("t_one", parent=["x"])),
        "stats a list": one_take(take_record("t_one", stats=[1, 2])),
        "created NaN-ish": one_take(take_record("t_one", created=-5)),
        "request deep": one_take({**ok, "request": {"text": "x", "sampling": json.loads(deep_json(500))}}),
        "request invalid": one_take({**ok, "request": {"text": "x", "channels": 7}}),
        "no take_id": one_take({k: v for k, v in ok.items() if k != "take_id"}),
        "duplicate take ids": archive([(ok, wav_of(2), npy_of(codes_of(2))), (ok, wav_of(2), npy_of(codes_of(2)))]),
        "missing wav": archive([(ok, None, npy_of(codes_of(2)))]),
        "codes out of range": one_take(npy=npy_of(codes_of(2, value=999_999))),
        "codes negative": one_take(npy=npy_of(codes_of(2, value=-1))),
        "codes float": one_take(npy=npy_of(codes_of(2).astype(np.float32))),
        "codes pickled": one_take(npy=npy_of(np.array([{"x": 1}], dtype=object))),
        "codes wrong shape": one_take(npy=npy_of(np.zeros((2, 7), dtype=np.int64))),
        "codes over the frame cap": one_take(npy=npy_of(np.zeros((40_000, 12), dtype=np.int16))),
        "codes truncated": one_take(npy=npy_of(codes_of(2))[:-30]),
        "npy header garbage": one_take(npy=b"\x93NUMPY\x01\x00\x10\x00{'descr': zzz }    \n"),
        "wav 8-bit": one_take(wav=wav_of(2, width=1)),
        "wav 44.1 kHz": one_take(wav=wav_of(2, rate=44100)),
        "wav too short": one_take(wav=wav_of(1)),
        "wav garbage": one_take(wav=b"RIFF\xff\xff\xff\xffWAVEjunk"),
        "wav truncated data": one_take(wav=wav_of(2)[:-1000]),
    }
    return out
