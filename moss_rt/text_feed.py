"""Streaming text input, sans-I/O: text that arrives in pieces (an LLM's tokens) cut into what a take speaks next.

A WebSocket take opened for streamed text is fed with ``append`` and closed with ``end_of_text``
(``flush`` speaks what is pending without waiting for a sentence end). The take speaks sentence by
sentence: each continuation is generated with the whole text handed out so far in its prompt and
every frame so far as its audio prefix (the model's continuation mode: transcript + new text, the
earlier audio as its own), so voice and delivery carry over.

:class:`TextFeed` only decides *what* is ready; *when* to speak it is the session's call: whenever
no continuation is generating, it takes everything ready at once, so text that arrives faster than
speech is spoken in fewer, longer continuations and the stream never waits on a sentence that
already arrived.
"""

from __future__ import annotations

import re

from moss_rt.protocol import ErrorCode, ProtocolError

# A sentence ends at a terminator (optionally followed by closing quotes or brackets) that is
# followed by whitespace, or at a line break. A terminator at the very end of what has arrived is
# not yet an end ("3." may become "3.5"); flush or end_of_text settles it.
_SENTENCE_END = re.compile(r"(?:[.!?…;]+[\"'”’»)\]]*\s+|[。！？；]+[」』”’)]*\s*|\n\s*)")


class TextFeed:
    """The text of one streamed take: what was spoken, what is ready, what is still arriving."""

    def __init__(self, max_chars: int, initial: str = "") -> None:
        self._max_chars = max_chars
        self._spoken = ""  # handed out to continuations, in order
        self._ready_to = 0  # _pending[:_ready_to] is ready (whole sentences, or flushed)
        self._pending = ""
        self.closed = False  # end_of_text received: nothing more will arrive
        if initial:
            self.append(initial)

    @property
    def spoken(self) -> str:
        """All text handed out so far (the transcript of the take's audio once it is generated)."""
        return self._spoken

    @property
    def pending(self) -> str:
        """Text received but not handed out yet (ready or not)."""
        return self._pending

    @property
    def text(self) -> str:
        """Everything received so far."""
        return self._spoken + self._pending

    @property
    def has_ready(self) -> bool:
        return bool(self._pending[: self._ready_to].strip())

    @property
    def finished(self) -> bool:
        """Closed and nothing left to speak."""
        return self.closed and not self._pending.strip()

    def append(self, piece: str) -> None:
        if self.closed:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD, "the take's text was ended (end_of_text); start a new take", field="text"
            )
        if len(self.text) + len(piece) > self._max_chars:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"the take's text would be {len(self.text) + len(piece)} characters, the limit is {self._max_chars}",
                field="text",
            )
        self._pending += piece
        self._mark_sentences()

    def flush(self) -> None:
        """Everything received so far is ready, sentence end or not."""
        self._ready_to = len(self._pending)

    def end(self) -> None:
        """No more text: what is pending is ready, and the take ends once it is spoken."""
        self.flush()
        self.closed = True

    def take_ready(self) -> str | None:
        """Hand out everything ready (None when nothing is); it becomes part of :attr:`spoken`."""
        if not self.has_ready:
            return None
        piece, self._pending = self._pending[: self._ready_to], self._pending[self._ready_to :]
        self._ready_to = 0
        self._spoken += piece
        self._mark_sentences()
        return piece

    def _mark_sentences(self) -> None:
        for match in _SENTENCE_END.finditer(self._pending, self._ready_to):
            self._ready_to = match.end()
