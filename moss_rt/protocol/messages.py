"""Typed control messages of wire protocol v1 and their one schema (JSON text or msgpack binary).

Client → server: ``start``, ``cancel``, ``seek``, ``ping``.
Server → client: ``hello``, ``start``, ``seek``, ``end``, ``error``, ``pong``.
Unknown keys are ignored (forward compatibility); unknown types, wrong types, out-of-range
values and oversize messages raise :class:`ProtocolError` with a stable code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import msgpack

from moss_rt.protocol.errors import ErrorCode, ProtocolError
from moss_rt.protocol.frames import decode_json_object, dumps_json
from moss_rt.protocol.limits import Limits
from moss_rt.protocol.schema import Field, coerce, short_repr, validate_fields

PROTOCOL_VERSION = 1
SAMPLE_RATE = 48000
FRAME_SAMPLES = 3840  # per channel per 80 ms codec frame
N_CODEBOOKS = 12  # codes per frame (the first 12 of the codec's 32 levels)
FRAME_RATE = SAMPLE_RATE / FRAME_SAMPLES  # 12.5 frames per second
DEFAULT_MODEL_ALIAS = "v2-best"
DEFAULT_TEXT = "Hello! This is moss_rt, streaming expressive speech in real time."
DEFAULT_LIMITS = Limits()  # frozen, so one shared default is safe

# Why a take ended (``reason`` of the server ``end`` message).
END_REASONS = ("done", "cancelled", "max_frames", "replaced", "shutdown", "error")
SEEK_MODES = ("retake", "replay")


def frame_at_time(time_sec: float) -> int:
    """The index of the 80 ms frame that contains the instant ``time_sec``.

    The instant is first snapped to the nearest sample, so ``frame_at_time(n * 0.08) == n`` for
    every n despite binary floating point (``int(2.32 * 12.5)`` would give 28, not 29).
    """
    return round(time_sec * SAMPLE_RATE) // FRAME_SAMPLES


# Sampling defaults of the original playground (the upstream browser app's values).
SAMPLING_DEFAULTS: dict[str, float | int] = {
    "audio_temperature": 1.7,
    "audio_top_p": 0.8,
    "audio_top_k": 25,
    "audio_repetition_penalty": 1.0,
    "text_temperature": 1.0,
    "text_top_p": 1.0,
    "text_top_k": 50,
}

SAMPLING_FIELDS: dict[str, Field] = {
    "audio_temperature": Field("float", SAMPLING_DEFAULTS["audio_temperature"], 0.0, 10.0),
    "audio_top_p": Field("float", SAMPLING_DEFAULTS["audio_top_p"], 0.0, 1.0, exclusive_minimum=True),
    "audio_top_k": Field("int", SAMPLING_DEFAULTS["audio_top_k"], 0, 1024),
    "audio_repetition_penalty": Field(
        "float", SAMPLING_DEFAULTS["audio_repetition_penalty"], 0.0, 10.0, exclusive_minimum=True
    ),
    "text_temperature": Field("float", SAMPLING_DEFAULTS["text_temperature"], 0.0, 10.0),
    "text_top_p": Field("float", SAMPLING_DEFAULTS["text_top_p"], 0.0, 1.0, exclusive_minimum=True),
    "text_top_k": Field("int", SAMPLING_DEFAULTS["text_top_k"], 0, 1024),
}

SEED_FIELD = Field("int", None, 0, 2**63 - 1, nullable=True)
MAX_SEED = 2**63 - 1


def _stream_fields(limits: Limits) -> dict[str, Field]:
    """Fields of POST /api/stream, which the WebSocket ``start`` shares."""
    return {
        "text": Field("str", DEFAULT_TEXT, max_length=limits.max_text_chars),
        "instruction": Field("str", "", max_length=limits.max_instruction_chars),
        "language": Field("str", "", max_length=64),
        "reference": Field("str", "none", max_length=128),
        "seed": SEED_FIELD,
        **SAMPLING_FIELDS,
        "max_new_tokens": Field("int", limits.max_new_tokens, 1, limits.max_new_tokens),
        "chunk_frames": Field("int", 8, limits.min_chunk_frames, limits.max_chunk_frames),
        "model": Field("str", DEFAULT_MODEL_ALIAS, max_length=256),
        "tokens": Field("int", None, 1, limits.max_new_tokens, nullable=True),
    }


def _validate_text(values: dict[str, Any]) -> None:
    if not values["text"].strip():
        raise ProtocolError(ErrorCode.INVALID_FIELD, "'text' must not be empty", field="text")


# --------------------------------------------------------------------------- client → server


@dataclass(frozen=True, slots=True)
class SamplingParams:
    audio_temperature: float = 1.7
    audio_top_p: float = 0.8
    audio_top_k: int = 25
    audio_repetition_penalty: float = 1.0
    text_temperature: float = 1.0
    text_top_p: float = 1.0
    text_top_k: int = 50

    def replace(self, **overrides: Any) -> SamplingParams:
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True, slots=True)
class StartTake:
    """A synthesis request: the body of POST /api/stream or a WebSocket ``start``."""

    type: ClassVar[str] = "start"
    text: str = DEFAULT_TEXT
    instruction: str = ""
    language: str = ""
    reference: str = "none"
    seed: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 4096
    chunk_frames: int = 8
    model: str = DEFAULT_MODEL_ALIAS
    tokens: int | None = None
    take: str | None = None  # client label, WebSocket only
    channels: int = 1

    @classmethod
    def parse(cls, obj: dict[str, Any], limits: Limits) -> StartTake:
        fields = _stream_fields(limits)
        fields["take"] = Field("str", None, max_length=64, nullable=True)
        fields["channels"] = Field("int", 1, choices=(1, 2))
        values = validate_fields(fields, obj)
        _validate_text(values)
        sampling = SamplingParams(**{k: values.pop(k) for k in SAMPLING_FIELDS})
        return cls(sampling=sampling, **values)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sampling"}
        out.update(dataclasses.asdict(self.sampling))
        return {"type": self.type, **{k: v for k, v in out.items() if v is not None}}


@dataclass(frozen=True, slots=True)
class Cancel:
    type: ClassVar[str] = "cancel"
    take: str | None = None

    @classmethod
    def parse(cls, obj: dict[str, Any], limits: Limits) -> Cancel:
        return cls(**validate_fields({"take": Field("str", None, max_length=64, nullable=True)}, obj))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **({"take": self.take} if self.take is not None else {})}


@dataclass(frozen=True, slots=True)
class Seek:
    """Retake (or replay) a take from frame N; overrides apply to the new continuation only."""

    type: ClassVar[str] = "seek"
    take: str
    frame: int
    mode: Literal["retake", "replay"] = "retake"
    seed: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # only the overridden fields
    instruction: str | None = None
    text: str | None = None

    @classmethod
    def parse(cls, obj: dict[str, Any], limits: Limits) -> Seek:
        fields: dict[str, Field] = {
            "take": Field("str", max_length=64),
            "frame": Field("int", None, 0, limits.max_new_tokens, nullable=True),
            "time_sec": Field("float", None, 0.0, limits.max_new_tokens / FRAME_RATE, nullable=True),
            "mode": Field("str", "retake", choices=SEEK_MODES),
            "seed": SEED_FIELD,
            "instruction": Field("str", None, max_length=limits.max_instruction_chars, nullable=True),
            "text": Field("str", None, max_length=limits.max_text_chars, nullable=True),
        }
        values = validate_fields(fields, obj)
        sampling = {k: coerce(k, spec, obj[k]) for k, spec in SAMPLING_FIELDS.items() if obj.get(k) is not None}
        frame, time_sec = values.pop("frame"), values.pop("time_sec")
        if (frame is None) == (time_sec is None):
            raise ProtocolError(ErrorCode.INVALID_FIELD, "give exactly one of 'frame' or 'time_sec'", field="frame")
        if frame is None:
            frame = min(frame_at_time(time_sec), limits.max_new_tokens)
        if values["text"] is not None and not values["text"].strip():
            raise ProtocolError(ErrorCode.INVALID_FIELD, "'text' must not be empty", field="text")
        if values["mode"] == "replay":
            # A replay re-sends existing audio: generation overrides would be silently lost.
            overrides = {**{k: values[k] for k in ("seed", "instruction", "text")}, **sampling}
            for name, value in overrides.items():
                if value is not None:
                    raise ProtocolError(
                        ErrorCode.INVALID_FIELD, f"{name!r} cannot be changed by a replay, only by a retake", field=name
                    )
        return cls(frame=frame, sampling=sampling, **values)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "take": self.take, "frame": self.frame, "mode": self.mode}
        for name in ("seed", "instruction", "text"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        out.update(self.sampling)
        return out


@dataclass(frozen=True, slots=True)
class Ping:
    type: ClassVar[str] = "ping"
    t: float | None = None

    @classmethod
    def parse(cls, obj: dict[str, Any], limits: Limits) -> Ping:
        return cls(**validate_fields({"t": Field("float", None, nullable=True)}, obj))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **({"t": self.t} if self.t is not None else {})}


@dataclass(frozen=True, slots=True)
class Resume:
    """Bind the connection to a directing session kept on disk (a new one without ``session``): its stored takes
    become this connection's takes (replayable, retakeable) and every take that ends from now on is kept in it."""

    type: ClassVar[str] = "resume"
    session: str | None = None

    @classmethod
    def parse(cls, obj: dict[str, Any], limits: Limits) -> Resume:
        return cls(**validate_fields({"session": Field("str", None, max_length=80, nullable=True)}, obj))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **({"session": self.session} if self.session is not None else {})}


