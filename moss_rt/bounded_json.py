"""JSON documents from untrusted files, parsed within bounds on size, nesting and values (sans-I/O).

``json.loads`` has no limits of its own: a few MB of ``[{},{},…]`` become hundreds of MB of Python objects, and
deep nesting ends in a ``RecursionError`` (or one later, when the value is written again). So a document is
measured first, by cheap scans in C (strings blanked by one regular expression, then bracket and comma counts),
and parsed only when its size, its nesting depth and its number of values are within the limits. Constants that
are not JSON (``NaN``, ``Infinity``) and numbers that overflow to infinity (``1e999``) are refused as well, so
whatever is parsed can be written back as strict JSON.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from moss_rt.protocol import ErrorCode, ProtocolError

# One JSON string (escapes included), written as an unrolled loop: linear, no nested backtracking.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:20]} is out of range")
    return value


def measure(text: str) -> tuple[int, int]:
    """(nesting depth, number of values) of a JSON text, without parsing it.

    Approximate on invalid JSON (the parser refuses that afterwards); exact enough on valid JSON to bound what
    parsing it costs: every value but the first follows a comma or opens a container.
    """
    skeleton = _STRING.sub('""', text)
    values = 1 + skeleton.count(",") + skeleton.count("[") + skeleton.count("{")
    depth = deepest = 0
    for m in _BRACKET.finditer(skeleton):
        if m.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest, values


def loads_bounded(data: bytes, *, max_bytes: int, max_depth: int, max_values: int, what: str = "the document") -> Any:
    """Parse ``data`` (UTF-8 JSON) within the bounds, or raise ProtocolError (``too_large`` / ``bad_json``)."""
    if len(data) > max_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{what} is over {max_bytes} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_JSON, f"{what} is not UTF-8 (byte {exc.start})") from None
    depth, values = measure(text)
    if depth > max_depth:
        raise ProtocolError(ErrorCode.BAD_JSON, f"{what} is nested {depth} deep; at most {max_depth} is accepted")
    if values > max_values:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{what} holds {values} values; at most {max_values} are accepted")
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:  # not reached within the depth bound; kept so that it can never become a 500
        raise ProtocolError(ErrorCode.BAD_JSON, f"{what} is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, 1e999, the int digit limit
        raise ProtocolError(ErrorCode.BAD_JSON, f"{what} is not valid JSON: {str(exc)[:120]}") from None
