"""Typed control messages of wire protocol v1 and their one schema (JSON text or msgpack binary).

Client → server: ``start``, ``cancel``, ``seek``, ``ping``, and for streamed text ``append``, ``flush``,
``end_of_text``.
Server → client: ``hello``, ``start``, ``seek``, ``end``, ``error``, ``pong``, ``words``.
Unknown keys are ignored (forward compatibility); unknown types, wrong types, out-of-range
values and oversize messages raise :class:`ProtocolError` with a stable code.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Literal, Self

import msgpack

from moss_rt.generation import (
    FRAME_RATE,
    FRAME_SAMPLES,
    MAX_SEED,
    SAMPLE_RATE,
    SAMPLING_DEFAULTS,
    SAMPLING_RANGES,
    EndReason,
    SamplingParams,
    frame_at_time,
)
from moss_rt.protocol.errors import ErrorCode, ProtocolError
from moss_rt.protocol.frames import decode_json_object, dumps_json
from moss_rt.protocol.limits import Limits
from moss_rt.protocol.schema import Field, coerce, short_repr, validate_fields

PROTOCOL_VERSION = 1
DEFAULT_MODEL_ALIAS = "v2-best"
DEFAULT_TEXT = "Hello! This is moss_rt, streaming expressive speech in real time."
DEFAULT_CHUNK_FRAMES = 8  # frames per PCM chunk after the first one (WebSocket and the studio)
DEFAULT_LIMITS = Limits()  # frozen, so one shared default is safe

# Why a take ended (``reason`` of the server ``end`` message): the engine's own enum, spelled out.
END_REASONS = tuple(reason.value for reason in EndReason)
SEEK_MODES = ("retake", "replay")
# Delivery formats a take can ask for (``format``; OpenAI's response_format names) and their rates.
# ``pcm`` at 48 kHz is the native tag-1 stream; anything else arrives as tag-2 frames (moss_rt.formats).
AUDIO_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
AUDIO_SAMPLE_RATES = (SAMPLE_RATE, 24000, 16000)

# What POST /api/stream uses for a field the request leaves out (or sends as null): the values of
# the original playground's documented request body, so a legacy client that sends only ``text``
# hears what it heard there. The WebSocket and the studio keep the service defaults above (shown in
# ``hello``). ``max_new_tokens`` and ``chunk_frames`` are capped by the configured limits.
LEGACY_STREAM_DEFAULTS: dict[str, float | int | str] = {
    "audio_temperature": 1.0,
    "audio_top_p": 0.95,
    "audio_top_k": 25,
    "audio_repetition_penalty": 1.1,
    "text_temperature": 1.0,
    "text_top_p": 1.0,
    "text_top_k": 50,
    "max_new_tokens": 3200,
    "chunk_frames": 18,
    "language": "English",
    "seed": 0,
    "reference": "none",
}

# The wire form of the sampling fields: their defaults and ranges come from SamplingParams.
SAMPLING_FIELDS: dict[str, Field] = {
    name: Field(r.kind, SAMPLING_DEFAULTS[name], r.minimum, r.maximum, exclusive_minimum=r.exclusive_minimum)
    for name, r in SAMPLING_RANGES.items()
}

SEED_FIELD = Field("int", None, 0, MAX_SEED, nullable=True)


def stream_fields(limits: Limits) -> dict[str, Field]:
    """Fields of POST /api/stream, which the WebSocket ``start`` shares."""
    return {
        "text": Field("str", DEFAULT_TEXT, max_length=limits.max_text_chars),
        "instruction": Field("str", "", max_length=limits.max_instruction_chars),
        "language": Field("str", "", max_length=64),
        "reference": Field("str", "none", max_length=128),
        "seed": SEED_FIELD,
        **SAMPLING_FIELDS,
        "max_new_tokens": Field("int", limits.max_new_tokens, 1, limits.max_new_tokens),
        "chunk_frames": Field("int", DEFAULT_CHUNK_FRAMES, limits.min_chunk_frames, limits.max_chunk_frames),
        "model": Field("str", DEFAULT_MODEL_ALIAS, max_length=256),
        "tokens": Field("int", None, 1, limits.max_new_tokens, nullable=True),
    }


def _validate_text(values: dict[str, Any]) -> None:
    if not values["text"].strip():
        raise ProtocolError(ErrorCode.INVALID_FIELD, "'text' must not be empty", field="text")


# --------------------------------------------------------------------------- client → server


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
    chunk_frames: int = DEFAULT_CHUNK_FRAMES
    model: str = DEFAULT_MODEL_ALIAS
    tokens: int | None = None
    take: str | None = None  # client label, WebSocket only
    channels: int = 1
    format: str | None = None  # delivery format (None: native 48 kHz PCM, tag 1)
    sample_rate: int | None = None  # of the delivery format (None: 48000)
    stream_text: bool = False  # WebSocket only: more text follows in append messages
    words: bool = False  # WebSocket only: send the take's word timings (``words`` messages)

    @classmethod
    def parse(cls, obj: dict[str, Any], limits: Limits) -> StartTake:
        fields = stream_fields(limits)
        fields["take"] = Field("str", None, max_length=64, nullable=True)
        fields["channels"] = Field("int", 1, choices=(1, 2))
        fields["format"] = Field("str", None, choices=AUDIO_FORMATS, nullable=True)
        fields["sample_rate"] = Field("int", None, choices=AUDIO_SAMPLE_RATES, nullable=True)
        fields["stream_text"] = Field("bool", False)
        fields["words"] = Field("bool", False)
        values = validate_fields(fields, obj)
        if values["stream_text"]:
            # The text may come later (append); what is given now is the first of it.
            if "text" not in obj or obj["text"] is None:
                values["text"] = ""
        else:
            _validate_text(values)
        sampling = SamplingParams(**{k: values.pop(k) for k in SAMPLING_FIELDS})
        return cls(sampling=sampling, **values)

    def delivery(self) -> tuple[str, int] | None:
        """The (format, sample_rate) the audio is delivered in as tag-2 frames; None for native 48 kHz PCM."""
        name, rate = self.format or "pcm", self.sample_rate or SAMPLE_RATE
        return None if (name, rate) == ("pcm", SAMPLE_RATE) else (name, rate)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sampling"}
        out.update(dataclasses.asdict(self.sampling))
        if not self.stream_text:
            out.pop("stream_text")
        if not self.words:
            out.pop("words")
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
    # The n-th word of the take (0-based) instead of a frame: the seek goes to the frame where it starts
    # (``frame`` is then resolved from the take's words by the session).
    word: int | None = None
    words: bool | None = None  # a retake's word timings (None: as the source take asked)

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
            "word": Field("int", None, 0, limits.max_text_chars, nullable=True),
            "words": Field("bool", None, nullable=True),
        }
        values = validate_fields(fields, obj)
        sampling = {k: coerce(k, spec, obj[k]) for k, spec in SAMPLING_FIELDS.items() if obj.get(k) is not None}
        frame, time_sec = values.pop("frame"), values.pop("time_sec")
        if sum(v is not None for v in (frame, time_sec, values["word"])) != 1:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD, "give exactly one of 'frame', 'time_sec' or 'word'", field="frame"
            )
        if values["word"] is not None:
            frame = 0  # resolved from the take's words when the seek is planned
        elif frame is None:
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
        out: dict[str, Any] = {"type": self.type, "take": self.take, "mode": self.mode}
        if self.word is None:
            out["frame"] = self.frame
        for name in ("seed", "instruction", "text", "word", "words"):
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


def _take_field() -> Field:
    return Field("str", None, max_length=64, nullable=True)


@dataclass(frozen=True, slots=True)
class Discard:
    """The director never had take ``take`` (a take id, or the label of a ``start``; replaced before it was heard):
    it is not kept in the bound session, so it takes no number there. A take already kept stays (delete it over
    HTTP)."""

    type: ClassVar[str] = "discard"
    take: str

    @classmethod
    def parse(cls, obj: dict[str, Any], limits: Limits) -> Discard:
        return cls(**validate_fields({"take": Field("str", max_length=64)}, obj))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "take": self.take}


@dataclass(frozen=True, slots=True)
class AppendText:
    """More text for the running take opened with ``stream_text`` (spoken sentence by sentence)."""

    type: ClassVar[str] = "append"
    text: str
    take: str | None = None

    @classmethod
    def parse(cls, obj: dict[str, Any], limits: Limits) -> AppendText:
        fields = {"text": Field("str", max_length=limits.max_text_chars), "take": _take_field()}
        return cls(**validate_fields(fields, obj))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "text": self.text, **({"take": self.take} if self.take is not None else {})}


@dataclass(frozen=True, slots=True)
class FlushText:
    """Speak the text received so far without waiting for the end of its sentence."""

    type: ClassVar[str] = "flush"
    take: str | None = None

    @classmethod
    def parse(cls, obj: dict[str, Any], limits: Limits) -> FlushText:
        return cls(**validate_fields({"take": _take_field()}, obj))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **({"take": self.take} if self.take is not None else {})}


@dataclass(frozen=True, slots=True)
class EndOfText:
    """No more text: the take ends once everything received is spoken."""

    type: ClassVar[str] = "end_of_text"
    take: str | None = None

    @classmethod
    def parse(cls, obj: dict[str, Any], limits: Limits) -> EndOfText:
        return cls(**validate_fields({"take": _take_field()}, obj))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **({"take": self.take} if self.take is not None else {})}


ClientMessage = StartTake | Cancel | Seek | Ping | AppendText | FlushText | EndOfText | Resume | Discard
CLIENT_TYPES: dict[str, type[ClientMessage]] = {
    "start": StartTake,
    "cancel": Cancel,
    "seek": Seek,
    "ping": Ping,
    "resume": Resume,
    "append": AppendText,
    "flush": FlushText,
    "end_of_text": EndOfText,
    "discard": Discard,
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


def legacy_stream_defaults(limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """:data:`LEGACY_STREAM_DEFAULTS` within ``limits`` (a server may allow fewer frames or smaller chunks)."""
    out = dict(LEGACY_STREAM_DEFAULTS)
    out["max_new_tokens"] = min(int(out["max_new_tokens"]), limits.max_new_tokens)
    out["chunk_frames"] = max(limits.min_chunk_frames, min(int(out["chunk_frames"]), limits.max_chunk_frames))
    return out


def parse_stream_request(obj: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> StartTake:
    """The legacy POST /api/stream body: the same fields as ``start`` without a ``type``.

    Omitted (or null) fields take the original playground's values (:data:`LEGACY_STREAM_DEFAULTS`).
    """
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"the body must be a JSON object, got {type(obj).__name__}")
    filled = dict(obj)
    for name, value in legacy_stream_defaults(limits).items():
        if filled.get(name) is None:
            filled[name] = value
    if filled.get("words"):
        raise ProtocolError(
            ErrorCode.INVALID_FIELD,
            "'words' needs the WebSocket; over HTTP, GET /api/takes/{id}/words (or .srt, .vtt) after the take",
            field="words",
        )
    if filled.get("stream_text"):
        raise ProtocolError(
            ErrorCode.INVALID_FIELD, "'stream_text' needs the WebSocket (text arrives in append messages)",
            field="stream_text",
        )
    return StartTake.parse(filled, limits)


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
    except msgpack.StackError:  # raised without a message
        raise ProtocolError(ErrorCode.BAD_JSON, "invalid msgpack: nested too deeply") from None
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
        raise ProtocolError(ErrorCode.BAD_JSON, f"invalid msgpack: {exc or type(exc).__name__}") from None
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
        packed: bytes = msgpack.packb(obj, use_bin_type=True)
        return packed
    raise ValueError(f"unknown format {fmt!r}")


# --------------------------------------------------------------------------- server → client
# Server messages travel as tag-0 frames: one frozen dataclass per type, built by the server (web/)
# and read by clients (moss_rt.client). Clients must tolerate fields added later, so parsing keeps
# unknown fields in ``extra``, and an optional field a message does not carry is UNSET (absent on
# the wire), which is not the same as ``None`` (``null`` on the wire).


class Unset(enum.Enum):
    UNSET = "unset"

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = Unset.UNSET


@dataclass(frozen=True, kw_only=True)
class ServerMessage:
    """Base of the server messages: dict round trip, read access by key, fields added later kept."""

    type: ClassVar[str] = ""
    required: ClassVar[tuple[str, ...]] = ()  # what a client insists on when parsing
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "extra" and value is not UNSET:
                out[f.name] = value
        out.update(self.extra)
        return out

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_dict().get(key, default)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Self:
        missing = [k for k in cls.required if k not in obj]
        if missing:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"server {cls.type!r} lacks {missing}")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in obj.items() if k in names}
        extra = {k: v for k, v in obj.items() if k not in names and k != "type"}
        return cls(**known, extra=extra)


@dataclass(frozen=True, kw_only=True)
class Hello(ServerMessage):
    """Sent once on connect: the audio format, the models, the limits and the sampling defaults."""

    type: ClassVar[str] = "hello"
    required: ClassVar[tuple[str, ...]] = ("protocol", "sr", "frame_samples")
    protocol: int = PROTOCOL_VERSION
    sr: int = SAMPLE_RATE
    frame_samples: int = FRAME_SAMPLES
    models: list[str] | Unset = UNSET
    default_model: str | Unset = UNSET
    demo: bool | Unset = UNSET
    limits: dict[str, Any] | Unset = UNSET
    engine: str | Unset = UNSET
    sampling_defaults: dict[str, float | int] | Unset = UNSET
    sampling_ranges: dict[str, dict[str, Any]] | Unset = UNSET
    defaults: dict[str, float | int] | Unset = UNSET  # every defaulted numeric field of ``start``


@dataclass(frozen=True, kw_only=True)
class TakeStarted(ServerMessage):
    """``start``: right before a take's first PCM (``sr`` and ``gpu_first_ms`` lead, as in the legacy stream)."""

    type: ClassVar[str] = "start"
    required: ClassVar[tuple[str, ...]] = ("sr",)
    sr: int = SAMPLE_RATE
    gpu_first_ms: float | None | Unset = UNSET
    take: str | Unset = UNSET
    channels: int | Unset = UNSET
    seed: int | Unset = UNSET
    model: str | Unset = UNSET
    first_frame: int | Unset = UNSET
    label: str | Unset = UNSET
    replay: bool | Unset = UNSET
    # A take that asked for a delivery format: its audio follows as tag-2 frames of this format and rate.
    format: str | Unset = UNSET
    sample_rate: int | Unset = UNSET


