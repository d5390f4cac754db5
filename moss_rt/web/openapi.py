"""The OpenAPI 3 description of the HTTP API, served at ``GET /api/openapi.json``.

Hand-written, but the request schema of ``/api/stream`` is derived from the protocol's own field
table and the running service's limits, so bounds in the document are the bounds enforced.
Routes are listed only when the app really has them (e.g. ``/metrics`` from another module).
The WebSocket channel is described in ``docs/protocol.md`` (OpenAPI cannot express it).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from moss_rt import __version__
from moss_rt.formats import FORMATS, MAX_SPEED, MIN_SPEED, SAMPLE_RATES, AudioFormat
from moss_rt.protocol import SAMPLING_DEFAULTS, ErrorCode
from moss_rt.protocol.messages import _stream_fields  # the one table /api/stream validates with
from moss_rt.protocol.schema import Field
from moss_rt.voices import UPLOAD_EXTENSIONS
from moss_rt.web.state import STATE

JSON = "application/json"
# "Contains a character that is not whitespace" with Python's whitespace set spelled out (the server
# tests text.strip()), so regex engines that disagree on \s (ECMA, Rust, Python) all read it the same.
_PY_WHITESPACE = (
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680"
    + "".join(map(chr, range(0x2000, 0x200B)))
    + ("\u2028\u2029\u202f\u205f\u3000")
)
NON_BLANK = "[^" + "".join(f"\\u{ord(c):04x}" for c in _PY_WHITESPACE) + "]"
_KINDS = {"int": "integer", "float": "number", "str": "string", "bool": "boolean"}


def _field_schema(spec: Field) -> dict[str, Any]:
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


def _stream_request_schema(app: web.Application) -> dict[str, Any]:
    limits = app[STATE].settings.limits
    fields = dict(_stream_fields(limits))
    fields["take"] = Field("str", None, max_length=64, nullable=True)
    fields["channels"] = Field("int", 1, choices=(1, 2))
    fields["format"] = Field("str", None, choices=FORMATS, nullable=True)
    fields["sample_rate"] = Field("int", None, choices=SAMPLE_RATES, nullable=True)
    props = {name: _field_schema(spec) for name, spec in fields.items()}
    props["format"]["description"] = "deliver the audio as tag-2 frames in this format (docs/protocol.md)"
    props["text"]["pattern"] = NON_BLANK  # blank text is refused
    props["text"]["description"] = "what to say; must contain a non-blank character"
    props["tokens"]["description"] = "duration hint in 80 ms frames"
    props["reference"]["description"] = "none, a built-in voice id, or a ref_id from /api/upload_ref"
    return {"type": "object", "properties": props}


def _speech_request_schema(app: web.Application) -> dict[str, Any]:
    """``POST /v1/audio/speech``: OpenAI's fields, then ours as extra fields (the /api/stream table)."""
    limits = app[STATE].settings.limits
    stream = _stream_fields(limits)
    props: dict[str, Any] = {
        "input": {**_field_schema(stream["text"]), "pattern": NON_BLANK, "description": "what to say"},
        "model": {
            **_field_schema(stream["model"]),
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
        "instructions": {**_field_schema(stream["instruction"]), "description": "direction"},
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
    for name in ("language", "seed", *SAMPLING_DEFAULTS, "max_new_tokens", "chunk_frames", "tokens"):
        props[name] = _field_schema(stream[name])
    props["channels"] = _field_schema(Field("int", 1, choices=(1, 2)))
    return {"type": "object", "required": ["input"], "properties": props}


def _openai_error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": {"$ref": "#/components/schemas/OpenAIError"}}}}


def _v1_paths(app: web.Application) -> dict[str, Any]:
    binary = {"type": "string", "format": "binary"}
    model = {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["model"]},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "alias_of": {"type": "string", "description": "an OpenAI model name accepted for this model of ours"},
        },
    }
    audio_types = sorted({AudioFormat(name).media_type for name in FORMATS})
    errors = {
        "400": _openai_error("invalid request: a parameter is missing, malformed or out of range"),
        "401": _openai_error("missing or invalid API key, when one is configured"),
        "403": _openai_error("a foreign Origin or Host (forbidden_origin)"),
        "404": _openai_error("unknown model"),
        "408": _openai_error("the body stopped arriving (timeout)"),
        "413": _openai_error("body over the limit"),
        "415": _openai_error("the body must be JSON (unsupported_media_type)"),
        "429": _openai_error("too many takes or requests from this client; see Retry-After"),
        "503": _openai_error("at capacity or shutting down; see Retry-After"),
    }
    return {
        "/v1/models": {
            "get": {
                "summary": "the models (OpenAI-compatible)",
                "responses": {
                    "200": _ok(
                        "a list of models",
                        {
                            "type": "object",
                            "required": ["object", "data"],
                            "properties": {"object": {"type": "string"}, "data": {"type": "array", "items": model}},
                        },
                    ),
                    "401": errors["401"],
                },
            }
        },
        "/v1/models/{model_id}": {
            "get": {
                "summary": "one model (OpenAI-compatible)",
                "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": _ok("the model", model), "401": errors["401"], "404": errors["404"]},
            }
        },
        "/v1/audio/speech": {
            "post": {
                "summary": "synthesize speech (OpenAI-compatible), streamed as encoded audio or SSE events",
                "description": (
                    "The audio in response_format, chunked as it is produced (stream_format audio), or "
                    "text/event-stream events speech.audio.delta (base64 audio) then speech.audio.done (sse). "
                    "Errors have OpenAI's shape. See docs/openai.md."
                ),
                "requestBody": {"required": True, "content": {JSON: {"schema": _speech_request_schema(app)}}},
                "responses": {
                    "200": {
                        "description": "the audio",
                        "content": {
                            **{media: {"schema": binary} for media in audio_types},
                            # One event per `data:` line: a JSON speech.audio.delta, then speech.audio.done
                            # (or an error when the take ended early).
                            "text/event-stream": {
                                "schema": {
                                    "type": "object",
                                    "required": ["data"],
                                    "properties": {
                                        "event": {"type": "string"},
                                        "data": {
                                            "type": "string",
                                            "contentMediaType": JSON,
                                            "contentSchema": {
                                                "type": "object",
                                                "required": ["type"],
                                                "properties": {
                                                    "type": {
                                                        "type": "string",
                                                        "enum": ["speech.audio.delta", "speech.audio.done", "error"],
                                                    },
                                                    "audio": {"type": "string"},
                                                    "usage": {"type": "object"},
                                                    "error": {"type": "object"},
                                                },
                                            },
                                        },
                                    },
                                }
                            },
                        },
                    },
                    **errors,
                },
            }
        },
    }


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _ok(description: str, schema: dict[str, Any], media: str = JSON) -> dict[str, Any]:
    return {"description": description, "content": {media: {"schema": schema}}}


