"""The OpenAPI 3 description of the HTTP API, served at ``GET /api/openapi.json``.

The document is data: ``openapi.json`` next to this module, read once. What depends on the running service is
filled in when it is served, from the definitions the service enforces, never from a copy:

- ``{"$limit": "max_text_chars"}`` (optionally with ``"at_most": N``) is that limit's value in the running
  ``Limits``, and ``{limits.max_upload_bytes}`` in a text is the same, written out;
- ``{"$derived": "stream_request"}`` and ``{"$derived": "speech_request"}`` are the request bodies of
  ``POST /api/stream`` and ``POST /v1/audio/speech``, built from the protocol's field table
  (:func:`moss_rt.protocol.stream_fields`, the table the server validates with);
- ``{"$const": NAME}`` is one of :data:`CONSTANTS` (the delivery formats, the error codes, ...).

Only the operations the app really serves are listed. tests/reliability/test_openapi.py checks that every route
is documented and every documented operation served, the document's schemas against the typed definitions they
describe, and (schemathesis) that the server answers as documented. The WebSocket channel is described in
``docs/protocol.md`` (OpenAPI cannot express it).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from importlib import resources
from typing import Any

from aiohttp import web

from moss_rt import __version__
from moss_rt.formats import FORMATS, MAX_SPEED, MIN_SPEED, SAMPLE_RATES
from moss_rt.protocol import FRAME_SAMPLES, SAMPLING_DEFAULTS, ErrorCode, Limits, stream_fields
from moss_rt.protocol.schema import Field
from moss_rt.scripts.store import SCRIPT_ID_PATTERN
from moss_rt.session_records import SESSION_ID, TAKE_ID, TakeKind
from moss_rt.splices import EDIT_KINDS, MAX_CROSSFADE
from moss_rt.voices import REF_ID_PATTERN, UPLOAD_EXTENSIONS
from moss_rt.web.state import STATE

# "Contains a character that is not whitespace" with Python's whitespace set spelled out (the server
# tests text.strip()), so regex engines that disagree on \s (ECMA, Rust, Python) all read it the same.
_PY_WHITESPACE = (
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680"
    + "".join(map(chr, range(0x2000, 0x200B)))
    + ("\u2028\u2029\u202f\u205f\u3000")
)
NON_BLANK = "[^" + "".join(f"\\u{ord(c):04x}" for c in _PY_WHITESPACE) + "]"
_KINDS = {"int": "integer", "float": "number", "str": "string", "bool": "boolean"}
# What {"$const": NAME} stands for.
CONSTANTS: dict[str, Any] = {
    "version": __version__,
    "formats": list(FORMATS),
    "sample_rates": list(SAMPLE_RATES),
    "error_codes": [code.value for code in ErrorCode],
    "upload_extensions": list(UPLOAD_EXTENSIONS),
    "non_blank": NON_BLANK,
    "session_id_pattern": SESSION_ID.pattern,
    "take_id_pattern": TAKE_ID.pattern,
    "script_id_pattern": f"^{SCRIPT_ID_PATTERN}$",
    "ref_id_pattern": REF_ID_PATTERN.pattern,
    "take_kinds": [kind.value for kind in TakeKind],
    "edit_kinds": list(EDIT_KINDS),
    "frame_samples": FRAME_SAMPLES,
    "max_crossfade": MAX_CROSSFADE,
}
_LIMIT_IN_TEXT = re.compile(r"\{limits\.(\w+)\}")
# Routes outside the document: the WebSocket channel (docs/protocol.md) and the studio's static files.
UNDOCUMENTED = re.compile(r"^/api/ws$|^/static/")
DOCUMENTED_METHODS = ("get", "put", "post", "delete", "options", "patch", "trace")  # HEAD follows GET


class DocumentError(ValueError):
    """openapi.json names something the service does not have (a limit, a constant, a derived schema)."""


@functools.cache
def _template() -> dict[str, Any]:
    text = resources.files("moss_rt.web").joinpath("openapi.json").read_text(encoding="utf-8")
    document: dict[str, Any] = json.loads(text)
    return document


def field_schema(spec: Field) -> dict[str, Any]:
    """The JSON schema of one protocol field, as the server validates it."""
    out: dict[str, Any] = {"type": _KINDS[spec.kind]}
    if spec.kind == "int":
        # The server takes an integral float (3.0) for an integer field, as JSON itself does not
        # distinguish them; "integer" in OpenAPI 3.0 would call 3.0 invalid.
        out = {"type": "number", "multipleOf": 1}
        if spec.maximum is not None and spec.maximum >= 2**31:
            out["format"] = "int64"
    if spec.minimum is not None:
        out["minimum"] = spec.minimum if spec.kind == "float" else int(spec.minimum)
        if spec.exclusive_minimum:
            out["exclusiveMinimum"] = True
    if spec.maximum is not None:
        out["maximum"] = spec.maximum if spec.kind == "float" else int(spec.maximum)
    if spec.max_length is not None:
        out["maxLength"] = spec.max_length
    if spec.choices is not None:
        out["enum"] = list(spec.choices)
    # null on the wire means "the default" (or None for nullable fields); only required ones refuse it.
    if not spec.required:
        out["nullable"] = True
    return out


def stream_request_fields(limits: Limits) -> dict[str, Field]:
    """``POST /api/stream``'s fields: the ``start`` message's table plus the legacy stream's own."""
    fields = dict(stream_fields(limits))
    fields["take"] = Field("str", None, max_length=64, nullable=True)
    fields["channels"] = Field("int", 1, choices=(1, 2))
    fields["format"] = Field("str", None, choices=FORMATS, nullable=True)
    fields["sample_rate"] = Field("int", None, choices=SAMPLE_RATES, nullable=True)
    return fields


