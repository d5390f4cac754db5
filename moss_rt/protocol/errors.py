"""Stable error codes shared by both transports (HTTP JSON bodies and tag-0 error frames)."""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Wire-stable error codes; clients may switch on these strings."""

    BAD_JSON = "bad_json"
    BAD_MESSAGE = "bad_message"
    UNKNOWN_TYPE = "unknown_type"
    INVALID_FIELD = "invalid_field"
    TOO_LARGE = "too_large"
    NOT_FOUND = "not_found"
    BUSY = "busy"
    LOADING = "loading"  # the engine is still loading its model (503 + Retry-After)
    RATE_LIMITED = "rate_limited"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN_ORIGIN = "forbidden_origin"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    TIMEOUT = "timeout"
    INTERNAL = "internal"
    REPLICA_LOST = "replica_lost"  # cluster mode: the engine replica running the take died
    INSUFFICIENT_STORAGE = "insufficient_storage"  # the data dir's budget (or disk) cannot keep it: HTTP 507


class ProtocolError(Exception):
    """Any malformed input. Carries a stable code, a human message and optionally the field."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        field: str | None = None,
        fatal: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.fatal = fatal

    def to_dict(self) -> dict[str, object]:
        """The body of an error message (without ``type``)."""
        body: dict[str, object] = {"code": self.code.value, "message": self.message}
        if self.field is not None:
            body["field"] = self.field
        return body

    def __repr__(self) -> str:
        return f"ProtocolError({self.code.value!r}, {self.message!r}, field={self.field!r})"