def _common_errors(*statuses: int) -> dict[str, Any]:
    text = {
        400: "malformed request (bad_json, bad_message)",
        401: "missing or invalid credentials (unauthorized) when an API key is configured",
        403: "a browser page from a foreign origin, or a Host a keyless server does not serve (forbidden_origin)",
        404: "no such resource (not_found)",
        408: "the body stopped arriving (timeout); the connection is closed",
        413: "body over the limit (too_large)",
        415: "the body must be JSON (unsupported_media_type)",
        422: "a field is out of range or of the wrong type (invalid_field)",
        429: "too many takes or requests from this client, or the voice store is full (rate_limited); see Retry-After",
        503: "at capacity or shutting down (busy), or the model is still loading (loading); see Retry-After",
        507: "the data dir's budget for sessions (or the disk) cannot keep it (insufficient_storage)",
    }
    return {str(s): _error(text[s]) for s in statuses}


def _words_paths(
    take_id: dict[str, Any], session_id: dict[str, Any], share: dict[str, Any], max_text_chars: int
) -> dict[str, Any]:
    """Word timing (docs/words.md): a take's words and captions, and POST /api/align."""
    word = {
        "type": "object",
        "required": ["word", "start", "end"],
        "properties": {
            "word": {"type": "string", "description": "as written in the text, without surrounding punctuation"},
            "start": {"type": "number", "description": "seconds from the take's (or the audio's) first sample"},
            "end": {"type": "number"},
            "flags": {"type": "array", "items": {"type": "string", "enum": ["interpolated"]}},
        },
    }
    take_words = {
        "type": "object",
        "required": ["take", "complete", "words"],
        "properties": {
            "take": {"type": "string"},
            "complete": {"type": "boolean", "description": "false while the take still runs (the words so far)"},
            "words": {"type": "array", "items": word},
        },
    }
    srt = {"description": "captions", "content": {"application/x-subrip": {"schema": {"type": "string"}}}}
    vtt = {"description": "captions", "content": {"text/vtt": {"schema": {"type": "string"}}}}
    errors = _common_errors(401, 404, 503)

    def get(summary: str, params: list[dict[str, Any]], ok: dict[str, Any]) -> dict[str, Any]:
        return {"get": {"summary": summary, "parameters": params, "responses": {"200": ok, **errors}}}

    stored = [session_id, take_id, share]
    align_result = {
        "type": "object",
        "required": ["words", "aligner", "duration"],
        "properties": {
            "words": {"type": "array", "items": word},
            "aligner": {"type": "string"},
            "duration": {"type": "number"},
        },
    }
    binary = {"type": "string", "format": "binary"}
    return {
        "/api/takes/{take_id}/words": get(
            "when each word of a take is said (aligned on demand if it streamed without words)", [take_id],
            _ok("the words", take_words),
        ),
        "/api/takes/{take_id}.srt": get("a take's captions (SubRip)", [take_id], srt),
        "/api/takes/{take_id}.vtt": get("a take's captions (WebVTT)", [take_id], vtt),
        "/api/sessions/{session_id}/takes/{take_id}/words": get(
            "a stored take's words (stored with it, or aligned now and stored)", stored, _ok("the words", take_words)
        ),
        "/api/sessions/{session_id}/takes/{take_id}.srt": get("a stored take's captions (SubRip)", stored, srt),
        "/api/sessions/{session_id}/takes/{take_id}.vtt": get("a stored take's captions (WebVTT)", stored, vtt),
        "/api/align": {
            "post": {
                "summary": "align any audio with a text: when each of its words is said",
                "description": (
                    "The body is the audio (wav, flac, mp3, ogg) with ?text=, or a multipart form with an audio "
                    "file part and a text part (or a json part {\"text\": ...}). Limits: max_align_bytes, "
                    "max_align_seconds, max_text_chars."
                ),
                # A query string must fit the HTTP request line (8 KiB): longer texts go in the form.
                "parameters": [
                    {"name": "text", "in": "query", "required": False, "description": "short texts; else the form",
                     "schema": {"type": "string", "maxLength": min(max_text_chars, 500)}},
                ],  # fmt: skip
                "requestBody": {
                    "required": True,
                    "content": {
                        **{m: {"schema": binary} for m in ("audio/wav", "audio/flac", "audio/mpeg", "audio/ogg")},
                        "application/octet-stream": {"schema": binary},
                        "multipart/form-data": {
                            "schema": {
                                "type": "object",
                                "properties": {"audio": binary, "text": {"type": "string"}, "json": {"type": "string"}},
                            }
                        },
                    },
                },
                "responses": {
                    "200": _ok("the words", align_result),
                    **_common_errors(400, 401, 403, 404, 408, 413, 422, 429, 503),
                },
            }
        },
    }