def stream_request_schema(limits: Limits) -> dict[str, Any]:
    props = {name: field_schema(spec) for name, spec in stream_request_fields(limits).items()}
    props["format"]["description"] = "deliver the audio as tag-2 frames in this format (docs/protocol.md)"
    props["text"]["pattern"] = NON_BLANK  # blank text is refused
    props["text"]["description"] = "what to say; must contain a non-blank character"
    props["tokens"]["description"] = "duration hint in 80 ms frames"
    props["reference"]["description"] = "none, a built-in voice id, or a ref_id from /api/upload_ref"
    return {"type": "object", "properties": props}


# ``POST /v1/audio/speech``: our fields it takes as extra fields, with the /api/stream table's bounds.
SPEECH_EXTRA_FIELDS = ("language", "seed", *SAMPLING_DEFAULTS, "max_new_tokens", "chunk_frames", "tokens")


def speech_request_schema(limits: Limits) -> dict[str, Any]:
    """OpenAI's fields, then ours as extra fields (the /api/stream table)."""
    stream = stream_fields(limits)
    props: dict[str, Any] = {
        "input": {**field_schema(stream["text"]), "pattern": NON_BLANK, "description": "what to say"},
        "model": {
            **field_schema(stream["model"]),
            "description": "a model id from GET /v1/models (OpenAI's names such as tts-1 are aliases of ours)",
        },
        "voice": {
            "description": "none (also null), a built-in voice id or a ref_id from /api/upload_ref (or {\"id\": ...}); "
            "OpenAI's voice names (alloy, ...) are aliases (settings openai_voice_aliases)",
            "nullable": True,
            "oneOf": [
                {"type": "string", "maxLength": 128},
                {"type": "object", "required": ["id"], "properties": {"id": {"type": "string", "maxLength": 128}}},
            ],
        },
        "instructions": {**field_schema(stream["instruction"]), "description": "direction"},
        "response_format": {"type": "string", "enum": list(FORMATS), "nullable": True},
        "speed": {"type": "number", "minimum": MIN_SPEED, "maximum": MAX_SPEED, "nullable": True},
        "stream_format": {"type": "string", "enum": ["audio", "sse"], "nullable": True},
        "sample_rate": {
            "type": "integer",
            "enum": list(SAMPLE_RATES),
            "nullable": True,
            "description": "default 24000 for pcm (as OpenAI), else 48000",
        },
    }
    for name in SPEECH_EXTRA_FIELDS:
        props[name] = field_schema(stream[name])
    props["channels"] = field_schema(Field("int", 1, choices=(1, 2)))
    return {"type": "object", "required": ["input"], "properties": props}


DERIVED = {"stream_request": stream_request_schema, "speech_request": speech_request_schema}


def fill(template: Any, limits: Limits) -> Any:
    """The template with its placeholders resolved against ``limits`` (see the module docstring)."""
    values = limits.to_dict()

    def limit(name: str) -> int | float:
        if name not in values:
            raise DocumentError(f"openapi.json names no limit {name!r}")
        return values[name]

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if "$limit" in node:
                value = limit(node["$limit"])
                return min(value, node["at_most"]) if "at_most" in node else value
            if "$derived" in node:
                if node["$derived"] not in DERIVED:
                    raise DocumentError(f"openapi.json names no derived schema {node['$derived']!r}")
                return DERIVED[node["$derived"]](limits)
            if "$const" in node:
                if node["$const"] not in CONSTANTS:
                    raise DocumentError(f"openapi.json names no constant {node['$const']!r}")
                return copy.deepcopy(CONSTANTS[node["$const"]])
            return {key: walk(value) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(item) for item in node]
        if isinstance(node, str) and "{limits." in node:
            return _LIMIT_IN_TEXT.sub(lambda m: str(limit(m.group(1))), node)
        return node

    return walk(template)


def route_path(canonical: str) -> str:
    """A route's path as OpenAPI writes it: ``{name}`` without aiohttp's ``:regex``."""
    return re.sub(r"\{(\w+)(:[^}]*)?\}", r"{\1}", canonical)


def served_operations(app: web.Application) -> set[tuple[str, str]]:
    """(method, path) of every route the app serves that the document describes (lower-case methods)."""
    served = set()
    for route in app.router.routes():
        path = route_path(route.resource.canonical) if route.resource is not None else ""
        method = route.method.lower()
        if path and method in DOCUMENTED_METHODS and not UNDOCUMENTED.search(path):
            served.add((method, path))
    return served


def documented_operations(document: dict[str, Any]) -> set[tuple[str, str]]:
    return {
        (method, path) for path, item in document["paths"].items() for method in item if method in DOCUMENTED_METHODS
    }


def openapi_document(app: web.Application) -> dict[str, Any]:
    """The document for this app: its limits filled in, only the operations it serves."""
    document: dict[str, Any] = fill(_template(), app[STATE].settings.limits)
    served = served_operations(app)
    paths: dict[str, Any] = {}
    for path, item in document["paths"].items():
        kept = {key: op for key, op in item.items() if key not in DOCUMENTED_METHODS or (key, path) in served}
        if any(key in DOCUMENTED_METHODS for key in kept):
            paths[path] = kept
    document["paths"] = paths
    return document
