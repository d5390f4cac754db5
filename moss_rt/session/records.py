"""A take's record: its direction, seed, lineage and the codes generated so far (sans-I/O)."""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moss_rt.align.base import WordTime
from moss_rt.engine.base import TakeSpec
from moss_rt.generation import FRAME_SAMPLES, N_CODEBOOKS, frame_at_time
from moss_rt.protocol import ErrorCode, ProtocolError, StartTake


def new_take_id() -> str:
    # Unguessable: a take id doubles as the capability to download it.
    return "t_" + secrets.token_urlsafe(9)


def random_seed() -> int:
    return secrets.randbelow(2**31)


class TakeStatus(enum.StrEnum):
    RUNNING = "running"  # being admitted, streamed or stopped: its codes may still grow
    ENDED = "ended"


@dataclass
class TakeRecord:
    """One take: its direction, seed, lineage and the codes generated so far."""

    take_id: str
    request: StartTake  # as resolved: its ``seed`` is set, the take's one seed
    parent: str | None = None
    branch_frame: int = 0  # frames [0, branch_frame) come from the parent
    label: str | None = None
    status: TakeStatus = TakeStatus.RUNNING
    reason: str | None = None
    stats: dict[str, float] = field(default_factory=dict)
    # Whether the director gave the seed (False: the server picked it). Stored takes keep their request as asked,
    # without a picked seed, so a studio can tell a fixed seed from a random one after a reload.
    seed_given: bool = True
    # When each word of its text is said (moss_rt.align), once aligned: streamed with the take (``words``), or on
    # demand for downloads and ``seek`` by word. None: not aligned (yet).
    words: list[WordTime] | None = None
    _chunks: list[np.ndarray] = field(default_factory=list)
    _n_frames: int = 0

    @property
    def seed(self) -> int:
        assert self.request.seed is not None, "a take's request carries its resolved seed"
        return self.request.seed

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

    def request_as_asked(self) -> dict[str, Any]:
        """The request as the director sent it: its ``seed`` only when one was given (the take's one seed is
        :attr:`seed`). What a stored take keeps."""
        asked = self.request.to_dict()
        if not self.seed_given:
            asked.pop("seed", None)
        return asked

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


def word_frame(take: TakeRecord, index: int) -> int:
    """The frame where the take's ``index``-th word starts (``seek`` by ``word``); the take's words must be known."""
    words = take.words
    if words is None:
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"take {take.take_id} has no word timings yet", field="word")
    if index >= len(words):
        raise ProtocolError(
            ErrorCode.INVALID_FIELD, f"word {index} is past the {len(words)} words of take {take.take_id}", field="word"
        )
    return frame_at_time(words[index].start)


def bytes_per_frame(take: TakeRecord) -> int:
    """Bytes of one 80 ms frame of the take's PCM (int16, its channel count)."""
    return FRAME_SAMPLES * take.request.channels * 2