def _script_paths(app: web.Application) -> dict[str, Any]:
    """Script renders (docs/scripts.md)."""
    limits = app[STATE].settings.limits
    script_id = {
        "name": "script_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": "^sc_[A-Za-z0-9_-]{16,64}$"},
    }
    line_no = {"name": "line", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 0}}
    share = {
        "name": "share",
        "in": "query",
        "required": False,
        "description": "the share token of the script's session (read-only access for its holder)",
        "schema": {"type": "string", "maxLength": 80},
    }
    text = {"type": "string", "maxLength": limits.max_text_chars}
    direction = {"type": "string", "maxLength": limits.max_instruction_chars}
    cast = {
        "type": "object",
        "description": "character name → how it speaks",
        "additionalProperties": {
            "type": "object",
            "properties": {
                "voice": {"type": "string", "maxLength": 128, "description": "none, a built-in id or a ref_id"},
                "instruction": direction,
                "language": {"type": "string", "maxLength": 64},
            },
        },
    }
    script_json = {
        "type": "object",
        "description": "a JSON script, or {\"script\": plain text, \"cast\"} (docs/scripts.md)",
        "properties": {
            "title": {"type": "string", "maxLength": 200},
            "cast": cast,
            "lines": {
                "type": "array",
                "maxItems": limits.max_script_lines,
                "items": {
                    "type": "object",
                    "description": "a cue {who, text, instruction, seed, tokens, max_new_tokens}, {pause: seconds} or "
                    "{scene: true}",
                    "properties": {
                        "who": {"type": "string", "maxLength": 64},
                        "text": {**text, "pattern": NON_BLANK},
                        "instruction": direction,
                        "seed": {"type": "integer", "minimum": 0},
                        "tokens": {"type": "integer", "minimum": 1, "maximum": limits.max_new_tokens},
                        "max_new_tokens": {"type": "integer", "minimum": 1, "maximum": limits.max_new_tokens},
                        "pause": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                                  "maximum": limits.max_pause_sec},
                        "scene": {"type": "boolean"},
                    },
                },
            },
            "script": {"type": "string", "description": "the plain-text form (with 'cast' given alongside)"},
            "gap_sec": {"type": "number", "minimum": 0, "maximum": limits.max_gap_sec},
            "scene_gap_sec": {"type": "number", "minimum": 0, "maximum": limits.max_gap_sec},
            "max_new_tokens": {"type": "integer", "minimum": 1, "maximum": limits.max_new_tokens},
            "session": {"type": "string", "description": "render into this session (default: a new one)"},
        },
    }
    progress = {
        "script": {"type": "string"},
        "state": {"type": "string", "enum": ["queued", "rendering", "done", "failed"]},
        "lines_total": {"type": "integer"},
        "lines_done": {"type": "integer"},
        "lines_failed": {"type": "integer"},
        "lines_rendering": {"type": "integer"},
        "lines_pending": {"type": "integer"},
        "audio_sec": {"type": "number"},
    }
    line = {
        "type": "object",
        "required": ["line", "who", "text", "status", "take", "seed"],
        "properties": {
            "line": {"type": "integer"},
            "scene": {"type": "integer"},
            "who": {"type": "string"},
            "text": {"type": "string"},
            "instruction": {"type": "string"},
            "status": {"type": "string", "enum": ["pending", "rendering", "done", "failed"]},
            "take": {"type": "string", "nullable": True},
            "seed": {"type": "integer"},
            "duration_sec": {"type": "number", "nullable": True},
            "attempts": {"type": "integer"},
            "error": {"type": "string", "nullable": True},
        },
    }
    state = {
        "type": "object",
        "required": ["script", "session", "state", "lines"],
        "properties": {
            **progress,
            "session": {"type": "string"},
            "title": {"type": "string"},
            "created": {"type": "number"},
            "error": {"type": "string", "nullable": True},
            "gap_sec": {"type": "number"},
            "scene_gap_sec": {"type": "number"},
            "cast": {"type": "object"},
            "lines": {"type": "array", "items": line},
            "source": {"type": "object", "description": "the script as parsed (its canonical JSON form)"},
        },
    }
    line_answer = {
        "type": "object",
        "required": ["script", "line"],
        "properties": {"script": {"type": "string"}, "line": line, "event_id": {"type": "string"}},
    }
    # A script is its session's: another identity than the session's owner is answered 404, as for an unknown id.
    posting = _common_errors(400, 401, 403, 404, 408, 413, 415, 422, 429, 503, 507)
    return {
        "/api/scripts": {
            "post": {
                "summary": "render a script: its lines become takes of a directing session (docs/scripts.md)",
                "description": (
                    f"text/plain (the plain-text form) or JSON, at most {limits.max_script_bytes} bytes and "
                    f"{limits.max_script_lines} lines. ?session= (or 'session') renders into that session (the "
                    "caller's: another's is 404); without it, into a new session owned by the caller (a keyless "
                    "client without an owner cookie is given one). Errors in the script say where: 'line 7: …' or "
                    "'lines[3]: …'."
                ),
                "parameters": [{"name": "session", "in": "query", "required": False, "schema": {"type": "string"}}],
                "requestBody": {
                    "required": True,
                    "content": {
                        "text/plain": {"schema": {"type": "string"}},
                        JSON: {"schema": script_json},
                    },
                },
                "responses": {
                    "201": _ok(
                        "accepted; rendering starts at once",
                        {
                            "type": "object",
                            "required": ["script", "lines", "session"],
                            "properties": {
                                "script": {"type": "string"},
                                "lines": {"type": "integer"},
                                "session": {"type": "string"},
                                "state": {"type": "string"},
                                "event_id": {"type": "string", "description": "Last-Event-ID for every event"},
                            },
                        },
                    ),
                    **posting,
                },
            },
            "get": {
                "summary": "the scripts rendered into a session (?session=; its owner, or with its ?share=)",
                "parameters": [
                    {"name": "session", "in": "query", "required": True, "schema": {"type": "string"}},
                    share,
                ],
                "responses": {
                    "200": _ok(
                        "the scripts, oldest first",
                        {
                            "type": "object",
                            "required": ["session", "scripts"],
                            "properties": {
                                "session": {"type": "string"},
                                "scripts": {"type": "array", "items": {"type": "object", "properties": progress}},
                            },
                        },
                    ),
                    **_common_errors(401, 404, 422),
                },
            },
        },
        "/api/scripts/{script_id}": {
            "get": {
                "summary": "a script's state, and per line its status, take, seed and duration",
                "parameters": [script_id, share],
                "responses": {"200": _ok("the script", state), **_common_errors(401, 404)},
            },
            "delete": {
                "summary": "stop its render and forget it (the takes it made stay in the session)",
                "parameters": [script_id],
                "responses": {
                    "200": _ok("deleted", {"type": "object", "properties": {"deleted": {"type": "string"}}}),
                    **_common_errors(401, 403, 404, 429),
                },
            },
        },
        "/api/scripts/{script_id}/events": {
            "get": {
                "summary": "server-sent events: state (first), progress, line, done, error; resumable (Last-Event-ID)",
                "parameters": [
                    script_id,
                    share,
                    {"name": "Last-Event-ID", "in": "header", "required": False, "schema": {"type": "string"}},
                ],
                "responses": {
                    "200": _ok("text/event-stream, open until the client leaves", {"type": "string"},
                               "text/event-stream"),
                    **_common_errors(401, 404),
                },
            }
        },
        "/api/scripts/{script_id}.zip": {
            "get": {
                "summary": "the export: lines/NNN-WHO.<ext>, mix.<ext>, cues.csv/.json, captions/*.srt/.vtt",
                "parameters": [
                    script_id,
                    share,
                    {"name": "format", "in": "query", "required": False,
                     "schema": {"type": "string", "enum": list(FORMATS)}},
                    {"name": "sample_rate", "in": "query", "required": False,
                     "schema": {"type": "integer", "enum": list(SAMPLE_RATES)}},
                    {"name": "partial", "in": "query", "required": False, "schema": {"type": "boolean"}},
                ],
                "responses": {
                    "200": _ok("zip archive", {"type": "string", "format": "binary"}, "application/zip"),
                    **_common_errors(401, 404, 422, 429, 503),
                },
            }
        },
        "/api/scripts/{script_id}/lines/{line}/retake": {
            "post": {
                "summary": "render line n again (text, instruction, seed, frame or time_sec); it replaces the line",
                "parameters": [script_id, line_no],
                "requestBody": {
                    "required": False,
                    "content": {
                        JSON: {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "text": {**text, "pattern": NON_BLANK, "nullable": True},
                                    "instruction": {**direction, "nullable": True},
                                    "seed": {"type": "integer", "minimum": 0, "nullable": True},
                                    "frame": {"type": "integer", "minimum": 0, "nullable": True},
                                    "time_sec": {"type": "number", "minimum": 0, "nullable": True},
                                },
                            }
                        }
                    },
                },
                "responses": {"202": _ok("rendering", line_answer), **posting},
            }
        },
        "/api/scripts/{script_id}/lines/{line}/accept": {
            "post": {
                "summary": "make a take of the script's session line n's take (e.g. one directed in the studio)",
                "parameters": [script_id, line_no],
                "requestBody": {
                    "required": True,
                    "content": {
                        JSON: {
                            "schema": {
                                "type": "object",
                                "required": ["take"],
                                "properties": {"take": {"type": "string", "maxLength": 64}},
                            }
                        }
                    },
                },
                "responses": {"200": _ok("the line", line_answer), **posting},
            }
        },
    }


