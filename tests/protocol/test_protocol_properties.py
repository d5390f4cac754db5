"""Property tests (hypothesis) for the wire protocol: round trips, arbitrary splits, garbage input.

The garbage properties hold the package's central promise: whatever bytes, JSON or msgpack a peer
sends, the decoders either return a value or raise ProtocolError (with a stable code and a message
that can itself be sent back as a frame); never anything else.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moss_rt.protocol import (
    FRAME_SAMPLES,
    SAMPLE_RATE,
    SEEK_MODES,
    TAG_AUDIO,
    TAG_JSON,
    TAG_PCM,
    Cancel,
    ErrorCode,
    Frame,
    FrameReader,
    Limits,
    Ping,
    ProtocolError,
    SamplingParams,
    Seek,
    StartTake,
    decode_client_binary,
    decode_client_text,
    decode_frame,
    decode_stream_request,
    encode_frame,
    encode_json_frame,
    encode_message,
    error_message,
    frame_at_time,
    parse_server_message,
)
from moss_rt.protocol.messages import SAMPLING_FIELDS

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FASTER = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])

LIMITS = Limits()
SMALL_LIMITS = Limits(max_message_bytes=512, max_text_chars=40, max_new_tokens=200, max_chunk_frames=10)


def only_protocol_errors(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call fn; a ProtocolError is a valid outcome, any other exception fails the test."""
    try:
        return fn(*args, **kwargs)
    except ProtocolError as err:
        assert isinstance(err.code, ErrorCode)
        assert err.message and len(err.message) < 400
        # The server echoes errors back: that must always be encodable.
        frame = encode_json_frame(error_message(err).to_dict())
        assert decode_frame(frame).json()["code"] == err.code.value
        return err


def accepted_is_encodable(msg: Any) -> None:
    """A message the decoder accepted can be re-encoded both ways (it holds only wire-safe values)."""
    if isinstance(msg, ProtocolError):
        return
    encode_json_frame(msg.to_dict())
    encode_message(msg, "msgpack")


# --------------------------------------------------------------------------- strategies

frames_st = st.builds(Frame, st.sampled_from([TAG_JSON, TAG_PCM, TAG_AUDIO]), st.binary(max_size=300))

# Every field name any client message knows, so garbage often hits the validators.
FIELD_NAMES = sorted(
    {
        "type",
        "text",
        "instruction",
        "language",
        "reference",
        "seed",
        "max_new_tokens",
        "chunk_frames",
        "model",
        "tokens",
        "take",
        "channels",
        "frame",
        "time_sec",
        "mode",
        "t",
        *SAMPLING_FIELDS,
    }
)
TYPE_VALUES = ["start", "cancel", "seek", "ping", "pong", "hello", "end", "error", ""]

# Text holding a lone surrogate: JSON escapes can carry one, UTF-8 cannot. (Built by hand:
# hypothesis merges a union of character strategies and drops surrogates again.)
surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=())
surrogate_text = st.builds(lambda a, c, b: a + c + b, st.text(max_size=3), surrogates, st.text(max_size=3))
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**300, max_value=10**320)  # beyond the float range
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | surrogate_text
    | st.sampled_from(["retake", "replay", "t_1", " ", "\ud800"])
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# Values aimed at one field of an otherwise valid message: the nasty cases get a fair share.
field_garbage = (
    surrogate_text
    | st.sampled_from([True, False, None, float("nan"), float("inf"), 2**63, -1, 10**400, "", " ", [], {}])
    | json_values
)
message_like = st.fixed_dictionaries(
    {},
    optional={"type": st.sampled_from(TYPE_VALUES) | json_values},
).flatmap(
    lambda base: st.dictionaries(st.sampled_from(FIELD_NAMES), json_values, max_size=6).map(
        lambda extra: {**extra, **base}
    )
)

mp_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=20)
    | st.binary(max_size=10)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=6))
    | st.sampled_from(["retake", "replay", "t_1", " "])
)
mp_keys = st.sampled_from(FIELD_NAMES) | st.text(max_size=6) | st.binary(max_size=4) | st.integers(-5, 5)
mp_values = st.recursive(
    mp_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(mp_keys, inner, max_size=4),
    max_leaves=12,
)
mp_message_like = st.fixed_dictionaries({}, optional={"type": st.sampled_from(TYPE_VALUES) | mp_values}).flatmap(
    lambda base: st.dictionaries(mp_keys, mp_values, max_size=6).map(lambda extra: {**extra, **base})
)

# Valid client messages.
label = st.none() | st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=64)
prose = st.text(alphabet=st.characters(exclude_categories=["Cs"]), min_size=1, max_size=60).filter(str.strip)
seeds = st.none() | st.integers(0, 2**63 - 1)


