"""A small declarative field schema: one definition validates JSON and msgpack input alike."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moss_rt.protocol.errors import ErrorCode, ProtocolError

_MISSING: Any = object()


@dataclass(frozen=True, slots=True)
class Field:
    """How one message field is typed and bounded.

    ``kind`` is one of ``int``, ``float``, ``str``, ``bool``, ``number_or_none``.
    ``None`` on the wire means "use the default" for fields that have one.
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
        value = float(value)
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
    elif kind == "bool":
        if not isinstance(value, bool):
            raise _type_error(name, "a boolean", value)
    else:  # pragma: no cover - a programming error in a schema table
        raise AssertionError(f"unknown field kind {kind}")
    if spec.choices is not None and value not in spec.choices:
        raise ProtocolError(
            ErrorCode.INVALID_FIELD, f"{name!r} must be one of {list(spec.choices)}, got {value!r}", field=name
        )
    if kind in ("int", "float"):
        too_low = spec.minimum is not None and (
            value <= spec.minimum if spec.exclusive_minimum else value < spec.minimum
        )
        too_high = spec.maximum is not None and value > spec.maximum
        if too_low or too_high:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"{name!r} = {value} is out of range {spec.describe_range()}",
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
