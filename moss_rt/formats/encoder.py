"""Incremental encoding of a take's PCM into a delivery format (PyAV/FFmpeg encoders, soxr resampling).

A :class:`StreamEncoder` is fed the service's int16 PCM (48 kHz, the take's 1 or 2 channels) chunk by
chunk as the engine produces it, and returns the bytes of the encoded stream that are ready after
each chunk, so the first bytes go out with the first frames. ``finish()`` flushes the codec and the
container. The pipeline per chunk::

    int16 PCM 48 kHz ─▶ [atempo, when speed ≠ 1] ─▶ [soxr, when the rate ≠ 48 kHz] ─▶ encoder + muxer ─▶ bytes

Why PyAV (FFmpeg) rather than soundfile (libsndfile): libsndfile has no AAC encoder, and its MP3
and Opus writers need a seekable file, whereas FFmpeg's muxers write to a plain stream (headers
with "unknown length" markers, Ogg pages flushed as they fill), and one library then covers all
five codecs and the tempo filter. PyAV's wheels bundle FFmpeg with libmp3lame, libopus and the
native AAC and FLAC encoders, so nothing outside the wheel is needed.

Encoding costs CPU (about a millisecond per 80 ms frame for MP3 and AAC); callers on the event
loop run ``encode``/``finish`` in a worker thread (:class:`~moss_rt.formats.async_encoder.AsyncEncoder` does).
An encoder is not thread-safe: one caller at a time, in order.
"""

from __future__ import annotations

import logging
from fractions import Fraction

import av
import av.error
import numpy as np
import soxr

from moss_rt.formats.flac_length import DeclaredLength, set_total_samples
from moss_rt.formats.spec import MAX_SPEED, MIN_SPEED, AudioFormat
from moss_rt.protocol import SAMPLE_RATE

log = logging.getLogger(__name__)

# format → (FFmpeg muxer, FFmpeg encoder, bit rate per channel; None for lossless)
_CODECS: dict[str, tuple[str, str, int | None]] = {
    "mp3": ("mp3", "libmp3lame", 64_000),
    "opus": ("ogg", "libopus", 32_000),
    "aac": ("adts", "aac", 64_000),
    "flac": ("flac", "flac", None),
    "wav": ("wav", "pcm_s16le", None),
}
# Muxer options: flush every packet to our sink (no 32 KiB AVIO buffering), no encoder-version
# tags (stable bytes), and Ogg pages closed every 20 ms instead of every second, so Opus bytes
# leave with the chunk that made them.
_MUX_OPTIONS = {"flush_packets": "1", "fflags": "+bitexact"}
_OGG_OPTIONS = {"page_duration": "20000"}
_LAYOUTS = {1: "mono", 2: "stereo"}
_TEMPO_PIECE = 960  # samples per frame pushed into atempo (20 ms at 48 kHz)

# Samples (per channel, at the output rate) a decoder may return beyond the PCM that went in: the
# codec's priming delay plus one frame of end padding. Decoders that read Ogg granule positions, and
# FLAC and WAV, return exactly the input. A stream cannot carry MP3's or AAC's trimming information
# (the Xing/LAME tag needs a seekable output, ADTS has no field for it), so this is a property of
# the streamed formats, not of the encoder.
DECODE_SLACK: dict[str, int] = {"mp3": 1105 + 1152, "aac": 1024 + 1024, "opus": 0, "flac": 0, "wav": 0, "pcm": 0}


class _Sink:
    """A write-only file for FFmpeg: having no ``seek`` makes its muxers write in streaming mode."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes | memoryview) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def drain(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


class _Tempo:
    """FFmpeg's ``atempo`` filter (speed without a pitch change), fed and drained incrementally."""

    def __init__(self, speed: float, channels: int, rate: int) -> None:
        self._graph = av.filter.Graph()
        layout = _LAYOUTS[channels]
        src = self._graph.add_abuffer(format="s16", sample_rate=rate, layout=layout, time_base=Fraction(1, rate))
        node = src
        # One atempo instance covers 0.5-100; slower speeds are a chain of halvings.
        remaining = speed
        factors: list[float] = []
        while remaining < 0.5:
            factors.append(0.5)
            remaining /= 0.5
        factors.append(remaining)
        for factor in factors:
            tempo = self._graph.add("atempo", f"{factor:.6f}")
            node.link_to(tempo)
            node = tempo
        fmt = self._graph.add("aformat", f"sample_fmts=s16:channel_layouts={layout}")
        node.link_to(fmt)
        sink = self._graph.add("abuffersink")
        fmt.link_to(sink)
        self._graph.configure()
        self._channels = channels
        self._rate = rate
        self._pts = 0

    def process(self, samples: np.ndarray | None) -> np.ndarray:
        """Samples [n, channels] in (None: end of input) → the tempo-changed samples ready now."""
        out: list[np.ndarray] = []
        if samples is None:
            self._graph.push(None)
            self._drain(out)
        else:
            # atempo answers one input frame late; small frames keep that lag to ~20 ms.
            for start in range(0, len(samples), _TEMPO_PIECE):
                piece = np.ascontiguousarray(samples[start : start + _TEMPO_PIECE])
                frame = av.AudioFrame.from_ndarray(piece.reshape(1, -1), format="s16", layout=_LAYOUTS[self._channels])
                frame.sample_rate = self._rate
                frame.time_base = Fraction(1, self._rate)
                frame.pts = self._pts
                self._pts += len(piece)
                self._graph.push(frame)
                self._drain(out)
        if not out:
            return np.zeros((0, self._channels), dtype=np.int16)
        return np.concatenate(out, axis=0).astype(np.int16, copy=False)

    def _drain(self, out: list[np.ndarray]) -> None:
        while True:
            try:
                frame = self._graph.pull()
            except (av.error.BlockingIOError, av.error.EOFError):
                return
            out.append(frame.to_ndarray().reshape(-1, self._channels))


