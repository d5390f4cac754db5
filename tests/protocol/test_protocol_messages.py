"""Control messages: every type, defaults, every error path, both encodings (pure, no I/O)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgpack
import pytest

from moss_rt.protocol import (
    DEFAULT_LIMITS,
    DEFAULT_MODEL_ALIAS,
    END_REASONS,
    FRAME_RATE,
    FRAME_SAMPLES,
    PROTOCOL_VERSION,
    SAMPLE_RATE,
    SAMPLING_DEFAULTS,
    SEEK_MODES,
    Cancel,
    ErrorCode,
    Frame,
    Limits,
    Ping,
    ProtocolError,
    SamplingParams,
    Seek,
    ServerMessage,
    StartTake,
    decode_client_binary,
    decode_client_text,
    decode_stream_request,
    encode_json_frame,
    encode_message,
    error_message,
    frame_at_time,
    hello,
    http_error_body,
    parse_client_message,
    parse_server_message,
    parse_stream_request,
    pong,
    seek_ack,
)
from moss_rt.protocol.messages import DEFAULT_TEXT


def as_text(obj: Any) -> str:
    return json.dumps(obj)


def as_msgpack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def both(obj: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode the same object sent as JSON text and as msgpack binary; both must agree."""
    a = decode_client_text(as_text(obj), limits)
    b = decode_client_binary(as_msgpack(obj), limits)
    assert a == b
    return a


def error_of(obj: Any, limits: Limits = DEFAULT_LIMITS) -> ProtocolError:
    """The error for ``obj`` sent either way; JSON and msgpack must give the same code and field."""
    errors = []
    for fn, data in ((decode_client_text, as_text(obj)), (decode_client_binary, as_msgpack(obj))):
        with pytest.raises(ProtocolError) as info:
            fn(data, limits)
        errors.append(info.value)
    a, b = errors
    assert (a.code, a.field) == (b.code, b.field), (a, b)
    return a


def invalid(obj: dict[str, Any], field: str, limits: Limits = DEFAULT_LIMITS) -> ProtocolError:
    err = error_of(obj, limits)
    assert err.code is ErrorCode.INVALID_FIELD, err
    assert err.field == field, err
    return err


# --------------------------------------------------------------------------- constants


def test_constants() -> None:
    assert (PROTOCOL_VERSION, SAMPLE_RATE, FRAME_SAMPLES, FRAME_RATE) == (1, 48000, 3840, 12.5)
    assert END_REASONS == ("done", "cancelled", "max_frames", "replaced", "shutdown", "error", "timeout")
    assert SEEK_MODES == ("retake", "replay")


def test_error_codes_are_stable_strings() -> None:
    assert [c.value for c in ErrorCode] == [
        "bad_json",
        "bad_message",
        "unknown_type",
        "invalid_field",
        "too_large",
        "not_found",
        "busy",
        "loading",
        "rate_limited",
        "unauthorized",
        "forbidden_origin",
        "unsupported_media_type",
        "timeout",
        "internal",
        "replica_lost",
        "insufficient_storage",
    ]
    assert ErrorCode.TOO_LARGE == "too_large" and f"{ErrorCode.TOO_LARGE}" == "too_large"
    assert json.dumps({"code": ErrorCode.BAD_JSON}) == '{"code": "bad_json"}'


def test_protocol_error_body() -> None:
    err = ProtocolError(ErrorCode.INVALID_FIELD, "'x' is bad", field="x")
    assert err.to_dict() == {"code": "invalid_field", "message": "'x' is bad", "field": "x"}
    assert str(err) == "'x' is bad" and not err.fatal
    assert ProtocolError(ErrorCode.BAD_JSON, "m").to_dict() == {"code": "bad_json", "message": "m"}


# --------------------------------------------------------------------------- start


def test_start_defaults() -> None:
    msg = both({"type": "start"})
    assert msg == StartTake()
    assert msg.text == DEFAULT_TEXT
    assert (msg.instruction, msg.language, msg.reference) == ("", "", "none")
    assert msg.seed is None and msg.take is None and msg.tokens is None
    assert (msg.max_new_tokens, msg.chunk_frames, msg.channels) == (4096, 8, 1)
    assert msg.model == DEFAULT_MODEL_ALIAS == "v2-best"
    assert msg.sampling == SamplingParams()
    assert {k: getattr(msg.sampling, k) for k in SAMPLING_DEFAULTS} == SAMPLING_DEFAULTS


