"""The directing session, sans-I/O: takes, their history, and seek/replay bookkeeping.

A session turns client intents (start, seek) into plans for the transport to carry out, and
records what the engine produced (codes per frame) so any take can be replayed, branched from,
or downloaded. It touches no socket and no tensor; codes are small numpy arrays.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from moss_rt.engine.base import TakeSpec
from moss_rt.generation import FRAME_SAMPLES, N_CODEBOOKS, SamplingParams
from moss_rt.protocol import ErrorCode, ProtocolError, Seek, SeekAck, StartTake, seek_ack


def new_take_id() -> str:
    # Unguessable: a take id doubles as the capability to download it.
    return "t_" + secrets.token_urlsafe(9)


def random_seed() -> int:
    return secrets.randbelow(2**31)


@dataclass
class TakeRecord:
    """One take: its direction, seed, lineage and the codes generated so far."""

    take_id: str
    request: StartTake
    seed: int
    parent: str | None = None
    branch_frame: int = 0  # frames [0, branch_frame) come from the parent
    label: str | None = None
    status: str = "running"  # running | ended
    reason: str | None = None
    stats: dict[str, float] = field(default_factory=dict)
    _chunks: list[np.ndarray] = field(default_factory=list)
    _n_frames: int = 0

    @property
    def n_frames(self) -> int:
        return self._n_frames

    @property
    def codes(self) -> np.ndarray:
        """All frames so far, [n_frames, 12] int64."""
        if not self._chunks:
            return np.zeros((0, N_CODEBOOKS), dtype=np.int64)
        if len(self._chunks) > 1:
            self._chunks = [np.concatenate(self._chunks, axis=0)]
        return self._chunks[0]

    def append(self, first_frame: int, codes: np.ndarray) -> None:
        if first_frame != self._n_frames:
            raise ValueError(f"take {self.take_id}: chunk at frame {first_frame}, expected {self._n_frames}")
        self._chunks.append(np.asarray(codes, dtype=np.int64).reshape(-1, N_CODEBOOKS))
        self._n_frames += int(codes.shape[0])

    def engine_spec(
        self, *, reference_codes: np.ndarray | None = None, prefix_codes: np.ndarray | None = None
    ) -> TakeSpec:
        """The engine's request for this take: the wire request resolved (one seed, reference codes)."""
        r = self.request
        return TakeSpec(
            take_id=self.take_id,
            text=r.text,
            instruction=r.instruction,
            language=r.language,
            seed=self.seed,
            sampling=r.sampling,
            max_frames=r.max_new_tokens,
            chunk_frames=r.chunk_frames,
            channels=r.channels,
            tokens=r.tokens,
            reference_codes=reference_codes,
            prefix_codes=prefix_codes if prefix_codes is not None and len(prefix_codes) else None,
            parent_take=self.parent,
        )

    def summary(self) -> dict[str, object]:
        return {
            "take": self.take_id,
            "label": self.label,
            "parent": self.parent,
            "branch_frame": self.branch_frame,
            "seed": self.seed,
            "status": self.status,
            "reason": self.reason,
            "n_frames": self.n_frames,
            "request": self.request.to_dict(),
            **self.stats,
        }


class TakeStore:
    """App-wide, bounded store of recent takes (by id), shared by every connection.

    Takes are evicted oldest first; a running take is never evicted.
    """

    def __init__(self, max_takes: int = 1024) -> None:
        self._takes: OrderedDict[str, TakeRecord] = OrderedDict()
        self._max = max_takes

    def __len__(self) -> int:
        return len(self._takes)

    def add(self, take: TakeRecord) -> None:
        self._takes[take.take_id] = take
        self._evict()

    def get(self, take_id: str) -> TakeRecord | None:
        return self._takes.get(take_id)

    def discard(self, take_id: str) -> None:
        take = self._takes.get(take_id)
        if take is not None and take.status != "running":
            del self._takes[take_id]

    def _evict(self) -> None:
        for take_id in list(self._takes):
            if len(self._takes) <= self._max:
                return
            if self._takes[take_id].status != "running":
                del self._takes[take_id]


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


class DirectingSession:
    """One client's directing state: at most one running take, a bounded history of takes."""

    def __init__(
        self,
        store: TakeStore,
        *,
        max_takes: int = 32,
        id_factory: Callable[[], str] = new_take_id,
        seed_factory: Callable[[], int] = random_seed,
    ) -> None:
        self._store = store
        self._max_takes = max_takes
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
        take = TakeRecord(self._new_id(), request, seed, label=request.take)
        self._remember(take)
        self.running = take
        return StartPlan(take)

    def plan_seek(self, msg: Seek) -> SeekPlan:
        source = self.get(msg.take)
        if msg.frame > source.n_frames:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"frame {msg.frame} is past the {source.n_frames} frames take {source.take_id} has",
                field="frame",
            )
        if msg.mode == "replay":
            if source is self.running:
                raise ProtocolError(ErrorCode.INVALID_FIELD, "cannot replay a take while it is running", field="take")
            self.running = None
            return SeekPlan("replay", source, msg.frame, source)
        request = source.request
        overrides = {k: v for k, v in (("instruction", msg.instruction), ("text", msg.text)) if v is not None}
        sampling: SamplingParams = request.sampling.replace(**msg.sampling)
        request = dataclasses.replace(request, sampling=sampling, seed=msg.seed, **overrides)
        seed = msg.seed if msg.seed is not None else self._new_seed()
        take = TakeRecord(
            self._new_id(), request, seed, parent=source.take_id, branch_frame=msg.frame, label=source.label
        )
        if msg.frame:
            take.append(0, source.codes[: msg.frame])
        self._remember(take)
        self.running = take
        return SeekPlan("retake", source, msg.frame, take)

    def keep_until_deleted(self, max_takes: int) -> None:
        """Bound to a stored session: takes stay until the director deletes them (the store's quota applies)."""
        self._max_takes = max(self._max_takes, max_takes)

    def adopt(self, take: TakeRecord) -> None:
        """An ended take of this session from an earlier connection (or before a restart), rebuilt from its stored
        codes: replayable and retakeable like one made here (a retake rebuilds the cache from the codes)."""
        take.status = "ended"
        self._remember(take)

    def record_chunk(self, take: TakeRecord, first_frame: int, codes: np.ndarray) -> None:
        take.append(first_frame, codes)

    def record_end(self, take: TakeRecord, reason: str, stats: dict[str, float]) -> None:
        take.status = "ended"
        take.reason = reason
        take.stats.update(stats)
        if self.running is take:
            self.running = None

    def _remember(self, take: TakeRecord) -> None:
        self._history[take.take_id] = take
        self._store.add(take)
        while len(self._history) > self._max_takes:
            for take_id, old in self._history.items():
                if old.status != "running":
                    del self._history[take_id]
                    self._store.discard(take_id)
                    break
            else:
                break

    def close(self) -> None:
        """The connection is gone: its takes stay downloadable until the store evicts them."""
        self.running = None