@dataclass(frozen=True, kw_only=True)
class SeekAck(ServerMessage):
    """The answer to ``seek``; ``sample`` (= frame × 3840) is where the following PCM starts."""

    type: ClassVar[str] = "seek"
    required: ClassVar[tuple[str, ...]] = ("take", "frame", "sample")
    take: str
    from_take: str | Unset = UNSET
    frame: int
    sample: int
    # Retakes: the parent's cache was not where it was kept (cluster: replica lost or full) and was
    # rebuilt elsewhere from the stored codes. Always false in single-process mode.
    rebuilt: bool | Unset = UNSET


@dataclass(frozen=True, kw_only=True)
class TakeEnded(ServerMessage):
    """``end``: the last frame of a take (also of a replay, with ``replay: true``)."""

    type: ClassVar[str] = "end"
    required: ClassVar[tuple[str, ...]] = ("n_frames", "duration_sec")
    take: str | Unset = UNSET
    reason: str | Unset = UNSET
    replay: bool | Unset = UNSET
    n_frames: int
    new_frames: int | Unset = UNSET
    duration_sec: float
    gpu_total_ms: float | Unset = UNSET
    gpu_first_ms: float | None | Unset = UNSET
    ttfa_ms: float | None | Unset = UNSET
    rtf: float | None | Unset = UNSET


