"""Input limits. Defaults here; the service overrides them from Settings (flags / MOSS_RT_* env)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    # A first, cheap check; the prompt (instruction + text + reference frames) must then also fit the
    # take's cache (Settings.max_seq_len, 5120 positions) with room for its frames. 4000 keeps a text
    # at the limit within that even at one token per character (what ASCII noise costs).
    max_text_chars: int = 4000
    max_instruction_chars: int = 5000
    max_new_tokens: int = 4096  # frames; 4096 frames = 327.7 s, the model's own default budget
    min_chunk_frames: int = 1
    max_chunk_frames: int = 100
    max_message_bytes: int = 64 * 1024  # one client control message (JSON text or msgpack)
    max_request_bytes: int = 256 * 1024  # one POST /api/stream body
    max_takes_kept: int = 32  # take history per WebSocket connection (one without a session)
    max_session_takes: int = 200  # takes a directing session keeps on disk until the director deletes them
    max_session_archive_bytes: int = 1024 * 1024 * 1024  # one imported session archive (zip)
    # What one import may unpack to (audio + codes), counted while it is read: a small zip of silence cannot
    # become more than this on disk, whatever its headers say.
    max_session_archive_unpacked_bytes: int = 2 * 1024 * 1024 * 1024
    max_session_json_bytes: int = 8 * 1024 * 1024  # an archive's session.json (records of up to 200 takes)
    max_json_depth: int = 32  # nesting of a stored JSON document (session.json, notes); the records need 5
    max_sessions: int = 10_000  # directing sessions kept on disk, all clients together
    max_sessions_per_client: int = 100  # sessions one client (address) may have created and still keep; 0: no cap
    max_upload_bytes: int = 20 * 1024 * 1024
    max_upload_seconds: float = 60.0
    min_upload_seconds: float = 0.5
    # Upload decoding guards: refused from the header, before any sample is decoded.
    min_upload_sample_rate: int = 8000
    max_upload_sample_rate: int = 192000
    max_upload_channels: int = 8
    # frames x channels of one upload; bounds decode work however well the file compresses
    # (a few KB of FLAC silence can declare hours of audio). 60 s of 192 kHz stereo fits.
    max_upload_samples: int = 24_000_000
    max_stored_voices: int = 1000  # uploaded voices kept on disk; more are refused (rate_limited)
    max_voices_per_owner: int = 50  # uploaded voices one client (address) may keep; 0: no cap
    # POST /api/align: the audio (body bytes and decoded seconds; a take lasts at most 327.7 s).
    max_align_bytes: int = 64 * 1024 * 1024
    max_align_seconds: float = 330.0
    # WebSocket control messages per connection: a token bucket refilled at this rate.
    ws_messages_per_sec: float = 20.0
    ws_message_burst: int = 40
    # Scripts (docs/scripts.md): cues of one script, its body, the longest pause and gap in its mix.
    max_script_lines: int = 500
    max_script_bytes: int = 1024 * 1024
    max_pause_sec: float = 60.0
    max_gap_sec: float = 10.0
    # Splices and comps (POST /api/sessions/{id}/takes): regions joined into one stored take.
    max_splice_parts: int = 64

    def to_dict(self) -> dict[str, int | float]:
        return asdict(self)


# The help line of each limit's ``serve --limit-…`` flag (docs/limits.md has the full table).
LIMIT_HELP: dict[str, str] = {
    "max_text_chars": "characters of a take's text",
    "max_instruction_chars": "characters of a take's instruction",
    "max_new_tokens": "80 ms frames one take may generate",
    "min_chunk_frames": "smallest chunk_frames a client may ask for",
    "max_chunk_frames": "largest chunk_frames a client may ask for",
    "max_message_bytes": "bytes of one WebSocket control message",
    "max_request_bytes": "bytes of one POST /api/stream or /v1/audio/speech body",
    "max_takes_kept": "take history kept per WebSocket connection without a session",
    "max_session_takes": "takes one directing session keeps on disk until deleted (resume)",
    "max_session_archive_bytes": "largest session archive accepted by POST /api/sessions/import",
    "max_session_archive_unpacked_bytes": "bytes one imported archive may unpack to (audio and codes)",
    "max_session_json_bytes": "bytes of an imported archive's session.json",
    "max_json_depth": "nesting depth of an imported session.json",
    "max_sessions": "directing sessions kept on disk in all",
    "max_sessions_per_client": "directing sessions one client address may keep (0: no cap)",
    "max_upload_bytes": "bytes of one uploaded reference voice",
    "max_upload_seconds": "seconds of one uploaded reference voice",
    "min_upload_seconds": "shortest uploaded reference voice, in seconds",
    "min_upload_sample_rate": "lowest sample rate of an upload",
    "max_upload_sample_rate": "highest sample rate of an upload",
    "max_upload_channels": "channels of an upload",
    "max_upload_samples": "frames x channels of one upload",
    "max_stored_voices": "uploaded voices kept on disk",
    "max_voices_per_owner": "uploaded voices one client may keep (0: no cap)",
    "max_align_bytes": "bytes of one POST /api/align body",
    "max_align_seconds": "seconds of audio POST /api/align accepts",
    "ws_messages_per_sec": "WebSocket control messages per second per connection",
    "ws_message_burst": "burst of WebSocket control messages above that rate",
    "max_script_lines": "spoken lines (cues) of one script",
    "max_script_bytes": "bytes of one POST /api/scripts body",
    "max_pause_sec": "longest [pause] of a script, in seconds",
    "max_gap_sec": "longest gap between a script's lines (gap_sec, scene_gap_sec), in seconds",
    "max_splice_parts": "regions one splice or comp joins (POST /api/sessions/{id}/takes)",
}