def test_start_all_fields() -> None:
    obj = {
        "type": "start",
        "text": "Hold on — wait for it…",
        "instruction": "whispered, urgent",
        "language": "en",
        "reference": "ref_abc",
        "seed": 2**63 - 1,
        "audio_temperature": 0.9,
        "audio_top_p": 1.0,
        "audio_top_k": 0,
        "audio_repetition_penalty": 1.1,
        "text_temperature": 0.0,
        "text_top_p": 0.5,
        "text_top_k": 1024,
        "max_new_tokens": 1,
        "chunk_frames": 100,
        "model": "some/model",
        "tokens": 125,
        "take": "scene 1, take 3",
        "channels": 2,
    }
    msg = both(obj)
    assert msg.to_dict() == obj
    assert msg.sampling.audio_top_k == 0 and isinstance(msg.sampling.audio_temperature, float)


def test_start_ignores_unknown_keys_and_nulls_mean_default() -> None:
    msg = both({"type": "start", "future_field": [1, {"x": None}], "chunk_frames": None, "seed": None})
    assert msg.chunk_frames == 8 and msg.seed is None
    assert both({"type": "start", "text": None}).text == DEFAULT_TEXT


def test_start_integral_float_is_an_int() -> None:
    msg = both({"type": "start", "audio_top_k": 30.0, "channels": 2.0})
    assert msg.sampling.audio_top_k == 30 and isinstance(msg.sampling.audio_top_k, int)
    assert msg.channels == 2 and isinstance(msg.channels, int)


def test_start_int_accepted_for_float() -> None:
    msg = both({"type": "start", "audio_temperature": 1})
    assert msg.sampling.audio_temperature == 1.0 and isinstance(msg.sampling.audio_temperature, float)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        # bool is never a number, a number never a string
        ("audio_top_k", True),
        ("audio_temperature", False),
        ("max_new_tokens", True),
        ("seed", True),
        ("channels", True),
        ("text", 5),
        ("instruction", ["a"]),
        ("take", 3),
        ("model", {"a": 1}),
        ("audio_top_k", "25"),
        ("audio_top_k", 2.5),
        ("audio_temperature", "1.0"),
        ("audio_temperature", [1.0]),
        # out of range
        ("audio_temperature", -0.1),
        ("audio_temperature", 10.5),
        ("audio_top_p", 0.0),  # exclusive minimum
        ("audio_top_p", 1.01),
        ("audio_top_k", -1),
        ("audio_top_k", 1025),
        ("audio_repetition_penalty", 0),
        ("text_top_p", 0),
        ("text_top_k", 5000),
        ("max_new_tokens", 0),
        ("max_new_tokens", 4097),
        ("chunk_frames", 0),
        ("chunk_frames", 101),
        ("channels", 0),
        ("channels", 3),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", 2**64 - 1),
        ("seed", 1e30),
        ("tokens", 0),
        # empty / too long
        ("text", ""),
        ("text", "   \n\t"),
        ("text", "x" * 5001),
        ("instruction", "x" * 5001),
        ("take", "x" * 65),
        ("language", "x" * 65),
    ],
)
def test_start_invalid_field(field: str, value: Any) -> None:
    err = invalid({"type": "start", field: value}, field)
    assert field in err.message


def test_start_length_limits_count_characters_not_bytes() -> None:
    assert both({"type": "start", "text": "語" * 4000}).text == "語" * 4000
    assert both({"type": "start", "text": "🎭" * 4000}).text == "🎭" * 4000
    invalid({"type": "start", "text": "語" * 4001}, "text")


def test_start_unicode_text() -> None:
    text = "Ça va? — 你好, мир! 🎭 \u200b"
    assert both({"type": "start", "text": text}).text == text


