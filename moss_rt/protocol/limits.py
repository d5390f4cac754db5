"""Input limits. Defaults here; the service overrides them from Settings (flags / MOSS_RT_* env)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    max_text_chars: int = 5000
    max_instruction_chars: int = 5000
    max_new_tokens: int = 4096  # frames; 4096 frames = 327.7 s, the model's own default budget
    min_chunk_frames: int = 1
    max_chunk_frames: int = 100
    max_message_bytes: int = 64 * 1024  # one client control message (JSON text or msgpack)
    max_request_bytes: int = 256 * 1024  # one POST /api/stream body
    max_takes_kept: int = 32  # take history per WebSocket connection
    max_upload_bytes: int = 20 * 1024 * 1024
    max_upload_seconds: float = 60.0
    min_upload_seconds: float = 0.5

    def to_dict(self) -> dict[str, int | float]:
        return asdict(self)
