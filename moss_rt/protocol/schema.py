"""A small declarative field schema: one definition validates JSON and msgpack input alike."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moss_rt.protocol.errors import ErrorCode, ProtocolError

_MISSING: Any = object()

# Error messages echo client input; keep what they quote short.
_QUOTE_CHARS = 60


def short_repr(value: Any, limit: int = _QUOTE_CHARS) -> str:
    """``repr(value)`` clipped to ``limit`` characters (always ASCII-safe, never raises)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**limit:
        return f"<{value.bit_length()}-bit integer>"  # str() of a huge int is slow or even refused
    try:
        text = ascii(value)
    except Exception:  # pragma: no cover - exotic objects with a broken __repr__
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class Field:
    """How one message field is typed and bounded.

    ``kind`` is one of ``int``, ``float``, ``str``, ``bool``. ``true``/``false`` is never a number;
    an integral float (``3.0``) is accepted for an ``int`` field; NaN and infinities are rejected;
    strings must be valid Unicode. ``null`` on the wire means "use the default" for fields that
    have one, ``None`` for ``nullable`` fields, and is an error otherwise.
    """

    kind: str
    default: Any = _MISSING
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    max_length: int | None = None
    choices: tuple[Any, ...] | None = None
    nullable: bool = False

    @property
    def required(self) -> bool:
        return self.default is _MISSING and not self.nullable

    def describe_range(self) -> str:
        lo = "(" if self.exclusive_minimum else "["
        return f"{lo}{self.minimum}, {self.maximum}]"


def _type_error(name: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError(
        ErrorCode.INVALID_FIELD, f"{name!r} must be {expected}, got {type(value).__name__}", field=name
    )


def coerce(name: str, spec: Field, value: Any) -> Any:
    """Validate one value against its spec; returns the normalised value or raises ProtocolError."""
    if value is None:
        if spec.nullable:
            return None
        if spec.default is not _MISSING:
            return spec.default
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"{name!r} must not be null", field=name)
    kind = spec.kind
    # bool is an int subclass in Python; on the wire true/false is never a number.
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
                value = int(value)
            else:
                raise _type_error(name, "an integer", value)
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(name, "a number", value)
        try:
            value = float(value)
        except OverflowError:  # an integer beyond the float range (JSON allows 4300 digits)
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{name!r} is out of range", field=name) from None
        if not math.isfinite(value):
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{name!r} must be finite", field=name)
    elif kind == "str":
        if not isinstance(value, str):
            raise _type_error(name, "a string", value)
        if spec.max_length is not None and len(value) > spec.max_length:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"{name!r} is {len(value)} characters, the limit is {spec.max_length}",
                field=name,
            )
        # JSON escapes can smuggle in lone surrogates ("\\ud800"); they cannot be encoded as UTF-8,
        # so they would blow up later when the text is tokenised or echoed back.
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD, f"{name!r} is not valid Unicode (lone surrogate)", field=name
            ) from None
    elif kind == "bool":
        if not isinstance(value, bool):
            raise _type_error(name, "a boolean", value)
    else:  # pragma: no cover - a programming error in a schema table
        raise AssertionError(f"unknown field kind {kind}")
    if spec.choices is not None and value not in spec.choices:
        raise ProtocolError(
            ErrorCode.INVALID_FIELD,
            f"{name!r} must be one of {list(spec.choices)}, got {short_repr(value)}",
            field=name,
        )
    if kind in ("int", "float"):
        too_low = spec.minimum is not None and (
            value <= spec.minimum if spec.exclusive_minimum else value < spec.minimum
        )
        too_high = spec.maximum is not None and value > spec.maximum
        if too_low or too_high:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"{name!r} = {short_repr(value)} is out of range {spec.describe_range()}",
                field=name,
            )
    return value


def validate_fields(fields: dict[str, Field], obj: dict[str, Any]) -> dict[str, Any]:
    """Return a dict with every schema field set (defaults filled), unknown keys ignored."""
    out: dict[str, Any] = {}
    for name, spec in fields.items():
        raw = obj.get(name, _MISSING)
        if raw is _MISSING:
            if spec.required:
                raise ProtocolError(ErrorCode.INVALID_FIELD, f"{name!r} is required", field=name)
            out[name] = None if spec.default is _MISSING else spec.default
        else:
            out[name] = coerce(name, spec, raw)
    return out
