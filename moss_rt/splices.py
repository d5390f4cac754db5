"""Splices and comps: stored takes made of regions of other stored takes, joined in order (sans-I/O, numpy).

A director keeps the old tail after a region retake ("splice": the retake up to the region's end, then the old take
from there) or joins regions of several takes ("comp"). Either is a take of the session like any other, assembled
here from the stored audio of its sources, to the sample; the studio shows what the service made.

The join, as the studio made it before the service did (static/js/director.js, ``spliceOldTail``): parts are
regions ``[from, to)`` of whole frames. Part *i* (``i > 0``) starts with a crossfade of ``X`` samples: for
``k < X``, with ``w = (k + 0.5) / X``,

    out[k] = round(prev[to_prev + k] * (1 - w) + cur[from + k] * w)

where ``prev`` is the previous part's take, read *past* its region's end (the old audio fades out while the new
fades in; the crossfade does not shorten anything), and ``round`` is JavaScript's ``Math.round`` (halves up), in
float64 as JavaScript computes it. So a splice is as long as its parts together. Parts of other channel counts
are made stereo when any part is (the mono channel twice), as a comp always was.

Codes: a splice whose joins are whole frames with no crossfade is whole frames of codes, its sources' codes
concatenated (when every source has codes); a retake of it rebuilds the model and codec state from those codes as
from any stored take's. A crossfade mixes the audio inside a frame, so such a splice has no codes and cannot be
continued by the model (the studio says why).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moss_rt.protocol import FRAME_SAMPLES, N_CODEBOOKS, ErrorCode, ProtocolError
from moss_rt.session_records import TAKE_ID, TakeKind, check_notes

MAX_CROSSFADE = FRAME_SAMPLES  # samples (80 ms): a join's crossfade lies within one frame
EDIT_KINDS = (TakeKind.SPLICE.value, TakeKind.COMP.value)
EDIT_NOTE_FIELDS = ("title", "starred", "note")


@dataclass(frozen=True)
class Part:
    """Samples ``[start, end)`` of stored take ``take`` (whole frames)."""

    take: str
    start: int
    end: int

    @property
    def samples(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class EditRequest:
    """A checked ``POST /api/sessions/{id}/takes`` body: a splice or comp to assemble."""

    kind: str
    parts: tuple[Part, ...]
    crossfade: int
    notes: dict[str, Any]

    @property
    def samples(self) -> int:
        return sum(p.samples for p in self.parts)


def _invalid(message: str, field: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_FIELD, message, field=field)


def _whole_int(value: Any, name: str, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _invalid(f"{name} must be an integer >= 0", field)
    return value


def parse_edit_request(body: Any, *, max_parts: int) -> EditRequest:
    """The body of ``POST /api/sessions/{id}/takes``, every field checked (``invalid_field`` naming it)."""
    if not isinstance(body, dict):
        raise _invalid("the body must be a JSON object", "body")
    known = {"kind", "parts", "crossfade", *EDIT_NOTE_FIELDS}
    for key in body:
        if key not in known:
            raise _invalid(f"unknown field {str(key)[:40]!r} (a splice or comp takes {', '.join(sorted(known))})", key)
    kind = body.get("kind")
    if kind not in EDIT_KINDS:
        raise _invalid(f"'kind' must be one of {', '.join(EDIT_KINDS)}", "kind")
    raw = body.get("parts")
    if not isinstance(raw, list) or not 1 <= len(raw) <= max_parts:
        raise _invalid(f"'parts' must be a list of 1 to {max_parts} regions (max_splice_parts)", "parts")
    parts = []
    for i, item in enumerate(raw):
        where = f"parts[{i}]"
        if not isinstance(item, dict) or set(item) - {"take", "from", "to"}:
            raise _invalid(f"{where} must be {{'take': id, 'from': sample, 'to': sample}}", where)
        take = item.get("take")
        if not isinstance(take, str) or not TAKE_ID.match(take):
            raise _invalid(f"{where}.take must be a take id of this session", f"{where}.take")
        start = _whole_int(item.get("from"), f"{where}.from", f"{where}.from")
        end = _whole_int(item.get("to"), f"{where}.to", f"{where}.to")
        if start % FRAME_SAMPLES or end % FRAME_SAMPLES:
            raise _invalid(
                f"{where}: 'from' and 'to' must be whole frames (multiples of {FRAME_SAMPLES} samples)", where
            )
        if end <= start:
            raise _invalid(f"{where}: 'to' must be after 'from'", where)
        parts.append(Part(take, start, end))
    crossfade = _whole_int(body.get("crossfade", 0), "'crossfade'", "crossfade")
    if crossfade > MAX_CROSSFADE:
        raise _invalid(f"'crossfade' is at most {MAX_CROSSFADE} samples (one frame)", "crossfade")
    for i, part in enumerate(parts[1:], start=1):
        if crossfade and part.samples < crossfade:
            raise _invalid(f"parts[{i}] is shorter than the crossfade into it ({crossfade} samples)", f"parts[{i}]")
    notes = check_notes({k: body[k] for k in EDIT_NOTE_FIELDS if k in body})
    return EditRequest(kind, tuple(parts), crossfade, notes)


@dataclass(frozen=True)
class Source:
    """What the assembly needs to know of a part's take before reading it."""

    samples: int  # its length
    channels: int
    has_codes: bool


