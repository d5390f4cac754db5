"""Frame codec and incremental reader: example-based tests (pure, no I/O)."""

from __future__ import annotations

import json

import pytest

from moss_rt.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    HEADER_SIZE,
    TAG_AUDIO,
    TAG_JSON,
    TAG_PCM,
    ErrorCode,
    Frame,
    FrameReader,
    ProtocolError,
    decode_frame,
    decode_json_object,
    dumps_json,
    encode_audio_frame,
    encode_frame,
    encode_json_frame,
    encode_pcm_frame,
)


def code_of(fn, *args, **kwargs) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        fn(*args, **kwargs)
    return info.value


# --------------------------------------------------------------------------- layout


def test_header_is_tag_then_u32_big_endian_length() -> None:
    assert HEADER_SIZE == 5
    frame = encode_pcm_frame(b"\x01\x00\xff\x7f")  # samples 1 and 32767, little-endian
    assert frame.hex(" ") == "01 00 00 00 04 01 00 ff 7f"
    assert encode_frame(TAG_PCM, b"x" * 0x010203)[:5] == b"\x01\x00\x01\x02\x03"


def test_json_frame_hex_example() -> None:
    frame = encode_json_frame({"type": "end"})
    assert frame.hex(" ") == "00 00 00 00 0e 7b 22 74 79 70 65 22 3a 22 65 6e 64 22 7d"
    assert frame[5:] == b'{"type":"end"}'


def test_json_frame_is_compact_utf8() -> None:
    frame = encode_json_frame({"type": "start", "sr": 48000, "note": "héllo 語"})
    payload = frame[5:]
    assert payload == '{"type":"start","sr":48000,"note":"héllo 語"}'.encode()
    assert int.from_bytes(frame[1:5], "big") == len(payload)


def test_empty_payload_frame() -> None:
    assert encode_pcm_frame(b"") == b"\x01\x00\x00\x00\x00"
    assert decode_frame(b"\x01\x00\x00\x00\x00") == Frame(TAG_PCM, b"")


def test_encoded_audio_frame() -> None:
    assert encode_audio_frame(b"ID3") == b"\x02\x00\x00\x00\x03ID3"
    assert decode_frame(b"\x02\x00\x00\x00\x03ID3") == Frame(TAG_AUDIO, b"ID3")


@pytest.mark.parametrize("tag", [3, 255, -1, True, "0"])
def test_encode_rejects_unknown_tags(tag: object) -> None:
    with pytest.raises(ValueError):
        encode_frame(tag, b"")  # type: ignore[arg-type]


def test_frame_encode_method_round_trips() -> None:
    frame = Frame(TAG_JSON, b'{"type":"pong"}')
    assert decode_frame(frame.encode()) == frame


# --------------------------------------------------------------------------- JSON out


def test_non_finite_floats_become_null() -> None:
    text = dumps_json({"type": "end", "rtf": float("nan"), "xs": [float("inf"), 1.5, {"y": float("-inf")}]})
    assert json.loads(text) == {"type": "end", "rtf": None, "xs": [None, 1.5, {"y": None}]}
    assert "NaN" not in text and "Infinity" not in text


def test_lone_surrogate_is_escaped_not_crashing() -> None:
    frame = encode_json_frame({"type": "error", "message": "bad \ud800 é"})
    assert Frame(TAG_JSON, frame[5:]).json()["message"] == "bad \ud800 é"
    frame[5:].decode("utf-8")  # still valid UTF-8 on the wire


# --------------------------------------------------------------------------- decode_frame


def test_decode_frame_exact() -> None:
    assert decode_frame(encode_json_frame({"type": "x"})) == Frame(TAG_JSON, b'{"type":"x"}')
    assert decode_frame(bytearray(encode_pcm_frame(b"ab"))) == Frame(TAG_PCM, b"ab")
    assert decode_frame(memoryview(encode_pcm_frame(b"ab"))) == Frame(TAG_PCM, b"ab")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x01\x00\x00",
        b"\x01\x00\x00\x00\x03ab",  # truncated payload
        b"\x01\x00\x00\x00\x01ab",  # trailing byte
        encode_pcm_frame(b"ab") + encode_pcm_frame(b"cd"),  # two frames
        b"\x03\x00\x00\x00\x00",  # unknown tag
    ],
)
def test_decode_frame_rejects_anything_but_one_whole_frame(data: bytes) -> None:
    assert code_of(decode_frame, data).code is ErrorCode.BAD_MESSAGE


def test_decode_frame_too_large() -> None:
    assert code_of(decode_frame, encode_pcm_frame(b"x" * 11), max_frame_bytes=10).code is ErrorCode.TOO_LARGE
    assert decode_frame(encode_pcm_frame(b"x" * 10), max_frame_bytes=10).payload == b"x" * 10
    # A header claiming a huge length is refused before anything is read.
    assert code_of(decode_frame, b"\x01\xff\xff\xff\xff").code is ErrorCode.TOO_LARGE


# --------------------------------------------------------------------------- FrameReader