def test_start_lone_surrogate_is_invalid_field() -> None:
    # Only JSON can carry one (msgpack strings must be valid UTF-8).
    with pytest.raises(ProtocolError) as info:
        decode_client_text('{"type":"start","text":"a\\ud800b"}')
    assert (info.value.code, info.value.field) == (ErrorCode.INVALID_FIELD, "text")
    with pytest.raises(ProtocolError) as info:
        decode_client_text('{"type":"start","take":"\\udfff"}')
    assert info.value.field == "take"
    # A proper surrogate pair is just a character.
    assert decode_client_text('{"type":"start","text":"\\ud83c\\udfad"}').text == "🎭"


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_start_non_finite_json_literals_are_bad_json(value: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_client_text(f'{{"type":"start","audio_temperature":{value}}}')
    assert info.value.code is ErrorCode.BAD_JSON


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_start_non_finite_msgpack_floats_are_invalid(value: float) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_client_binary(as_msgpack({"type": "start", "audio_temperature": value}))
    assert (info.value.code, info.value.field) == (ErrorCode.INVALID_FIELD, "audio_temperature")
    with pytest.raises(ProtocolError) as info:
        decode_client_binary(as_msgpack({"type": "start", "audio_top_k": value}))
    assert (info.value.code, info.value.field) == (ErrorCode.INVALID_FIELD, "audio_top_k")


def test_start_huge_json_numbers() -> None:
    big = "1" + "0" * 400  # a valid JSON integer beyond the float range
    for field in ("audio_temperature", "audio_top_k", "seed"):
        with pytest.raises(ProtocolError) as info:
            decode_client_text(f'{{"type":"start","{field}":{big}}}')
        assert (info.value.code, info.value.field) == (ErrorCode.INVALID_FIELD, field)
        assert len(info.value.message) < 200
    with pytest.raises(ProtocolError) as info:
        decode_client_text('{"type":"start","seed":1e400}')  # parses as inf
    assert info.value.field == "seed"


def test_custom_limits() -> None:
    limits = Limits(max_text_chars=10, max_new_tokens=100, max_chunk_frames=4)
    assert both({"type": "start", "text": "x" * 10}, limits).max_new_tokens == 100
    invalid({"type": "start", "text": "x" * 11}, "text", limits)
    invalid({"type": "start", "max_new_tokens": 101}, "max_new_tokens", limits)
    invalid({"type": "start", "chunk_frames": 5}, "chunk_frames", limits)


# What the original playground's documented request body sends, as a StartTake.
LEGACY = StartTake(
    language="English",
    seed=0,
    sampling=SamplingParams(1.0, 0.95, 25, 1.1, 1.0, 1.0, 50),
    max_new_tokens=3200,
    chunk_frames=18,
)


def test_stream_request_is_start_without_type() -> None:
    assert parse_stream_request({}) == LEGACY
    assert parse_stream_request({"text": "hi", "seed": 3}) == dataclasses.replace(LEGACY, text="hi", seed=3)
    assert parse_stream_request({"type": "whatever", "text": "hi"}).text == "hi"
    with pytest.raises(ProtocolError) as info:
        parse_stream_request({"text": ""})
    assert (info.value.code, info.value.field) == (ErrorCode.INVALID_FIELD, "text")
    with pytest.raises(ProtocolError) as info:
        parse_stream_request([])  # type: ignore[arg-type]
    assert info.value.code is ErrorCode.BAD_MESSAGE


def test_stream_request_fills_only_what_the_client_left_out() -> None:
    sent = {"audio_temperature": 0.0, "audio_top_k": 7, "language": "", "chunk_frames": 4, "max_new_tokens": 9}
    got = parse_stream_request({**sent, "seed": None, "audio_top_p": None})
    assert (got.sampling.audio_temperature, got.sampling.audio_top_k, got.language) == (0.0, 7, "")
    assert (got.chunk_frames, got.max_new_tokens) == (4, 9)
    assert got.seed == 0 and got.sampling.audio_top_p == 0.95  # null means "the default" too
    # The WebSocket start keeps the service defaults (the ones hello shows).
    assert parse_client_message({"type": "start"}) == StartTake()
    # A server with tighter limits caps the legacy values instead of refusing an empty body.
    small = parse_stream_request({}, Limits(max_new_tokens=100, max_chunk_frames=8))
    assert (small.max_new_tokens, small.chunk_frames) == (100, 8)


def test_decode_stream_request_body() -> None:
    assert decode_stream_request(b'{"text":"hi"}').text == "hi"
    assert decode_stream_request(b"") == LEGACY  # an empty body means all defaults
    cases = [
        (b" ", ErrorCode.BAD_JSON),
        (b"{bad", ErrorCode.BAD_JSON),
        (b"\xff", ErrorCode.BAD_JSON),
        (b"[]", ErrorCode.BAD_MESSAGE),
        (b'{"audio_top_k":"x"}', ErrorCode.INVALID_FIELD),
        (b'{"text":"' + b"x" * (256 * 1024) + b'"}', ErrorCode.TOO_LARGE),
    ]
    for body, code in cases:
        with pytest.raises(ProtocolError) as info:
            decode_stream_request(body)
        assert info.value.code is code, body[:20]


# --------------------------------------------------------------------------- cancel / ping


def test_cancel() -> None:
    assert both({"type": "cancel"}) == Cancel()
    assert both({"type": "cancel", "take": "t_1"}) == Cancel(take="t_1")
    assert both({"type": "cancel", "take": None}) == Cancel()
    invalid({"type": "cancel", "take": 1}, "take")
    assert Cancel().to_dict() == {"type": "cancel"}


def test_ping() -> None:
    assert both({"type": "ping"}) == Ping()
    assert both({"type": "ping", "t": 1712345678.25}) == Ping(t=1712345678.25)
    assert both({"type": "ping", "t": 5}).t == 5.0
    invalid({"type": "ping", "t": "now"}, "t")
    invalid({"type": "ping", "t": True}, "t")
    assert Ping(t=2.5).to_dict() == {"type": "ping", "t": 2.5}


# --------------------------------------------------------------------------- seek


def test_seek_by_frame_defaults_to_retake() -> None:
    msg = both({"type": "seek", "take": "t_a", "frame": 25})
    assert msg == Seek(take="t_a", frame=25)
    assert msg.mode == "retake" and msg.sampling == {} and msg.seed is None
    assert msg.instruction is None and msg.text is None
    assert msg.to_dict() == {"type": "seek", "take": "t_a", "frame": 25, "mode": "retake"}


@pytest.mark.parametrize(
    ("time_sec", "frame"),
    [(0, 0), (0.0, 0), (0.079, 0), (0.08, 1), (1.0, 12), (2.0, 25), (2.32, 29), (4.64, 58), (9.28, 116)],
)
def test_seek_time_sec_gives_the_frame_containing_that_instant(time_sec: float, frame: int) -> None:
    assert both({"type": "seek", "take": "t", "time_sec": time_sec}).frame == frame


def test_frame_at_time_is_exact_on_frame_boundaries() -> None:
    for n in range(4097):
        assert frame_at_time(n * 0.08) == n
        assert frame_at_time(n * FRAME_SAMPLES / SAMPLE_RATE) == n
    assert frame_at_time(0.08 - 1 / SAMPLE_RATE) == 0
    assert frame_at_time(0.08 - 0.4 / SAMPLE_RATE) == 1  # snapped to the nearest sample first


def test_seek_time_sec_upper_bound() -> None:
    assert both({"type": "seek", "take": "t", "time_sec": 4096 / 12.5}).frame == 4096
    invalid({"type": "seek", "take": "t", "time_sec": 4096 / 12.5 + 0.01}, "time_sec")
    invalid({"type": "seek", "take": "t", "time_sec": -0.01}, "time_sec")


def test_seek_needs_exactly_one_position() -> None:
    invalid({"type": "seek", "take": "t"}, "frame")
    invalid({"type": "seek", "take": "t", "frame": None, "time_sec": None}, "frame")
    invalid({"type": "seek", "take": "t", "frame": 1, "time_sec": 0.08}, "frame")


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"frame": 1, "take": None}, "take"),
        ({"frame": 1}, "take"),  # take missing (popped below)
        ({"frame": -1}, "frame"),
        ({"frame": 4097}, "frame"),
        ({"frame": 1.5}, "frame"),
        ({"frame": True}, "frame"),
        ({"frame": "3"}, "frame"),
        ({"time_sec": "1"}, "time_sec"),
        ({"time_sec": False}, "time_sec"),
        ({"frame": 1, "mode": "rewind"}, "mode"),
        ({"frame": 1, "mode": "x" * 10000}, "mode"),
        ({"frame": 1, "seed": -5}, "seed"),
        ({"frame": 1, "audio_top_p": 0}, "audio_top_p"),
        ({"frame": 1, "audio_top_k": True}, "audio_top_k"),
        ({"frame": 1, "text": " "}, "text"),
        ({"frame": 1, "text": 1}, "text"),
        ({"frame": 1, "instruction": "x" * 5001}, "instruction"),
    ],
)
def test_seek_invalid(extra: dict[str, Any], field: str) -> None:
    obj = {"type": "seek", "take": "t_a", **extra}
    if extra.get("take", 0) is None:
        obj["take"] = None
    elif "take" not in extra and field == "take":
        del obj["take"]
    err = invalid(obj, field)
    assert len(err.message) < 200  # error messages never echo huge input


