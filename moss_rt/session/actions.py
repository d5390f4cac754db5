"""What the take lifecycle asks its transport to do: one action type each (sans-I/O)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from moss_rt.engine.base import TakeSpec
from moss_rt.generation import EndReason
from moss_rt.protocol import ServerMessage
from moss_rt.session.records import TakeRecord

# Actions: what the transport must do. Each names its ``run``, the lifecycle's serial number of one
# admission / stream / replay, which is how the transport reports back (and how stale reports of a
# run the lifecycle has already let go of are recognised and ignored).


@dataclass(frozen=True)
class SendMessage:
    message: ServerMessage


@dataclass(frozen=True)
class SendAudio:
    """PCM of the current take. ``paced``: hold the client to real time (not while stopping)."""

    run: int
    pcm: bytes
    seconds: float
    paced: bool = True


@dataclass(frozen=True)
class Admit:
    """Resolve the reference voice, submit ``spec(reference_codes)`` to the engine, then report
    :meth:`TakeLifecycle.admitted` (or :meth:`TakeLifecycle.admission_failed`)."""

    run: int
    take: TakeRecord
    prefix_codes: np.ndarray | None = None
    # A continuation of a take fed with text: its own engine take id, the previous one as parent
    # (the engine may keep that one's cache), and the frames left of the take's budget.
    engine_take_id: str | None = None
    parent_take: str | None = None
    max_frames: int | None = None
    # It interrupted the take this socket was streaming (barge-in): the engine admits it with retakes.
    barge_in: bool = False
    # Submitted while the take it replaces is still stopping (its ``end`` not out yet): the transport submits it
    # at once, so its prompt and admission overlap the stop, but reads its events only after :class:`Go`.
    early: bool = False

    def spec(self, reference_codes: np.ndarray | None) -> TakeSpec:
        spec = self.take.engine_spec(reference_codes=reference_codes, prefix_codes=self.prefix_codes)
        if self.barge_in:
            spec = dataclasses.replace(spec, barge_in=True)
        if self.engine_take_id is None:
            return spec
        return dataclasses.replace(
            spec,
            take_id=self.engine_take_id,
            parent_take=self.parent_take,
            max_frames=spec.max_frames if self.max_frames is None else self.max_frames,
        )


@dataclass(frozen=True)
class Go:
    """Run ``run``, admitted early (``Admit.early``), is now the current take: the transport may read its events."""

    run: int


@dataclass(frozen=True)
class Replay:
    """Fetch the take's audio (as heard, else rendered) and report :meth:`TakeLifecycle.replay_audio`."""

    run: int
    take: TakeRecord
    frame: int


@dataclass(frozen=True)
class Stop:
    """Stop run ``run``: cancel its engine take with ``reason`` (a replay: stop sending at once)."""

    run: int
    reason: EndReason


@dataclass(frozen=True)
class Keep:
    """Store the ended ``take`` in the directing session the connection is bound to (``resume``), before its
    ``end`` goes out: a client that has seen the end and reloads at once finds the take."""

    take: TakeRecord


@dataclass(frozen=True)
class FinishAudio:
    """The take's audio is complete: a take delivered in a format (tag 2) flushes the rest of its
    file now, before its ``end``; nothing for native PCM. ``replay``: the file of a replay run."""

    run: int
    take: TakeRecord
    replay: bool = False


@dataclass(frozen=True)
class FinishWords:
    """A take that asked for ``words`` is over: align what is left of it and send its last ``words`` message
    (``final``) now, before its record is kept and its ``end`` goes out. ``complete``: it ended ``done``, so its
    whole text is in its audio; otherwise only the words its audio reached are kept."""

    run: int
    take: TakeRecord
    complete: bool


@dataclass(frozen=True)
class WordsCheckpoint:
    """A take fed with text that asked for ``words``: a continuation ended, so the text handed out so far is all in
    its audio so far (the word aligner may settle it). Nothing to wait for."""

    run: int
    take: TakeRecord
    text: str  # the take's text as handed out so far (the take's record moves on with the next continuation)


Action = SendMessage | SendAudio | Admit | Go | Replay | Stop | FinishAudio | Keep | FinishWords | WordsCheckpoint
