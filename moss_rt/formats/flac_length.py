"""The length field of a FLAC stream's header (STREAMINFO), sans-I/O.

FFmpeg's FLAC muxer writing to a stream (no seek) leaves STREAMINFO's total-samples field at 0, "unknown",
because it only learns the length at the end, when it can no longer go back. The FLAC format allows that,
and FFmpeg decodes such a file to its end, but libsndfile (``soundfile.read``, the usual way Python reads
audio) takes the 0 as "unbounded" and fails ("array is too big"); a length larger than the samples present
fails as well, so the field must be exact (issue 23, finding 13). Where the length is known, it is written
here: up front when it is known before encoding starts (:class:`DeclaredLength`, take downloads), or once
the file is complete (:func:`set_total_samples`, a whole file held back until its end).

STREAMINFO is always the stream's first metadata block, right after the ``fLaC`` marker: bytes 8-41. Its
total-samples field is the low 36 bits of the big-endian 64-bit word at bytes 18-25 (after 20 bits of
sample rate, 3 of channels and 5 of bits per sample).
"""

from __future__ import annotations

HEADER_BYTES = 42  # "fLaC", the 4-byte metadata block header, the 34 bytes of STREAMINFO
_WORD = slice(18, 26)
_TOTAL_BITS = 36
MAX_TOTAL_SAMPLES = (1 << _TOTAL_BITS) - 1


def total_samples(head: bytes) -> int:
    """The total-samples field of a FLAC stream that begins with ``head`` (0: unknown)."""
    _check(head)
    return int.from_bytes(head[_WORD], "big") & MAX_TOTAL_SAMPLES


def set_total_samples(head: bytes, total: int) -> bytes:
    """``head`` (the first :data:`HEADER_BYTES` or more of a FLAC stream) with its total-samples field set."""
    _check(head)
    if not 0 <= total <= MAX_TOTAL_SAMPLES:
        raise ValueError(f"a FLAC stream holds at most {MAX_TOTAL_SAMPLES} samples per channel, not {total}")
    word = int.from_bytes(head[_WORD], "big")
    word = (word & ~MAX_TOTAL_SAMPLES) | total
    return head[: _WORD.start] + word.to_bytes(8, "big") + head[_WORD.stop :]


def _check(head: bytes) -> None:
    if len(head) < HEADER_BYTES or head[:4] != b"fLaC" or (head[4] & 0x7F) != 0:
        raise ValueError("not the start of a FLAC stream with its STREAMINFO block")


class DeclaredLength:
    """Writes a length known before encoding into a FLAC stream's header as the stream passes through.

    The stream's bytes are fed in the order they are produced; the first :data:`HEADER_BYTES` are held back
    until they are all there (FFmpeg writes them at once, with the first packet), then patched and passed on.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self._head: bytes | None = b""  # None once the header went out

    def feed(self, data: bytes) -> bytes:
        if self._head is None:
            return data
        self._head += data
        if len(self._head) < HEADER_BYTES:
            return b""
        out, self._head = set_total_samples(self._head, self.total), None
        return out

    def flush(self) -> bytes:
        """What is still held at the end of the stream (only a stream shorter than its header)."""
        out, self._head = self._head or b"", None
        return out