@dataclass(frozen=True, kw_only=True)
class ErrorMessage(ServerMessage):
    """``error``: a stable ``code``; the socket stays usable unless ``fatal``."""

    type: ClassVar[str] = "error"
    required: ClassVar[tuple[str, ...]] = ("code", "message")
    code: str
    message: str
    field: str | Unset = UNSET
    fatal: bool | Unset = UNSET
    take: str | Unset = UNSET

    @classmethod
    def of(cls, err: ProtocolError, *, take: str | None = None) -> ErrorMessage:
        return cls(
            code=err.code.value,
            message=err.message,
            field=UNSET if err.field is None else err.field,
            fatal=err.fatal,
            take=UNSET if take is None else take,
        )


@dataclass(frozen=True, kw_only=True)
class Pong(ServerMessage):
    type: ClassVar[str] = "pong"
    required: ClassVar[tuple[str, ...]] = ("server_t",)
    t: float | None | Unset = UNSET
    server_t: float


@dataclass(frozen=True, kw_only=True)
class SessionResumed(ServerMessage):
    """``session``: the answer to ``resume``, the directing session this connection is bound to and its takes."""

    type: ClassVar[str] = "session"
    required: ClassVar[tuple[str, ...]] = ("session", "takes")
    session: str = ""
    resumed: bool = False  # False: a new session was created
    max_takes: int | Unset = UNSET
    takes: list[dict[str, Any]] = field(default_factory=list)  # stored take records, oldest first
    next_number: int | Unset = UNSET  # the number the session's next stored take gets ("Take 8")