ClientMessage = StartTake | Cancel | Seek | Ping | Resume
CLIENT_TYPES: dict[str, type[StartTake] | type[Cancel] | type[Seek] | type[Ping] | type[Resume]] = {
    "start": StartTake,
    "cancel": Cancel,
    "seek": Seek,
    "ping": Ping,
    "resume": Resume,
}


def parse_client_message(obj: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> ClientMessage:
    """Validate a decoded JSON object / msgpack map as a client message."""
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"a message must be an object, got {type(obj).__name__}")
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "a message needs a string 'type'", field="type")
    cls = CLIENT_TYPES.get(kind)
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {short_repr(kind)}", field="type")
    return cls.parse(obj, limits)


def parse_stream_request(obj: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> StartTake:
    """The legacy POST /api/stream body: the same fields as ``start`` without a ``type``."""
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"the body must be a JSON object, got {type(obj).__name__}")
    return StartTake.parse(obj, limits)


def decode_stream_request(body: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> StartTake:
    """The raw body of POST /api/stream: size limit (``too_large``), strict JSON, then the schema.

    An empty body means "all defaults", like ``{}``.
    """
    if len(body) > limits.max_request_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"request body exceeds {limits.max_request_bytes} bytes")
    return parse_stream_request(decode_json_object(body) if len(body) else {}, limits)