def test_seek_retake_overrides() -> None:
    msg = both(
        {
            "type": "seek",
            "take": "t_a",
            "frame": 10,
            "seed": 7,
            "audio_temperature": 1.2,
            "text_top_k": 10,
            "audio_top_p": None,  # null = not overridden
            "instruction": "angrier",
            "text": "No. Never.",
        }
    )
    assert msg == Seek(
        take="t_a",
        frame=10,
        seed=7,
        sampling={"audio_temperature": 1.2, "text_top_k": 10},
        instruction="angrier",
        text="No. Never.",
    )
    assert SamplingParams().replace(**msg.sampling).audio_temperature == 1.2


def test_seek_replay() -> None:
    msg = both({"type": "seek", "take": "t_a", "time_sec": 1.0, "mode": "replay"})
    assert msg == Seek(take="t_a", frame=12, mode="replay")


@pytest.mark.parametrize(
    "override", [{"seed": 1}, {"audio_top_k": 5}, {"instruction": "x"}, {"text": "y"}, {"text_temperature": 0.5}]
)
def test_seek_replay_rejects_generation_overrides(override: dict[str, Any]) -> None:
    (field,) = override
    err = invalid({"type": "seek", "take": "t", "frame": 0, "mode": "replay", **override}, field)
    assert "replay" in err.message