class StreamEncoder:
    """int16 PCM at 48 kHz in, ``fmt``'s bytes out, as the chunks arrive.

    ``speed`` (0.25-4) changes the tempo without changing the pitch (FFmpeg's ``atempo``);
    1.0 leaves the audio untouched.
    """

    def __init__(
        self,
        fmt: AudioFormat,
        channels: int,
        *,
        speed: float = 1.0,
        input_rate: int = SAMPLE_RATE,
        total_samples: int | None = None,
    ) -> None:
        """``total_samples``: FLAC only, the samples per channel (at the format's rate) the stream will hold,
        when known before encoding starts: its header then says so (else "unknown", which libsndfile,
        ``soundfile.read``, cannot read; see :mod:`moss_rt.formats.flac_length`)."""
        if channels not in _LAYOUTS:
            raise ValueError(f"channels must be 1 or 2, got {channels}")
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed must be in [{MIN_SPEED}, {MAX_SPEED}], got {speed}")
        self.format = fmt
        self.channels = channels
        self._finished = False
        self._tempo = _Tempo(speed, channels, input_rate) if speed != 1.0 else None
        self._resampler = (
            soxr.ResampleStream(input_rate, fmt.sample_rate, channels, dtype="int16", quality="HQ")
            if fmt.sample_rate != input_rate
            else None
        )
        self._container: av.container.OutputContainer | None = None
        self._stream: av.audio.stream.AudioStream | None = None
        self._sink = _Sink()
        if total_samples is not None and fmt.name != "flac":
            raise ValueError("total_samples is a FLAC header field")
        self._length = DeclaredLength(total_samples) if total_samples is not None else None
        self.samples_out = 0  # per channel, at the format's rate, handed to the encoder
        if not fmt.is_raw_pcm:
            muxer, codec, bit_rate = _CODECS[fmt.name]
            options = {**_MUX_OPTIONS, **(_OGG_OPTIONS if muxer == "ogg" else {})}
            self._container = av.open(self._sink, mode="w", format=muxer, options=options)
            stream = self._container.add_stream(codec, rate=fmt.sample_rate, layout=_LAYOUTS[channels])
            assert isinstance(stream, av.audio.stream.AudioStream)  # an audio codec's stream
            if bit_rate is not None:
                stream.bit_rate = bit_rate * channels
            self._stream = stream

    def encode(self, pcm: bytes) -> bytes:
        """Feed int16 little-endian PCM (interleaved when stereo); returns the bytes ready now."""
        if self._finished:
            raise RuntimeError("the encoder is finished")
        if len(pcm) % (2 * self.channels):
            raise ValueError(f"{len(pcm)} bytes is not a whole number of {self.channels}-channel int16 samples")
        samples = np.frombuffer(pcm, dtype="<i2").reshape(-1, self.channels)
        return self._push(samples, last=False)

    def finish(self) -> bytes:
        """Flush the filter, resampler, codec and container; returns the last bytes of the stream."""
        if self._finished:
            return b""
        out = self._push(np.zeros((0, self.channels), dtype=np.int16), last=True)
        self._finished = True
        if self._container is not None and self._stream is not None:
            for packet in self._stream.encode(None):
                self._container.mux(packet)
            self._container.close()
            out += self._drain()
        if self._length is not None:
            out += self._length.flush()
            if self.samples_out != self._length.total:
                log.warning("FLAC stream declared %d samples, holds %d", self._length.total, self.samples_out)
        return out

    def close(self) -> None:
        """Release FFmpeg's resources without producing the rest of the stream (an abandoned take)."""
        if self._container is not None and not self._finished:
            self._finished = True
            try:
                self._container.close()
            except Exception:  # a half-written stream nobody will read
                log.debug("closing an abandoned encoder failed", exc_info=True)

    # -- pipeline -----------------------------------------------------------------------

    def _push(self, samples: np.ndarray, *, last: bool) -> bytes:
        if self._tempo is not None:
            samples = self._tempo.process(None if last else samples)
        if self._resampler is not None and (len(samples) or last):
            samples = self._resampler.resample_chunk(samples, last=last)
        self.samples_out += len(samples)
        if self._stream is None or self._container is None:
            return np.ascontiguousarray(samples, dtype="<i2").tobytes()
        if len(samples):
            frame = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(samples).reshape(1, -1), format="s16", layout=_LAYOUTS[self.channels]
            )
            frame.sample_rate = self.format.sample_rate
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        return self._drain()

    def _drain(self) -> bytes:
        out = self._sink.drain()
        return out if self._length is None else self._length.feed(out)


def encode_all(pcm: bytes, fmt: AudioFormat, channels: int, *, speed: float = 1.0) -> bytes:
    """A whole clip in one call: the stream a client would have received chunk by chunk, except that a
    FLAC file's header states its length (the whole file is at hand; soundfile needs it)."""
    encoder = StreamEncoder(fmt, channels, speed=speed)
    data = encoder.encode(pcm) + encoder.finish()
    return set_total_samples(data, encoder.samples_out) if fmt.name == "flac" else data