def decode_client_text(text: str | bytes, limits: Limits = DEFAULT_LIMITS) -> ClientMessage:
    """A WebSocket text message: one JSON object (bytes are taken as its UTF-8 encoding)."""
    if len(text) > limits.max_message_bytes or (
        isinstance(text, str) and len(text.encode("utf-8", "surrogatepass")) > limits.max_message_bytes
    ):
        raise ProtocolError(ErrorCode.TOO_LARGE, f"message exceeds {limits.max_message_bytes} bytes")
    return parse_client_message(decode_json_object(text), limits)


def decode_client_binary(data: bytes, limits: Limits = DEFAULT_LIMITS) -> ClientMessage:
    """A WebSocket binary message from a client: one msgpack map."""
    if len(data) > limits.max_message_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"message exceeds {limits.max_message_bytes} bytes")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(ErrorCode.BAD_JSON, f"invalid msgpack: {exc}") from None
    except Exception as exc:  # msgpack raises several unrelated types on corrupt input
        raise ProtocolError(ErrorCode.BAD_JSON, f"invalid msgpack: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "a msgpack map is expected")
    return parse_client_message(obj, limits)


def encode_message(msg: ClientMessage | ServerMessage, fmt: Literal["json", "msgpack"] = "json") -> str | bytes:
    obj = msg.to_dict()
    if fmt == "json":
        return dumps_json(obj)
    if fmt == "msgpack":
        return msgpack.packb(obj, use_bin_type=True)
    raise ValueError(f"unknown format {fmt!r}")


# --------------------------------------------------------------------------- server → client
# Server messages travel as tag-0 frames. They are built by the server and read by clients,
# which must tolerate fields added later; so these are plain records with a dict round trip.


@dataclass(frozen=True, slots=True)
class ServerMessage:
    type: str
    body: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **self.body}

    def __getitem__(self, key: str) -> Any:
        return self.body[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.body.get(key, default)


SERVER_REQUIRED: dict[str, tuple[str, ...]] = {
    "hello": ("protocol", "sr", "frame_samples"),
    "start": ("sr",),
    "seek": ("take", "frame", "sample"),
    "end": ("n_frames", "duration_sec"),
    "error": ("code", "message"),
    "pong": ("server_t",),
}


def hello(*, models: list[str], default_model: str, demo: bool, limits: Limits, **extra: Any) -> ServerMessage:
    return ServerMessage(
        "hello",
        {
            "protocol": PROTOCOL_VERSION,
            "sr": SAMPLE_RATE,
            "frame_samples": FRAME_SAMPLES,
            "models": models,
            "default_model": default_model,
            "demo": demo,
            "limits": limits.to_dict(),
            **extra,
        },
    )


def error_message(err: ProtocolError, *, take: str | None = None) -> ServerMessage:
    body = {**err.to_dict(), "fatal": err.fatal}
    if take is not None:
        body["take"] = take
    return ServerMessage("error", body)


def http_error_body(err: ProtocolError) -> dict[str, Any]:
    """The JSON body of an HTTP 4xx/5xx answer: ``{"error": {"code", "message"[, "field"]}}``."""
    return {"error": err.to_dict()}


def seek_ack(*, take: str, from_take: str, frame: int, **extra: Any) -> ServerMessage:
    """The server's answer to ``seek``; ``sample`` is where the following PCM starts (per channel)."""
    return ServerMessage(
        "seek", {"take": take, "from_take": from_take, "frame": frame, "sample": frame * FRAME_SAMPLES, **extra}
    )


def pong(*, t: float | None, server_t: float) -> ServerMessage:
    return ServerMessage("pong", {"t": t, "server_t": server_t})


def parse_server_message(obj: dict[str, Any]) -> ServerMessage:
    """Read a tag-0 object sent by the server (used by clients)."""
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"a message must be an object, got {type(obj).__name__}")
    kind = obj.get("type")
    if not isinstance(kind, str) or kind not in SERVER_REQUIRED:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown server message type {short_repr(kind)}")
    missing = [k for k in SERVER_REQUIRED[kind] if k not in obj]
    if missing:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"server {kind!r} lacks {missing}")
    return ServerMessage(kind, {k: v for k, v in obj.items() if k != "type"})
