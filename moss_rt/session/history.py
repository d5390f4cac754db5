"""One client's take history, and the plans for its starts and seeks (sans-I/O bookkeeping)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moss_rt.align.base import kept_words
from moss_rt.generation import FRAME_RATE, FRAME_SAMPLES
from moss_rt.protocol import DEFAULT_LIMITS, ErrorCode, ProtocolError, Seek, SeekAck, StartTake, seek_ack
from moss_rt.session.recent_takes import RecentTakes
from moss_rt.session.records import TakeRecord, TakeStatus, new_take_id, random_seed, word_frame


@dataclass(frozen=True)
class StartPlan:
    take: TakeRecord


@dataclass(frozen=True)
class SeekPlan:
    mode: str  # retake | replay
    source: TakeRecord
    frame: int
    take: TakeRecord  # the new take (retake) or the source itself (replay)

    @property
    def sample(self) -> int:
        return self.frame * FRAME_SAMPLES

    @property
    def prefix_codes(self) -> np.ndarray:
        return self.source.codes[: self.frame]

    def ack(self) -> SeekAck:
        return seek_ack(take=self.take.take_id, from_take=self.source.take_id, frame=self.frame)


class TakeHistory:
    """One client's takes: a bounded history (by id), what is running, plans for starts and seeks.

    Bookkeeping only; :class:`TakeLifecycle` decides when takes start and stop.
    """

    def __init__(
        self,
        recent: RecentTakes,
        *,
        max_takes_kept: int = DEFAULT_LIMITS.max_takes_kept,
        id_factory: Callable[[], str] = new_take_id,
        seed_factory: Callable[[], int] = random_seed,
        client: str | None = None,
    ) -> None:
        self._recent = recent
        self._client = client  # whose takes these are, for the recent takes' per-client eviction
        self._max_takes_kept = max_takes_kept
        self._new_id = id_factory
        self._new_seed = seed_factory
        self._history: OrderedDict[str, TakeRecord] = OrderedDict()
        self.running: TakeRecord | None = None

    @property
    def takes(self) -> list[TakeRecord]:
        return list(self._history.values())

    def get(self, take_id: str) -> TakeRecord:
        take = self._history.get(take_id)
        if take is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no take {take_id!r} in this session", field="take")
        return take

    def plan_start(self, request: StartTake) -> StartPlan:
        seed = request.seed if request.seed is not None else self._new_seed()
        take = TakeRecord(
            self._new_id(), dataclasses.replace(request, seed=seed), label=request.take,
            seed_given=request.seed is not None,
        )  # fmt: skip
        self._remember(take)
        self.running = take
        return StartPlan(take)

    def plan_seek(self, msg: Seek) -> SeekPlan:
        source = self.get(msg.take)
        if msg.word is not None:
            msg = dataclasses.replace(msg, frame=word_frame(source, msg.word), word=None)
        if msg.frame > source.n_frames:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"frame {msg.frame} is past the {source.n_frames} frames take {source.take_id} has",
                field="frame",
            )
        if msg.mode == "replay":
            if source.status is TakeStatus.RUNNING:
                raise ProtocolError(ErrorCode.INVALID_FIELD, "cannot replay a take while it is running", field="take")
            self.running = None
            return SeekPlan("replay", source, msg.frame, source)
        parent = source.request
        request = dataclasses.replace(
            parent,
            text=parent.text if msg.text is None else msg.text,
            instruction=parent.instruction if msg.instruction is None else msg.instruction,
            sampling=parent.sampling.replace(**msg.sampling),
            seed=msg.seed if msg.seed is not None else self._new_seed(),
            words=parent.words if msg.words is None else msg.words,
        )
        take = TakeRecord(
            self._new_id(), request, parent=source.take_id, branch_frame=msg.frame, label=source.label,
            seed_given=msg.seed is not None,
        )  # fmt: skip
        if msg.frame:
            take.append(0, source.codes[: msg.frame])
        if source.words is not None and request.words:
            # The kept frames keep their words: those that end before the branch point (and are still the text's).
            take.words = kept_words(source.words, request.text, msg.frame / FRAME_RATE)
        self._remember(take)
        self.running = take
        return SeekPlan("retake", source, msg.frame, take)

    def keep_until_deleted(self, max_session_takes: int) -> None:
        """Bound to a stored session: takes stay until the director deletes them, up to the takes one stored
        session keeps (``max_session_takes``)."""
        self._max_takes_kept = max(self._max_takes_kept, max_session_takes)

    def adopt(self, take: TakeRecord, *, shared: bool = True) -> None:
        """An ended take of this session from an earlier connection (or before a restart), rebuilt from its stored
        codes: replayable and retakeable like one made here (a retake rebuilds the cache from the codes).

        ``shared`` False keeps it out of the service's recent takes (downloads and captions by take id): a splice
        or comp, whose audio is not its codes' decoding, is downloaded from its session."""
        take.status = TakeStatus.ENDED
        self._remember(take, shared=shared)

    def record_chunk(self, take: TakeRecord, first_frame: int, codes: np.ndarray) -> None:
        take.append(first_frame, codes)

    def record_end(self, take: TakeRecord, reason: str, stats: dict[str, float]) -> None:
        take.status = TakeStatus.ENDED
        take.reason = reason
        take.stats.update(stats)
        if self.running is take:
            self.running = None

    def _remember(self, take: TakeRecord, *, shared: bool = True) -> None:
        self._history[take.take_id] = take
        if shared:
            self._recent.add(take, self._client)
        while len(self._history) > self._max_takes_kept:
            for take_id, old in self._history.items():
                if old.status is not TakeStatus.RUNNING:
                    del self._history[take_id]
                    self._recent.discard(take_id)
                    break
            else:
                break

    def close(self) -> None:
        """The connection is gone: its takes stay downloadable until the recent takes evict them."""
        self.running = None