def bounded(spec: Any) -> st.SearchStrategy[Any]:
    if spec.kind == "int":
        return st.integers(int(spec.minimum), int(spec.maximum))
    return st.floats(spec.minimum, spec.maximum, exclude_min=spec.exclusive_minimum, allow_nan=False)


sampling_params = st.builds(SamplingParams, **{k: bounded(v) for k, v in SAMPLING_FIELDS.items()})
sampling_overrides = st.fixed_dictionaries({}, optional={k: bounded(v) for k, v in SAMPLING_FIELDS.items()})

starts = st.builds(
    StartTake,
    text=prose,
    instruction=st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=60),
    language=st.sampled_from(["", "en", "zh", "de"]),
    reference=st.sampled_from(["none", "ref_1", "narrator"]),
    seed=seeds,
    sampling=sampling_params,
    max_new_tokens=st.integers(1, LIMITS.max_new_tokens),
    chunk_frames=st.integers(LIMITS.min_chunk_frames, LIMITS.max_chunk_frames),
    model=st.sampled_from(["v2-best", "tiny"]),
    tokens=st.none() | st.integers(1, LIMITS.max_new_tokens),
    take=label,
    channels=st.sampled_from([1, 2]),
)
retakes = st.builds(
    Seek,
    take=st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=64),
    frame=st.integers(0, LIMITS.max_new_tokens),
    mode=st.just("retake"),
    seed=seeds,
    sampling=sampling_overrides,
    instruction=st.none() | st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=60),
    text=st.none() | prose,
)
replays = st.builds(
    Seek,
    take=st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=64),
    frame=st.integers(0, LIMITS.max_new_tokens),
    mode=st.just("replay"),
)
client_messages = (
    starts
    | retakes
    | replays
    | st.builds(Cancel, take=label)
    | st.builds(Ping, t=st.none() | st.floats(allow_nan=False, allow_infinity=False))
)


# --------------------------------------------------------------------------- frames


@FAST
@given(frames_st)
def test_frame_round_trip(frame: Frame) -> None:
    data = encode_frame(frame.tag, frame.payload)
    assert len(data) == 5 + len(frame.payload)
    assert decode_frame(data) == frame
    assert FrameReader().feed(data) == [frame]


