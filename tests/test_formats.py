"""Audio formats (pure unit): names and rates, and the incremental encoders decoded back with FFmpeg."""

from __future__ import annotations

import numpy as np
import pytest

from moss_rt.formats import FORMATS, SAMPLE_RATES, AudioFormat, parse_audio_format
from moss_rt.formats.encoder import DECODE_SLACK, StreamEncoder, encode_all
from moss_rt.protocol import FRAME_SAMPLES, ProtocolError
from tests.ecosystem.audio_check import assert_length, decode, decode_samples, opus_input_rate

TONE_HZ = 440.0


def tone(frames: int, channels: int, hz: float = TONE_HZ) -> bytes:
    """A sine of ``frames`` 80 ms codec frames at 48 kHz as int16 PCM (interleaved when stereo)."""
    n = frames * FRAME_SAMPLES
    x = (0.4 * 32767 * np.sin(2 * np.pi * hz * np.arange(n) / 48000)).astype("<i2")
    return np.repeat(x[:, None], channels, axis=1).tobytes()


def dominant_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[int(np.argmax(spectrum))])


def encode_in_chunks(pcm: bytes, fmt: AudioFormat, channels: int, chunk_frames: int) -> list[bytes]:
    """What a client receives, chunk by chunk, as a take streams (the last item is finish())."""
    encoder = StreamEncoder(fmt, channels)
    step = chunk_frames * FRAME_SAMPLES * 2 * channels
    return [encoder.encode(pcm[i : i + step]) for i in range(0, len(pcm), step)] + [encoder.finish()]


def test_parse_audio_format_accepts_the_names_and_rates() -> None:
    assert parse_audio_format("MP3") == AudioFormat("mp3", 48000)
    assert parse_audio_format("pcm", "16000") == AudioFormat("pcm", 16000)  # query strings carry text
    assert parse_audio_format("opus", None, default_rate=24000).sample_rate == 24000
    assert AudioFormat("opus").media_type == "audio/ogg" and AudioFormat("wav").extension == "wav"


@pytest.mark.parametrize(
    ("name", "rate", "field"),
    [("ogg", None, "format"), (3, None, "format"), ("mp3", 44100, "sample_rate"), ("wav", True, "sample_rate")],
)
def test_parse_audio_format_refuses_with_the_field(name: object, rate: object, field: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        parse_audio_format(name, rate)
    assert exc.value.code.value == "invalid_field" and exc.value.field == field
    assert str(list(FORMATS if field == "format" else SAMPLE_RATES)) in exc.value.message


@pytest.mark.parametrize("channels", [1, 2])
@pytest.mark.parametrize("rate", SAMPLE_RATES)
@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_length_rate_channels_and_pitch(name: str, rate: int, channels: int) -> None:
    frames = 13
    data = b"".join(encode_in_chunks(tone(frames, channels), AudioFormat(name, rate), channels, chunk_frames=3))
    decoded = decode(data, name, pcm_rate=rate, pcm_channels=channels)
    assert decoded.channels == channels
    # Opus always decodes at 48 kHz (RFC 7845); the rate it was encoded at is in its header.
    out_rate = 48000 if name == "opus" else rate
    assert decoded.sample_rate == out_rate
    if name == "opus":
        assert opus_input_rate(data) == rate
    assert_length(decoded, name, frames * FRAME_SAMPLES * out_rate // 48000)
    # The sound survives the resampler and the codec: a 440 Hz tone stays at 440 Hz (±1 FFT bin).
    samples = decode_samples(data, name, pcm_rate=rate, pcm_channels=channels)[:, 0].astype(np.float64)
    assert abs(dominant_hz(samples, out_rate) - TONE_HZ) <= out_rate / len(samples) + 1e-9


@pytest.mark.parametrize("name", ["flac", "wav", "pcm"])
def test_lossless_formats_at_48k_return_the_exact_samples(name: str) -> None:
    pcm = tone(5, 2)
    data = encode_all(pcm, AudioFormat(name, 48000), 2)
    samples = decode_samples(data, name, pcm_rate=48000, pcm_channels=2)
    assert samples.astype("<i2").tobytes() == pcm


@pytest.mark.parametrize("name", FORMATS)
def test_first_bytes_leave_with_the_first_chunk(name: str) -> None:
    """Incremental: the first 160 ms of PCM already yield bytes of the stream, long before the end."""
    chunks = encode_in_chunks(tone(25, 1), AudioFormat(name, 48000), 1, chunk_frames=2)
    assert len(chunks[0]) > 0
    assert sum(1 for c in chunks[:-1] if c) >= len(chunks[:-1]) - 2  # (nearly) every chunk yields bytes


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_speed_changes_duration_not_pitch(speed: float) -> None:
    frames = 25
    data = encode_all(tone(frames, 1), AudioFormat("pcm", 48000), 1, speed=speed)
    samples = np.frombuffer(data, dtype="<i2").astype(np.float64)
    expected = frames * FRAME_SAMPLES / speed
    assert abs(len(samples) - expected) <= 0.02 * expected + 960, (len(samples), expected)
    # A tempo change, not a resampling: the tone keeps its pitch (resampling would move it to 880/220 Hz).
    assert abs(dominant_hz(samples, 48000) - TONE_HZ) <= 2 * 48000 / len(samples)


def test_encoder_refuses_bad_input() -> None:
    with pytest.raises(ValueError):
        StreamEncoder(AudioFormat("mp3"), 3)
    with pytest.raises(ValueError):
        StreamEncoder(AudioFormat("mp3"), 1, speed=5.0)
    encoder = StreamEncoder(AudioFormat("wav"), 2)
    with pytest.raises(ValueError):
        encoder.encode(b"\x00\x00")  # half a stereo sample
    encoder.finish()
    with pytest.raises(RuntimeError):
        encoder.encode(b"\x00\x00\x00\x00")


def test_decode_slack_covers_every_format() -> None:
    assert set(DECODE_SLACK) == set(FORMATS)


def test_async_encoder_close_waits_for_the_call_in_flight() -> None:
    """A cancelled encode's thread keeps the container until it returns; close() releases it after that."""
    import asyncio
    import threading

    from moss_rt.formats.async_encoder import AsyncEncoder, EncoderClosed

    async def scenario() -> None:
        encoder = AsyncEncoder(AudioFormat("mp3", 48000), 1)
        inside = threading.Event()
        release = threading.Event()
        real_encode = encoder._encoder.encode

        def slow_encode(pcm: bytes) -> bytes:
            inside.set()
            release.wait(5)
            return real_encode(pcm)

        encoder._encoder.encode = slow_encode  # type: ignore[method-assign]
        task = asyncio.create_task(encoder.encode(b"\0\0" * FRAME_SAMPLES))
        await asyncio.to_thread(inside.wait, 5)
        task.cancel()  # the awaiting task goes; the thread is still inside FFmpeg
        encoder.close()
        await asyncio.sleep(0.05)
        assert not encoder.closed, "the container was released under a running encode"
        release.set()
        await asyncio.wait_for(encoder.wait_closed(), 5)
        assert encoder.closed
        with pytest.raises(EncoderClosed):
            await encoder.encode(b"\0\0" * FRAME_SAMPLES)

    asyncio.run(scenario())