def test_reader_one_byte_at_a_time() -> None:
    stream = encode_json_frame({"type": "start", "sr": 48000}) + encode_pcm_frame(b"\x00\x01" * 7)
    reader = FrameReader()
    out: list[Frame] = []
    for i in range(len(stream)):
        out += reader.feed(stream[i : i + 1])
    assert out == [Frame(TAG_JSON, b'{"type":"start","sr":48000}'), Frame(TAG_PCM, b"\x00\x01" * 7)]
    assert reader.buffered == 0
    reader.close()


def test_reader_feed_is_eager() -> None:
    """Bytes are consumed even if the caller ignores the result (no lazy generator)."""
    reader = FrameReader()
    reader.feed(encode_pcm_frame(b"ab")[:3])
    assert reader.buffered == 3
    reader.feed(encode_pcm_frame(b"ab")[3:])  # completes a frame that nobody looks at
    assert reader.buffered == 0
    frames = reader.feed(encode_pcm_frame(b"cd") + encode_pcm_frame(b"ef"))
    assert isinstance(frames, list)
    assert [f.payload for f in frames] == [b"cd", b"ef"]


def test_reader_many_frames_in_one_chunk_keep_order() -> None:
    payloads = [bytes([i]) * i for i in range(50)]
    stream = b"".join(encode_pcm_frame(p) for p in payloads)
    assert [f.payload for f in FrameReader().feed(stream)] == payloads


def test_reader_accepts_bytearray_and_memoryview() -> None:
    reader = FrameReader()
    assert reader.feed(bytearray(encode_pcm_frame(b"a"))) == [Frame(TAG_PCM, b"a")]
    assert reader.feed(memoryview(encode_pcm_frame(b"b"))) == [Frame(TAG_PCM, b"b")]


def test_reader_close_inside_frame_is_bad_message() -> None:
    reader = FrameReader()
    reader.feed(encode_pcm_frame(b"abcdef")[:-1])
    err = code_of(reader.close)
    assert err.code is ErrorCode.BAD_MESSAGE and "inside a frame" in err.message


def test_reader_unknown_tag_fails_on_first_byte() -> None:
    reader = FrameReader()
    err = code_of(reader.feed, b"\x09")
    assert err.code is ErrorCode.BAD_MESSAGE and err.fatal
    assert reader.failed is err
    # The stream's framing is lost for good.
    assert code_of(reader.feed, encode_pcm_frame(b"ok")) is err
    assert code_of(reader.close) is err


def test_reader_delivers_frames_before_corruption_then_fails() -> None:
    reader = FrameReader()
    frames = reader.feed(encode_pcm_frame(b"good") + b"\x07garbage")
    assert frames == [Frame(TAG_PCM, b"good")]
    assert reader.failed is not None and reader.failed.code is ErrorCode.BAD_MESSAGE
    assert code_of(reader.feed, b"").code is ErrorCode.BAD_MESSAGE


def test_reader_too_large_is_fatal() -> None:
    reader = FrameReader(max_frame_bytes=16)
    assert reader.feed(encode_pcm_frame(b"x" * 16)) == [Frame(TAG_PCM, b"x" * 16)]
    err = code_of(reader.feed, b"\x01\x00\x00\x00\x11")
    assert err.code is ErrorCode.TOO_LARGE and err.fatal


def test_reader_default_limit() -> None:
    reader = FrameReader()
    header = b"\x01" + (DEFAULT_MAX_FRAME_BYTES + 1).to_bytes(4, "big")
    assert code_of(reader.feed, header).code is ErrorCode.TOO_LARGE


def test_reader_rejects_bad_limit() -> None:
    with pytest.raises(ValueError):
        FrameReader(max_frame_bytes=-1)


# --------------------------------------------------------------------------- tag-0 payloads


def test_frame_json_of_pcm_is_bad_message() -> None:
    assert code_of(Frame(TAG_PCM, b"{}").json).code is ErrorCode.BAD_MESSAGE


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"{", ErrorCode.BAD_JSON),
        (b"", ErrorCode.BAD_JSON),
        (b"\xff\xfe{}", ErrorCode.BAD_JSON),  # not UTF-8
        ('{"a":1}'.encode("utf-16-le"), ErrorCode.BAD_JSON),  # JSON, but not UTF-8
        (b'{"a":NaN}', ErrorCode.BAD_JSON),
        (b'{"a":Infinity}', ErrorCode.BAD_JSON),
        (b'{"a":-Infinity}', ErrorCode.BAD_JSON),
        (b"1" * 5000, ErrorCode.BAD_JSON),  # past Python's int digit limit
        (b"[" * 50000 + b"]" * 50000, ErrorCode.BAD_JSON),  # nested too deeply
        (b"[1,2]", ErrorCode.BAD_MESSAGE),
        (b'"text"', ErrorCode.BAD_MESSAGE),
        (b"null", ErrorCode.BAD_MESSAGE),
        (b"12", ErrorCode.BAD_MESSAGE),
    ],
)
def test_frame_json_errors(payload: bytes, code: ErrorCode) -> None:
    assert code_of(Frame(TAG_JSON, payload).json).code is code


def test_decode_json_object_accepts_unicode() -> None:
    assert decode_json_object('{"t":"日本語 🎭 \\u00e9"}') == {"t": "日本語 🎭 é"}
    assert decode_json_object('{"t":"日本語"}'.encode()) == {"t": "日本語"}