def check_sources(request: EditRequest, sources: dict[str, Source]) -> None:
    """Every part lies within its take, and every part but the last has ``crossfade`` samples after it to fade
    out (``invalid_field`` naming the part)."""
    last = len(request.parts) - 1
    for i, part in enumerate(request.parts):
        source = sources[part.take]
        if part.end > source.samples:
            raise _invalid(
                f"parts[{i}] ends at sample {part.end}, past the {source.samples} samples of take {part.take}",
                f"parts[{i}]",
            )
        if i < last and request.crossfade and part.end + request.crossfade > source.samples:
            raise _invalid(
                f"parts[{i}]: take {part.take} has no {request.crossfade} samples after sample {part.end} to fade "
                "out over the next part (end the region earlier, or join without a crossfade)",
                f"parts[{i}]",
            )


def has_codes(request: EditRequest, sources: dict[str, Source]) -> bool:
    """Whether the edit is whole frames of codes: no crossfade, every source with codes."""
    return request.crossfade == 0 and all(sources[p.take].has_codes for p in request.parts)


def to_channels(pcm: np.ndarray, channels: int) -> np.ndarray:
    """``[n, c]`` int16 as ``[n, channels]``: mono made stereo by doubling it (never mixed down)."""
    if pcm.shape[1] == channels:
        return pcm
    if pcm.shape[1] == 1:
        return np.repeat(pcm, channels, axis=1)
    raise ValueError(f"cannot make {pcm.shape[1]} channels into {channels}")


def crossfade(fading_out: np.ndarray, fading_in: np.ndarray) -> np.ndarray:
    """``X`` samples of the old audio fading out under the new fading in (both ``[X, ch]`` int16), as the module
    says: ``w = (k + 0.5) / X``, ``round(old * (1 - w) + new * w)`` with halves rounded up."""
    n = fading_in.shape[0]
    w = ((np.arange(n, dtype=np.float64) + 0.5) / n)[:, None]
    mixed = fading_out.astype(np.float64) * (1.0 - w) + fading_in.astype(np.float64) * w
    out: np.ndarray = np.clip(np.floor(mixed + 0.5), -32768, 32767).astype(np.int16)
    return out


@dataclass(frozen=True)
class PartAudio:
    """A part's samples (``[n, ch]`` int16) and, for every part but the last when there is a crossfade, the
    ``crossfade`` samples of its take right after it (what fades out)."""

    region: np.ndarray
    after: np.ndarray | None = None


def assemble(pieces: Sequence[PartAudio], crossfade_samples: int) -> np.ndarray:
    """The edit's audio, ``[sum of parts, ch]`` int16, ``ch`` the most channels of any part."""
    channels = max(p.region.shape[1] for p in pieces)
    out = np.empty((sum(p.region.shape[0] for p in pieces), channels), dtype=np.int16)
    at = 0
    previous: PartAudio | None = None
    for piece in pieces:
        region = to_channels(piece.region, channels)
        n = region.shape[0]
        out[at : at + n] = region
        if previous is not None and crossfade_samples:
            assert previous.after is not None and previous.after.shape[0] == crossfade_samples
            old = to_channels(previous.after, channels)
            out[at : at + crossfade_samples] = crossfade(old, region[:crossfade_samples])
        at += n
        previous = piece
    return out


def assemble_codes(parts: Sequence[Part], codes: Sequence[np.ndarray]) -> np.ndarray:
    """The codes of a whole-frame edit: each part's frames of its take's codes, in order (``[n, 12]`` int64)."""
    pieces = [c[p.start // FRAME_SAMPLES : p.end // FRAME_SAMPLES] for p, c in zip(parts, codes, strict=True)]
    if not pieces:
        return np.zeros((0, N_CODEBOOKS), dtype=np.int64)
    return np.ascontiguousarray(np.concatenate(pieces, axis=0), dtype=np.int64)


def joins(parts: Sequence[Part]) -> list[int]:
    """Where each join lies in the edit (samples from its start): the start of every part but the first."""
    out, at = [], 0
    for part in parts[:-1]:
        at += part.samples
        out.append(at)
    return out
