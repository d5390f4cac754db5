"""Untrusted JSON parsed within bounds on size, depth and values, measured before parsing (pure)."""

from __future__ import annotations

import pytest

from moss_rt.bounded_json import loads_bounded, measure
from moss_rt.protocol import ErrorCode, ProtocolError

BOUNDS = {"max_bytes": 10_000, "max_depth": 4, "max_values": 50}


def test_measure_ignores_brackets_and_commas_inside_strings() -> None:
    assert measure('{"a": "[[[,,,{{{", "b": [1, 2, {"c": "\\"]]]"}]}') == (3, 7)
    assert measure("[]") == (1, 2)


def test_within_bounds_parses() -> None:
    assert loads_bounded(b'{"a": [1, 2.5, {"b": null}]}', **BOUNDS) == {"a": [1, 2.5, {"b": None}]}


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"[" * 5 + b"]" * 5, ErrorCode.BAD_JSON),  # too deep, refused before parsing
        (b"[" * 9_000, ErrorCode.BAD_JSON),  # never parsed: no RecursionError
        (b"[" + b"0," * 60 + b"0]", ErrorCode.TOO_LARGE),  # too many values
        (b" " * 10_001, ErrorCode.TOO_LARGE),
        (b'{"a": NaN}', ErrorCode.BAD_JSON),
        (b'{"a": Infinity}', ErrorCode.BAD_JSON),
        (b'{"a": 1e999}', ErrorCode.BAD_JSON),  # overflows to infinity
        (b'{"a": "\xff"}', ErrorCode.BAD_JSON),
        (b"[" + b"9" * 5000 + b"]", ErrorCode.BAD_JSON),
        (b'{"a": }', ErrorCode.BAD_JSON),
    ],
)
def test_out_of_bounds_or_not_strict_json_is_refused(data: bytes, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as err:
        loads_bounded(data, **BOUNDS)
    assert err.value.code == code