@dataclass(frozen=True, kw_only=True)
class TakeStored(ServerMessage):
    """``stored``: a take of this connection was kept in its bound session as take ``number`` (given once, never
    reused in the session); sent right before the take's ``end``."""

    type: ClassVar[str] = "stored"
    required: ClassVar[tuple[str, ...]] = ("take", "number")
    take: str
    number: int
    session: str | Unset = UNSET


@dataclass(frozen=True, kw_only=True)
class Words(ServerMessage):
    """``words``: the next words of a take and when they are said (seconds from the take's sample 0).

    Sent in order, each word once, never changed afterwards; ``index`` is the position of the first of them in the
    take's words; the last batch (possibly empty) has ``final: true`` and comes before the take's ``end``. Each word
    is ``{"word", "start", "end"}`` plus ``"flags": ["interpolated"]`` when its time is estimated.
    """

    type: ClassVar[str] = "words"
    required: ClassVar[tuple[str, ...]] = ("take", "words")
    take: str
    words: list[dict[str, Any]] = field(default_factory=list)
    index: int | Unset = UNSET
    final: bool | Unset = UNSET


SERVER_TYPES: dict[str, type[ServerMessage]] = {
    cls.type: cls
    for cls in (Hello, TakeStarted, SeekAck, TakeEnded, ErrorMessage, Pong, SessionResumed, Words, TakeStored)
}


