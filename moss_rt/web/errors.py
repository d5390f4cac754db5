"""Mapping of protocol errors to HTTP answers: always a JSON body with a stable code."""

from __future__ import annotations

from aiohttp import web

from moss_rt.protocol import ErrorCode, ProtocolError

HTTP_STATUS = {
    ErrorCode.BAD_JSON: 400,
    ErrorCode.BAD_MESSAGE: 400,
    ErrorCode.UNKNOWN_TYPE: 400,
    ErrorCode.INVALID_FIELD: 422,
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.BUSY: 503,
    ErrorCode.LOADING: 503,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN_ORIGIN: 403,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorCode.TIMEOUT: 408,
    ErrorCode.INTERNAL: 500,
    ErrorCode.INSUFFICIENT_STORAGE: 507,
}


def error_response(
    code: ErrorCode, message: str, *, field: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    body: dict[str, object] = {"code": code.value, "message": message}
    if field is not None:
        body["field"] = field
    response = web.json_response({"error": body}, status=HTTP_STATUS[code], headers=headers)
    if code == ErrorCode.TIMEOUT:
        response.force_close()  # the rest of a stalled body is never read: the connection ends here
    return response


def protocol_error_response(err: ProtocolError) -> web.Response:
    return error_response(err.code, err.message, field=err.field)


def busy_response(retry_after_sec: float, *, loading: bool = False) -> web.Response:
    """503 with Retry-After: ``loading`` while the engine loads its model, else ``busy`` (at capacity)."""
    return error_response(
        ErrorCode.LOADING if loading else ErrorCode.BUSY,
        "the model is still loading; retry shortly" if loading else "the service is at capacity; retry shortly",
        headers={"Retry-After": str(max(1, round(retry_after_sec)))},
    )