@FAST
@given(st.lists(frames_st, max_size=12), st.data())
def test_stream_split_anywhere_parses_to_the_same_frames(frames: list[Frame], data: st.DataObject) -> None:
    stream = b"".join(f.encode() for f in frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    reader = FrameReader()
    out: list[Frame] = []
    prev = 0
    for cut in [*cuts, len(stream)]:
        out += reader.feed(stream[prev:cut])
        prev = cut
    assert out == frames
    assert reader.buffered == 0
    reader.close()


@FAST
@given(st.lists(frames_st, min_size=1, max_size=6), st.data())
def test_truncated_stream_is_reported_at_close(frames: list[Frame], data: st.DataObject) -> None:
    stream = b"".join(f.encode() for f in frames)
    end = data.draw(st.integers(0, len(stream) - 1))
    reader = FrameReader()
    got = reader.feed(stream[:end])
    assert got == frames[: len(got)]
    if reader.buffered:
        err = only_protocol_errors(reader.close)
        assert err.code is ErrorCode.BAD_MESSAGE
    else:
        reader.close()


@FAST
@given(st.lists(st.binary(max_size=64), max_size=10), st.integers(0, 200))
def test_garbage_bytes_into_frame_reader(chunks: list[bytes], limit: int) -> None:
    reader = FrameReader(max_frame_bytes=limit)
    failed = False
    for chunk in chunks:
        result = only_protocol_errors(reader.feed, chunk)
        if isinstance(result, ProtocolError):
            assert result.fatal
            failed = True
        else:
            assert all(f.tag in (TAG_JSON, TAG_PCM, TAG_AUDIO) and len(f.payload) <= limit for f in result)
        if failed:
            assert isinstance(only_protocol_errors(reader.feed, b""), ProtocolError)
    only_protocol_errors(reader.close)


@FAST
@given(st.binary(max_size=300))
def test_garbage_bytes_into_decode_frame(data: bytes) -> None:
    result = only_protocol_errors(decode_frame, data, max_frame_bytes=256)
    if isinstance(result, Frame):
        assert result.encode() == data
        only_protocol_errors(result.json)


@FAST
@given(st.binary(max_size=200))
def test_garbage_json_payloads(payload: bytes) -> None:
    only_protocol_errors(Frame(TAG_JSON, payload).json)


@FAST
@given(json_values | message_like)
def test_garbage_server_objects(obj: Any) -> None:
    only_protocol_errors(parse_server_message, obj)


# --------------------------------------------------------------------------- client messages: garbage


@FAST
@given(st.text(max_size=200))
def test_garbage_text_messages(text: str) -> None:
    accepted_is_encodable(only_protocol_errors(decode_client_text, text, LIMITS))
    accepted_is_encodable(only_protocol_errors(decode_client_text, text, SMALL_LIMITS))


@FAST
@given(st.binary(max_size=200))
def test_garbage_binary_messages(data: bytes) -> None:
    accepted_is_encodable(only_protocol_errors(decode_client_binary, data, LIMITS))
    accepted_is_encodable(only_protocol_errors(decode_client_text, data, LIMITS))
    accepted_is_encodable(only_protocol_errors(decode_stream_request, data, LIMITS))


@FAST
@given(json_values | message_like)
def test_garbage_json_messages(obj: Any) -> None:
    text = json.dumps(obj)  # may contain NaN / Infinity / lone-surrogate escapes on purpose
    for limits in (LIMITS, SMALL_LIMITS):
        accepted_is_encodable(only_protocol_errors(decode_client_text, text, limits))
        accepted_is_encodable(
            only_protocol_errors(decode_stream_request, text.encode("utf-8", "surrogatepass"), limits)
        )


@FAST
@given(mp_values | mp_message_like)
def test_garbage_msgpack_messages(obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    for limits in (LIMITS, SMALL_LIMITS):
        accepted_is_encodable(only_protocol_errors(decode_client_binary, data, limits))


@FASTER
@given(message_like, st.data())
def test_garbage_json_messages_cut_or_corrupted(obj: dict[str, Any], data: st.DataObject) -> None:
    raw = bytearray(json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if raw:
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    accepted_is_encodable(only_protocol_errors(decode_client_text, bytes(raw), LIMITS))


@FASTER
@given(mp_message_like, st.data())
def test_garbage_msgpack_messages_cut_or_corrupted(obj: dict[Any, Any], data: st.DataObject) -> None:
    raw = bytearray(msgpack.packb(obj, use_bin_type=True))
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] = data.draw(st.integers(0, 255))
    raw = raw[: data.draw(st.integers(0, len(raw)))]
    accepted_is_encodable(only_protocol_errors(decode_client_binary, bytes(raw), LIMITS))


def garble_one_field(msg: Any, data: st.DataObject, values: st.SearchStrategy[Any]) -> dict[str, Any]:
    """msg as a dict with one field (usually one it has, sometimes any known one) set to garbage."""
    obj = msg.to_dict()
    field = data.draw(st.sampled_from(sorted(obj)) | st.sampled_from(FIELD_NAMES), label="field")
    return {**obj, field: data.draw(values, label="value")}


@FAST
@given(client_messages, st.data())
def test_valid_json_message_with_one_field_garbled(msg: Any, data: st.DataObject) -> None:
    text = json.dumps(garble_one_field(msg, data, field_garbage))
    accepted_is_encodable(only_protocol_errors(decode_client_text, text, LIMITS))
    accepted_is_encodable(only_protocol_errors(decode_client_text, text, SMALL_LIMITS))


@FAST
@given(client_messages, st.data())
def test_valid_msgpack_message_with_one_field_garbled(msg: Any, data: st.DataObject) -> None:
    raw = msgpack.packb(garble_one_field(msg, data, mp_values), use_bin_type=True)
    accepted_is_encodable(only_protocol_errors(decode_client_binary, raw, LIMITS))
    accepted_is_encodable(only_protocol_errors(decode_client_binary, raw, SMALL_LIMITS))


# --------------------------------------------------------------------------- client messages: round trips


@FAST
@given(client_messages)
def test_json_round_trip(msg: Any) -> None:
    text = encode_message(msg, "json")
    assert decode_client_text(text, LIMITS) == msg


@FAST
@given(client_messages)
def test_msgpack_round_trip(msg: Any) -> None:
    data = encode_message(msg, "msgpack")
    assert decode_client_binary(data, LIMITS) == msg


@FAST
@given(client_messages)
def test_json_and_msgpack_agree(msg: Any) -> None:
    obj = msg.to_dict()
    assert decode_client_text(json.dumps(obj), LIMITS) == decode_client_binary(
        msgpack.packb(obj, use_bin_type=True), LIMITS
    )


@FAST
@given(st.integers(0, LIMITS.max_new_tokens), st.integers(0, FRAME_SAMPLES - 1), st.sampled_from(SEEK_MODES))
def test_seek_time_sec_lands_in_the_containing_frame(frame: int, offset: int, mode: str) -> None:
    sample = frame * FRAME_SAMPLES + offset
    time_sec = sample / SAMPLE_RATE
    assert frame_at_time(time_sec) == frame
    if time_sec <= LIMITS.max_new_tokens / 12.5:
        msg = decode_client_text(json.dumps({"type": "seek", "take": "t", "time_sec": time_sec, "mode": mode}))
        assert msg.frame == frame