def openapi_document(app: web.Application) -> dict[str, Any]:
    state = app[STATE]
    limits = state.settings.limits
    status = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
    obj = {"type": "object"}
    voice = {
        "type": "object",
        "required": ["id", "name", "kind", "duration", "frames", "sample_rate", "channels"],
        "properties": {
            "id": {"type": "string"},
            "name": {"type": "string"},
            "kind": {"type": "string", "enum": ["builtin", "uploaded"]},
            "duration": {"type": "number"},
            "frames": {"type": "integer"},
            "sample_rate": {"type": "integer"},
            "channels": {"type": "integer"},
            "owned": {"type": "boolean", "description": "uploaded by this client (it may delete it)"},
        },
    }
    voice_id = {
        "name": "voice_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "maxLength": 64, "minLength": 1},
    }
    take_id = {
        "name": "take_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$", "maxLength": 64, "minLength": 1},
    }
    session_id = {
        "name": "session_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": "^s_[A-Za-z0-9_-]{16,64}$"},
    }
    share = {
        "name": "share",
        "in": "query",
        "required": False,
        "description": "the session's share token (read-only access for its holder, until the owner revokes it)",
        "schema": {"type": "string", "maxLength": 80},
    }
    session_body = {
        "type": "object",
        "required": ["session", "takes", "max_takes"],
        "properties": {
            "session": {"type": "string"},
            "takes": {"type": "array", "items": {"type": "object"}},
            "max_takes": {"type": "integer"},
        },
    }
    paths: dict[str, Any] = {
        "/": {
            "get": {
                "summary": "the studio page",
                "security": [],
                "responses": {"200": _ok("HTML", {"type": "string"}, "text/html"), **_common_errors(404)},
            }
        },
        "/healthz": {"get": {"summary": "liveness", "security": [], "responses": {"200": _ok("alive", status)}}},
        "/readyz": {
            "get": {
                "summary": "readiness: model loaded and warmed up, not shutting down",
                "security": [],
                "responses": {"200": _ok("ready", status), "503": _ok("loading or shutting down", status)},
            }
        },
        "/api/models": {
            "get": {
                "summary": "models served (legacy)",
                "responses": {
                    "200": _ok(
                        "the models",
                        {
                            "type": "object",
                            "required": ["models", "default"],
                            "properties": {
                                "models": {"type": "array", "items": {"type": "string"}},
                                "default": {"type": "string"},
                                "demo": {"type": "boolean"},
                                "engine": {"type": "string"},
                            },
                        },
                    ),
                    **_common_errors(401),
                },
            }
        },
        "/api/info": {
            "get": {
                "summary": "service, engine and limits",
                "responses": {
                    "200": _ok(
                        "service information",
                        {
                            "type": "object",
                            "required": ["service", "version", "sr", "limits"],
                            "properties": {
                                "service": {"type": "string"},
                                "version": {"type": "string"},
                                "ready": {"type": "boolean"},
                                "sr": {"type": "integer"},
                                "limits": obj,
                                # slots, positions and where the GPU memory goes; null until made at start
                                "memory_plan": {"type": "object", "nullable": True},
                            },
                        },
                    ),
                    **_common_errors(401),
                },
            }
        },
        "/api/voices": {
            "get": {
                "summary": "built-in voices and this client's uploads (others' stay usable by ref_id)",
                "responses": {
                    "200": _ok(
                        "the voices",
                        {
                            "type": "object",
                            "required": ["voices"],
                            "properties": {"voices": {"type": "array", "items": voice}},
                        },
                    ),
                    **_common_errors(401),
                },
            }
        },
        "/api/sessions": {
            "post": {
                "summary": "a new directing session owned by the caller (the WebSocket binds to one with resume)",
                "description": "A keyless server sets the owner cookie (moss_rt_owner) on a client that has none.",
                "responses": {"200": _ok("the new session", session_body), **_common_errors(401, 404, 429, 507)},
            },
            "get": {
                "summary": "the caller's sessions, most recently used first",
                "responses": {
                    "200": _ok(
                        "the sessions",
                        {
                            "type": "object",
                            "required": ["sessions"],
                            "properties": {"sessions": {"type": "array", "items": {"type": "object"}}},
                        },
                    ),
                    **_common_errors(401, 404),
                },
            },
        },
        "/api/sessions/import": {
            "post": {
                "summary": "a new session from an exported archive (zip body), owned by the caller",
                "description": (
                    f"At most {limits.max_session_archive_bytes} bytes, unpacking to at most "
                    f"{limits.max_session_archive_unpacked_bytes}. Checked whole before anything is kept; take ids "
                    "are issued anew."
                ),
                "requestBody": {  # a zip; any Content-Type is accepted
                    "required": True,
                    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
                },
                "responses": {
                    "200": _ok("the imported session", session_body),
                    **_common_errors(401, 404, 408, 413, 422, 429, 503, 507),
                },
            }
        },
        "/api/sessions/{session_id}": {
            "get": {
                "summary": "a session's stored takes, oldest first (its owner, or a share token's holder)",
                "parameters": [session_id, share],
                "responses": {"200": _ok("the session", session_body), **_common_errors(401, 404)},
            },
            "delete": {
                "summary": "delete the session: its records, then its takes' files",
                "parameters": [session_id],
                "responses": {"200": _ok("deleted", {"type": "object"}), **_common_errors(401, 404, 429)},
            },
        },
        "/api/sessions/{session_id}/share": {
            "post": {
                "summary": "a read-only share token for the session (the same one until revoked)",
                "parameters": [session_id],
                "responses": {
                    "200": _ok(
                        "the token",
                        {
                            "type": "object",
                            "required": ["session", "share", "path"],
                            "properties": {
                                "session": {"type": "string"},
                                "share": {"type": "string"},
                                "path": {"type": "string"},
                            },
                        },
                    ),
                    **_common_errors(401, 404, 429),
                },
            },
            "delete": {
                "summary": "revoke the session's share token",
                "parameters": [session_id],
                "responses": {"200": _ok("revoked", {"type": "object"}), **_common_errors(401, 404, 429)},
            },
        },
        "/api/sessions/{session_id}/archive": {
            "get": {
                "summary": "the session as one zip: session.json + takes/<id>.wav + takes/<id>.codes.npy",
                "parameters": [session_id, share],
                "responses": {
                    "200": _ok("zip archive", {"type": "string", "format": "binary"}, "application/zip"),
                    **_common_errors(401, 404, 429, 503),
                },
            }
        },
        "/api/sessions/{session_id}/takes/{take_id}": {
            "patch": {
                "summary": "the director's notes on a stored take: title, starred, note, markers",
                "parameters": [session_id, take_id],
                "requestBody": {
                    "content": {
                        JSON: {
                            "schema": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "title": {"type": "string", "maxLength": 80},
                                    "starred": {"type": "boolean"},
                                    "note": {"type": "string", "maxLength": 2000},
                                    "markers": {"type": "array", "maxItems": 200, "items": {"type": "object"}},
                                },
                            }
                        }
                    }
                },
                "responses": {
                    "200": _ok("the take's record", {"type": "object"}),
                    **_common_errors(400, 401, 404, 413, 415, 422, 429),
                },
            },
            "delete": {
                "summary": "delete a stored take (record, audio, codes)",
                "parameters": [session_id, take_id],
                "responses": {"200": _ok("deleted", {"type": "object"}), **_common_errors(401, 404, 429)},
            },
        },
        "/api/sessions/{session_id}/takes/{take_id}.wav": {
            "get": {
                "summary": "a stored take's audio as it was heard, streamed from its file",
                "parameters": [session_id, take_id, share],
                "responses": {
                    "200": _ok("WAV audio", {"type": "string", "format": "binary"}, "audio/wav"),
                    **_common_errors(401, 404, 429),
                },
            }
        },
        "/api/voices/{voice_id}/audio": {
            "get": {
                "summary": "a voice's reference audio as stored (wav, flac, mp3 or ogg), to listen to it",
                "parameters": [
                    {"name": "voice_id", "in": "path", "required": True, "schema": {"type": "string"}},
                ],
                "responses": {
                    "200": _ok("the audio file", {"type": "string", "format": "binary"}, "audio/*"),
                    **_common_errors(401, 404),
                },
            }
        },
        "/api/upload_ref": {
            "post": {
                "summary": "store a reference voice (raw audio bytes as the body)",
                "description": (
                    f"At most {limits.max_upload_bytes} bytes (checked from Content-Length before reading), "
                    f"{limits.min_upload_seconds}-{limits.max_upload_seconds} s, "
                    f"{limits.min_upload_sample_rate}-{limits.max_upload_sample_rate} Hz, "
                    f"1-{limits.max_upload_channels} channels. The same bytes always give the same ref_id."
                ),
                "parameters": [
                    {
                        "name": "ext",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": list(UPLOAD_EXTENSIONS), "default": "wav"},
                    },
                    {"name": "name", "in": "query", "required": False, "schema": {"type": "string", "maxLength": 64}},
                ],
                "requestBody": {
                    "required": True,
                    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
                },
                "responses": {
                    "200": _ok(
                        "stored",
                        {
                            "type": "object",
                            "required": ["ref_id", "duration", "frames"],
                            "properties": {
                                "ref_id": {"type": "string", "pattern": "^ref_[0-9a-f]{24}$"},
                                "duration": {"type": "number"},
                                "frames": {"type": "integer"},
                                "name": {"type": "string"},
                            },
                        },
                    ),
                    **_common_errors(400, 401, 403, 408, 413, 422, 429),
                },
            }
        },
        "/api/voices/{voice_id}": {
            "delete": {
                "summary": "delete an uploaded voice (its owner, i.e. the client that uploaded it, or the admin)",
                "parameters": [voice_id],
                "responses": {
                    "200": _ok(
                        "deleted",
                        {"type": "object", "required": ["deleted"], "properties": {"deleted": {"type": "string"}}},
                    ),
                    **_common_errors(401, 403, 404, 429),
                },
            },
            "patch": {
                "summary": "rename an uploaded voice (its owner or the admin); the name is kept on disk",
                "parameters": [voice_id],
                "requestBody": {
                    "required": True,
                    "content": {
                        JSON: {
                            "schema": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["name"],
                                "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 64}},
                            }
                        }
                    },
                },
                "responses": {
                    "200": _ok("the voice as listed", voice),
                    **_common_errors(400, 401, 403, 404, 413, 415, 422, 429),
                },
            },
        },
        "/api/admin/voices": {
            "get": {
                "summary": "every uploaded voice with its owner (the API key itself is required)",
                "responses": {
                    "200": _ok(
                        "the voices and their owners",
                        {
                            "type": "object",
                            "required": ["voices", "owners"],
                            "properties": {
                                "voices": {"type": "array", "items": obj},
                                "owners": {"type": "object", "additionalProperties": {"type": "integer"}},
                                "max_stored_voices": {"type": "integer"},
                                "max_voices_per_owner": {"type": "integer"},
                            },
                        },
                    ),
                    **_common_errors(401),
                },
            }
        },
        "/api/stream": {
            "post": {
                "summary": "synthesize one take, streamed as frames (legacy, byte-compatible)",
                "description": (
                    "Answers application/octet-stream: frames [u8 tag][u32 BE length][payload]; tag 0 JSON "
                    "(start first, end last), tag 1 int16 LE PCM at 48 kHz. Errors before streaming are JSON."
                ),
                "requestBody": {"required": False, "content": {JSON: {"schema": _stream_request_schema(app)}}},
                "responses": {
                    "200": _ok("the take's frames", {"type": "string", "format": "binary"}, "application/octet-stream"),
                    **_common_errors(400, 401, 403, 404, 408, 413, 415, 422, 429, 503),
                },
            }
        },
        "/api/takes/{take_id}": {
            "get": {
                "summary": "a take's metadata",
                "parameters": [take_id],
                "responses": {"200": _ok("the take", obj), **_common_errors(401, 404)},
            }
        },
        "/api/takes/{take_id}.wav": {
            "get": {
                "summary": "a take's audio: 48 kHz WAV, or another format and rate (see docs/openai.md)",
                "parameters": [
                    take_id,
                    {"name": "format", "in": "query", "required": False,
                     "schema": {"type": "string", "enum": list(FORMATS)}},
                    {"name": "sample_rate", "in": "query", "required": False,
                     "schema": {"type": "integer", "enum": list(SAMPLE_RATES)}},
                ],
                "responses": {
                    "200": {
                        "description": "the audio",
                        "content": {
                            media: {"schema": {"type": "string", "format": "binary"}}
                            for media in sorted({AudioFormat(name).media_type for name in FORMATS})
                        },
                    },
                    **_common_errors(401, 404, 422, 429, 503),
                },
            }
        },
        "/api/token": {
            "post": {
                "summary": "trade the API key for a short-lived browser token",
                "description": "Pass the token as ?token= on the WebSocket URL or as a Bearer header.",
                "responses": {
                    "200": _ok(
                        "a token (null when no API key is configured)",
                        {
                            "type": "object",
                            "required": ["auth_required", "token"],
                            "properties": {
                                "auth_required": {"type": "boolean"},
                                "token": {"type": "string", "nullable": True},
                                "expires_at": {"type": "integer", "nullable": True},
                                "expires_in": {"type": "integer", "nullable": True},
                            },
                        },
                    ),
                    **_common_errors(401, 403, 429),
                },
            }
        },
        "/api/openapi.json": {
            "get": {"summary": "this document", "security": [], "responses": {"200": _ok("OpenAPI 3", obj)}}
        },
    }
    paths.update(_words_paths(take_id, session_id, share, limits.max_text_chars))
    if any(getattr(r, "canonical", None) == "/v1/audio/speech" for r in app.router.resources()):
        paths.update(_v1_paths(app))
    if any(getattr(r, "canonical", None) == "/api/scripts" for r in app.router.resources()):
        paths.update(_script_paths(app))
    if any(getattr(r, "canonical", None) == "/metrics" for r in app.router.resources()):
        paths["/metrics"] = {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {"200": _ok("metrics", {"type": "string"}, "text/plain"), **_common_errors(401)},
            }
        }
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "moss_rt",
            "version": __version__,
            "description": (
                "Realtime TTS service. The WebSocket directing channel is GET /api/ws (see docs/protocol.md); "
                "limits: docs/limits.md; auth: docs/security.md."
            ),
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "OpenAIError": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["message", "type", "param", "code"],
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "param": {"type": "string", "nullable": True},
                                "code": {"type": "string", "enum": [c.value for c in ErrorCode]},
                            },
                        }
                    },
                },
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["code", "message"],
                            "properties": {
                                "code": {"type": "string", "enum": [c.value for c in ErrorCode]},
                                "message": {"type": "string"},
                                "field": {"type": "string"},
                            },
                        }
                    },
                },
            },
        },
        # Optional: enforced only when the service has an API key.
        "security": [{}, {"bearer": []}],
        "paths": paths,
    }