def hello(
    *,
    models: list[str],
    default_model: str,
    demo: bool,
    limits: Limits,
    engine: str | Unset = UNSET,
    sampling: bool = False,
    **extra: Any,
) -> Hello:
    """The ``hello`` message; ``sampling`` adds the request defaults and the sampling ranges (the
    studio's one source for them)."""
    defaults = {**SAMPLING_DEFAULTS, "max_new_tokens": limits.max_new_tokens, "chunk_frames": DEFAULT_CHUNK_FRAMES}
    return Hello(
        models=models,
        default_model=default_model,
        demo=demo,
        limits=limits.to_dict(),
        engine=engine,
        sampling_defaults=dict(SAMPLING_DEFAULTS) if sampling else UNSET,
        sampling_ranges={k: r.to_dict() for k, r in SAMPLING_RANGES.items()} if sampling else UNSET,
        defaults=defaults if sampling else UNSET,
        extra=extra,
    )


def error_message(err: ProtocolError, *, take: str | None = None) -> ErrorMessage:
    return ErrorMessage.of(err, take=take)


def http_error_body(err: ProtocolError) -> dict[str, Any]:
    """The JSON body of an HTTP 4xx/5xx answer: ``{"error": {"code", "message"[, "field"]}}``."""
    return {"error": err.to_dict()}


def seek_ack(*, take: str, from_take: str, frame: int, **extra: Any) -> SeekAck:
    """The server's answer to ``seek``; ``sample`` is where the following PCM starts (per channel)."""
    return SeekAck(take=take, from_take=from_take, frame=frame, sample=frame * FRAME_SAMPLES, extra=extra)


def pong(*, t: float | None, server_t: float) -> Pong:
    return Pong(t=t, server_t=server_t)


def parse_server_message(obj: dict[str, Any]) -> ServerMessage:
    """Read a tag-0 object sent by the server (used by clients)."""
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"a message must be an object, got {type(obj).__name__}")
    kind = obj.get("type")
    cls = SERVER_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown server message type {short_repr(kind)}")
    return cls.from_dict(obj)