# --------------------------------------------------------------------------- envelope errors


@pytest.mark.parametrize("text", ["", "{", "{'type':'ping'}", '{"type":"ping",}', "NaN", "\x00", "[" * 30000])
def test_bad_json(text: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_client_text(text)
    assert info.value.code is ErrorCode.BAD_JSON
    assert not info.value.fatal


@pytest.mark.parametrize("obj", [[], [{"type": "ping"}], "ping", 3, None, True, {}, {"type": None}, {"type": 1}])
def test_bad_message(obj: Any) -> None:
    err = error_of(obj)
    assert err.code is ErrorCode.BAD_MESSAGE


def test_bad_message_names_the_type_field() -> None:
    assert error_of({"t": 1}).field == "type"
    assert error_of({"type": ["start"]}).field == "type"


@pytest.mark.parametrize("kind", ["hello", "pong", "end", "START", "", "x" * 1000])
def test_unknown_type(kind: str) -> None:
    err = error_of({"type": kind})
    assert err.code is ErrorCode.UNKNOWN_TYPE and err.field == "type"
    assert len(err.message) < 200


def test_parse_client_message_rejects_non_dicts() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_client_message(["type", "ping"])  # type: ignore[arg-type]
    assert info.value.code is ErrorCode.BAD_MESSAGE


def test_too_large_text() -> None:
    limits = Limits(max_message_bytes=100)
    ok = json.dumps({"type": "ping", "pad": "x" * (100 - 27)})
    assert len(ok) == 100
    assert decode_client_text(ok, limits) == Ping()
    for data in (ok[:-2] + 'x"}', "x" * 101, "[" * 10**6):
        with pytest.raises(ProtocolError) as info:
            decode_client_text(data, limits)
        assert info.value.code is ErrorCode.TOO_LARGE
    # The limit is in UTF-8 bytes, not characters.
    wide = json.dumps({"type": "ping", "p": "é" * 40}, ensure_ascii=False)
    assert len(wide) < 100 < len(wide.encode())
    with pytest.raises(ProtocolError) as info:
        decode_client_text(wide, limits)
    assert info.value.code is ErrorCode.TOO_LARGE


def test_too_large_binary() -> None:
    limits = Limits(max_message_bytes=64)
    small = as_msgpack({"type": "ping"})
    assert decode_client_binary(small, limits) == Ping()
    big = as_msgpack({"type": "ping", "pad": b"x" * 64})
    with pytest.raises(ProtocolError) as info:
        decode_client_binary(big, limits)
    assert info.value.code is ErrorCode.TOO_LARGE


def test_default_message_limit_is_64_kib() -> None:
    body = {"type": "start", "text": "x" * 10, "pad": "y" * (64 * 1024)}
    assert error_of(body).code is ErrorCode.TOO_LARGE


def test_text_message_may_be_bytes() -> None:
    assert decode_client_text(b'{"type":"ping"}') == Ping()
    with pytest.raises(ProtocolError) as info:
        decode_client_text(b'{"type":"ping","x":"\xff"}')
    assert info.value.code is ErrorCode.BAD_JSON


# --------------------------------------------------------------------------- msgpack specifics


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never-used byte
        b"\x81",  # map header without content
        as_msgpack({"type": "ping"}) + b"\x00",  # trailing data
        as_msgpack({1: "ping"}),  # non-string key
        as_msgpack({(1, 2): 1}),  # array key
        as_msgpack({None: 1}),
        b"\xdf\xff\xff\xff\xff",  # map claiming 4 billion entries
        b"\x91" * 60000,  # nested too deeply
        b"\x81\xa4type\xa5p\xffng",  # invalid UTF-8 in a string
    ],
)
def test_bad_msgpack_is_bad_json(data: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_client_binary(data)
    assert info.value.code is ErrorCode.BAD_JSON


def test_msgpack_bytes_keys_and_values() -> None:
    # A bytes "type" key is not the string "type".
    with pytest.raises(ProtocolError) as info:
        decode_client_binary(as_msgpack({b"type": "ping"}))
    assert info.value.code is ErrorCode.BAD_MESSAGE
    with pytest.raises(ProtocolError) as info:
        decode_client_binary(as_msgpack({"type": b"ping"}))
    assert info.value.code is ErrorCode.BAD_MESSAGE
    with pytest.raises(ProtocolError) as info:
        decode_client_binary(as_msgpack({"type": "start", "text": b"hello"}))
    assert (info.value.code, info.value.field) == (ErrorCode.INVALID_FIELD, "text")


def test_msgpack_ext_types_and_huge_ints() -> None:
    ext = msgpack.ExtType(5, b"\x00\x01")
    for field, value in (("text", ext), ("audio_top_k", ext), ("seed", 2**64 - 1), ("audio_top_k", -(2**63))):
        with pytest.raises(ProtocolError) as info:
            decode_client_binary(as_msgpack({"type": "start", field: value}))
        assert (info.value.code, info.value.field) == (ErrorCode.INVALID_FIELD, field)
    # Unknown keys may hold anything msgpack can carry.
    stamp = msgpack.Timestamp(1, 2)
    assert decode_client_binary(as_msgpack({"type": "ping", "x": ext, "y": stamp, "z": 2**64 - 1})) == Ping()
    # A float32 value works like a float64.
    assert decode_client_binary(msgpack.packb({"type": "ping", "t": 0.5}, use_single_float=True)) == Ping(t=0.5)


# --------------------------------------------------------------------------- encode_message


@pytest.mark.parametrize(
    "msg",
    [
        StartTake(),
        StartTake(text="hé 語", seed=5, take="a", channels=2, sampling=SamplingParams(audio_top_k=3)),
        Cancel(),
        Cancel(take="t_1"),
        Seek(take="t_1", frame=3),
        Seek(take="t_1", frame=3, seed=9, sampling={"audio_top_p": 0.5}, instruction="i", text="t"),
        Seek(take="t_1", frame=0, mode="replay"),
        Ping(),
        Ping(t=1.25),
    ],
)
def test_encode_message_round_trip(msg: Any) -> None:
    text = encode_message(msg, "json")
    assert isinstance(text, str) and decode_client_text(text) == msg
    data = encode_message(msg, "msgpack")
    assert isinstance(data, bytes) and decode_client_binary(data) == msg


def test_encode_message_unknown_format() -> None:
    with pytest.raises(ValueError):
        encode_message(Ping(), "xml")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- server messages


def test_hello() -> None:
    limits = Limits()
    msg = hello(models=["v2-best", "tiny"], default_model="v2-best", demo=True, limits=limits, server="x")
    d = msg.to_dict()
    assert d == {
        "type": "hello",
        "protocol": 1,
        "sr": 48000,
        "frame_samples": 3840,
        "models": ["v2-best", "tiny"],
        "default_model": "v2-best",
        "demo": True,
        "limits": limits.to_dict(),
        "server": "x",
    }
    assert d["limits"]["max_message_bytes"] == 65536
    assert parse_server_message(Frame(0, encode_json_frame(d)[5:]).json()) == msg


def test_error_message() -> None:
    err = ProtocolError(ErrorCode.INVALID_FIELD, "bad", field="frame")
    assert error_message(err).to_dict() == {
        "type": "error",
        "code": "invalid_field",
        "message": "bad",
        "field": "frame",
        "fatal": False,
    }
    fatal = ProtocolError(ErrorCode.TOO_LARGE, "big", fatal=True)
    assert error_message(fatal, take="t_1").to_dict() == {
        "type": "error",
        "code": "too_large",
        "message": "big",
        "fatal": True,
        "take": "t_1",
    }


def test_http_error_body() -> None:
    err = ProtocolError(ErrorCode.BAD_JSON, "invalid JSON")
    assert http_error_body(err) == {"error": {"code": "bad_json", "message": "invalid JSON"}}


def test_seek_ack_sample_is_frame_times_3840() -> None:
    ack = seek_ack(take="t_new", from_take="t_old", frame=25)
    assert ack.to_dict() == {"type": "seek", "take": "t_new", "from_take": "t_old", "frame": 25, "sample": 96000}
    assert ack["sample"] == 25 * FRAME_SAMPLES and ack.get("missing", 1) == 1


def test_pong() -> None:
    assert pong(t=1.5, server_t=100.0).to_dict() == {"type": "pong", "t": 1.5, "server_t": 100.0}


def test_parse_server_messages() -> None:
    cases = [
        {"type": "start", "sr": 48000, "gpu_first_ms": 12.5},  # the legacy minimum
        {"type": "start", "take": "t_1", "sr": 48000, "channels": 1, "gpu_first_ms": 1, "seed": 3, "model": "m"},
        {"type": "end", "gpu_total_ms": 1.0, "n_frames": 10, "duration_sec": 0.8},
        {"type": "end", "take": "t", "reason": "cancelled", "n_frames": 0, "duration_sec": 0, "rtf": None},
        {"type": "seek", "take": "b", "from_take": "a", "frame": 2, "sample": 7680},
        {"type": "error", "code": "internal", "message": "m", "fatal": False},
        {"type": "pong", "t": None, "server_t": 1.0},
        {"type": "hello", "protocol": 1, "sr": 48000, "frame_samples": 3840, "new": 1},
    ]
    for obj in cases:
        msg = parse_server_message(obj)
        assert isinstance(msg, ServerMessage) and msg.to_dict() == obj


@pytest.mark.parametrize(
    ("obj", "code"),
    [
        ({"type": "start"}, ErrorCode.BAD_MESSAGE),  # no sr
        ({"type": "end", "n_frames": 1}, ErrorCode.BAD_MESSAGE),
        ({"type": "error", "code": "x"}, ErrorCode.BAD_MESSAGE),
        ({"type": "ping"}, ErrorCode.UNKNOWN_TYPE),
        ({"type": ["start"]}, ErrorCode.UNKNOWN_TYPE),
        ({"type": {"a": 1}}, ErrorCode.UNKNOWN_TYPE),
        ({}, ErrorCode.UNKNOWN_TYPE),
        ([], ErrorCode.BAD_MESSAGE),
    ],
)
def test_parse_server_message_errors(obj: Any, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_server_message(obj)
    assert info.value.code is code
