"""The records of stored directing sessions: ids, a stored take, the director's notes, and the store's refusals.

Shared by the session store (:mod:`moss_rt.session_store`) and the archive format (:mod:`moss_rt.session_archive`),
which both build on them; neither imports the other's module for them.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from moss_rt.protocol import FRAME_SAMPLES, ErrorCode, ProtocolError

SESSION_ID = re.compile(r"^s_[A-Za-z0-9_-]{16,64}$")
TAKE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
NOTE_FIELDS = ("title", "starred", "note", "markers")
MAX_TITLE = 80
MAX_NOTE = 2000
MAX_MARKERS = 200


def new_session_id() -> str:
    # Unguessable: a session id is the capability to read it.
    return "s_" + secrets.token_urlsafe(18)


def short_id(session_id: str) -> str:
    """A session id as logs show it: enough to tell sessions apart, never enough to open one."""
    return session_id[:6] + "…"


class StorageFull(ProtocolError):
    """The data dir's budget (or the disk) cannot keep what was asked: HTTP 507 ``insufficient_storage``."""

    def __init__(self, why: str) -> None:
        super().__init__(
            ErrorCode.INSUFFICIENT_STORAGE,
            f"not enough storage: {why}; delete takes or sessions you no longer need, or ask the operator for room",
        )


class SessionFull(ProtocolError):
    """The session keeps ``max_session_takes`` takes already (``Limits.max_session_takes``): HTTP 413 ``too_large``."""

    def __init__(self, max_session_takes: int) -> None:
        super().__init__(
            ErrorCode.TOO_LARGE,
            f"this session already keeps {max_session_takes} takes, the most one session may; delete takes you no "
            "longer need (or export the session and start a new one) to record more",
        )


@dataclass
class StoredTake:
    """One take of a session as stored: everything needed to list, play, download and retake it."""

    take_id: str
    request: dict[str, Any]  # StartTake.to_dict(): the take's own direction and parameters
    seed: int
    n_frames: int
    channels: int
    parent: str | None = None
    branch_frame: int = 0  # frames [0, branch_frame) came from the parent
    reason: str | None = None
    stats: dict[str, float] = field(default_factory=dict)
    title: str = ""
    starred: bool = False
    note: str = ""
    markers: list[dict[str, Any]] = field(default_factory=list)  # [{"sample": int, "label": str}]
    created: float = field(default_factory=time.time)
    seq: int = 0  # order within the session (assigned by the store)

    def public(self) -> dict[str, Any]:
        """The record as sent to a client (``resume``) and written to an archive's session.json."""
        return {**dataclasses.asdict(self), "seed": self.seed}


def check_notes(notes: dict[str, Any]) -> dict[str, Any]:
    """The director's notes on a take, checked (the store's PATCH and an archive's records alike)."""
    out: dict[str, Any] = {}
    for key, value in notes.items():
        if key not in NOTE_FIELDS:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"unknown take note {key!r}", field=key)
        if key == "starred":
            if not isinstance(value, bool):
                raise ProtocolError(ErrorCode.INVALID_FIELD, "'starred' must be true or false", field=key)
        elif key == "markers":
            if not isinstance(value, list) or len(value) > MAX_MARKERS:
                raise ProtocolError(
                    ErrorCode.INVALID_FIELD, f"'markers' must be a list of at most {MAX_MARKERS}", field=key
                )
            for m in value:
                if not (
                    isinstance(m, dict)
                    and isinstance(m.get("sample"), int)
                    and m["sample"] >= 0
                    and isinstance(m.get("label"), str)
                    and len(m["label"]) <= MAX_TITLE
                ):
                    raise ProtocolError(
                        ErrorCode.INVALID_FIELD, "a marker is {'sample': int >= 0, 'label': short text}", field=key
                    )
            value = [{"sample": m["sample"], "label": m["label"]} for m in value]
        else:
            limit = MAX_TITLE if key == "title" else MAX_NOTE
            if not isinstance(value, str) or len(value) > limit:
                raise ProtocolError(
                    ErrorCode.INVALID_FIELD, f"{key!r} must be text of at most {limit} characters", field=key
                )
        out[key] = value
    return out



def pcm_bytes(take: StoredTake) -> int:
    """Bytes of a take's stored audio: int16 samples, FRAME_SAMPLES per frame per channel."""
    return take.n_frames * FRAME_SAMPLES * take.channels * 2
