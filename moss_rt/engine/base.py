"""The engine seam: what the web layer may ask of any engine (real or scripted).

Five members, nothing else (docs/architecture.md):

- ``async with engine:`` loads and warms up (start) and, on exit, stops the worker (close);
- ``info``: what it serves (models, demo, device), its status (loading, warming up, ready, failed), its memory
  plan, a cluster's replicas, and its metrics registry;
- ``submit(TakeSpec)`` admits a take and returns its :class:`TakeHandle`;
- ``render(codes, channels)`` decodes stored codes to PCM (replays, downloads);
- ``encode_reference(audio)`` encodes an uploaded voice to codes.

A :class:`TakeSpec` is the engine's own request: resolved values only (one seed, resolved
reference codes), never the wire message. A handle's event iterator cancels its take when it is
abandoned (closed early or cancelled), so no consumer needs a cancel of its own in a ``finally``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, Self

import numpy as np

from moss_rt.engine.memory_plan import MemoryPlan
from moss_rt.generation import CODEBOOK_SIZE, N_CODEBOOKS, SamplingParams
from moss_rt.generation import EndReason as EndReason  # re-exported: the engine seam speaks it
from moss_rt.protocol import ErrorCode, ProtocolError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

# First-chunk policy. A take's first new frames go out one per chunk, up to RAMP_FRAMES (or its
# ``chunk_frames`` if smaller), then whole ``chunk_frames`` chunks (the model engine goes on with one-frame chunks
# until one falls on its shared cadence: engine/slots.Take.in_ramp): a client starts playing as soon as its jitter
# cushion is there (3 frames = 240 ms covers the usual 200 ms) and keeps receiving every frame while its buffer
# is thin (with chunk 8 sent whole, sound started 8 more frames of generation later: ~0.6 s on a real-time
# engine). One-frame chunks, not a ramp of growing ones (2, 3, 4, 6 frames): the codec has CUDA graphs for one-
# and eight-frame chunks at every batch size but runs odd lengths eagerly in large batches (about 55 ms a call
# on an H200), and every take in its ramp shares one batched one-frame call per step.
RAMP_FRAMES = 8


def chunk_target(new_frames_sent: int, chunk_frames: int) -> int:
    """Frames the next chunk of a take waits for, when it has sent ``new_frames_sent`` frames of its own (a
    retake's kept prefix excluded): 1 for the first ``min(chunk_frames, RAMP_FRAMES)``, then ``chunk_frames``."""
    if new_frames_sent < min(chunk_frames, RAMP_FRAMES):
        return 1
    return max(1, chunk_frames)


def checked_codes(codes: np.ndarray, codebook_size: int = CODEBOOK_SIZE) -> np.ndarray:
    """Codes to render as [n_frames, 12] int64, or ProtocolError ``invalid_field`` when any lies outside the
    codebook. Stored or imported codes that were damaged or forged must never reach the codec: an index out of
    range is an exception on the CPU and a device-side assert, the end of the CUDA context, on a GPU."""
    codes = np.asarray(codes, dtype=np.int64).reshape(-1, N_CODEBOOKS)
    if codes.size and (int(codes.min()) < 0 or int(codes.max()) >= codebook_size):
        raise ProtocolError(
            ErrorCode.INVALID_FIELD,
            f"the take's codes lie outside the codebook [0, {codebook_size}): its stored data is damaged",
            field="take",
        )
    return codes


class EngineBusy(Exception):
    """All slots and the wait queue are full; the caller should retry later."""

    def __init__(self, retry_after_sec: float = 1.0) -> None:
        super().__init__("the service is at capacity, retry shortly")
        self.retry_after_sec = retry_after_sec


class EngineLoading(EngineBusy):
    """The engine is still loading or warming up (HTTP 503 ``loading`` with Retry-After)."""

    def __init__(self, retry_after_sec: float = 5.0) -> None:
        super().__init__(retry_after_sec)
        self.args = ("the engine is still loading, retry shortly",)


class TakePriority(IntEnum):
    """Which work a round serves first (DESIGN.md, wave 3): lower values first.

    ``INTERACTIVE`` is a director's take, retake or continuation, or an API request someone waits on;
    ``BATCH`` is work nobody listens to as it is made (script renders): it fills what interactive takes
    leave free and never delays their first audio.
    """

    INTERACTIVE = 0
    BATCH = 1


@dataclass(frozen=True)
class TakeSpec:
    """One take to generate, fully resolved: the engine's own request type.

    ``prefix_codes`` [N, 12] are frames kept from a parent take (a retake from frame N): the
    engine continues after them and never sends their audio again. ``max_frames`` counts new
    frames only (the wire's ``max_new_tokens``); ``tokens`` is the optional duration hint that
    goes into the prompt.
    """

    take_id: str
    text: str = ""
    instruction: str = ""
    language: str = ""
    seed: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_frames: int = 4096
    chunk_frames: int = 8
    channels: int = 1
    tokens: int | None = None
    reference_codes: np.ndarray | None = None  # [T, 12] int64 voice-clone reference
    prefix_codes: np.ndarray | None = None  # [N, 12] int64
    parent_take: str | None = None
    priority: TakePriority = TakePriority.INTERACTIVE
    # A new take that interrupted its client's streaming take (a ``start`` on a socket that was streaming): the
    # director is waiting, as for a retake, so it is admitted with retakes, ahead of other queued new takes.
    barge_in: bool = False

    @property
    def start_frame(self) -> int:
        return 0 if self.prefix_codes is None else int(self.prefix_codes.shape[0])


@dataclass(frozen=True)
class AudioChunk:
    """Whole 80 ms frames ``first_frame .. first_frame + n - 1`` of a take."""

    first_frame: int
    codes: np.ndarray  # [n, 12] int64
    pcm: bytes  # int16 little-endian, interleaved to the take's channel count

    @property
    def n_frames(self) -> int:
        return int(self.codes.shape[0])


@dataclass(frozen=True)
class TakeFinished:
    reason: EndReason
    n_frames: int  # frames of the whole take, prefix included
    gpu_total_ms: float
    gpu_first_ms: float | None = None
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    error_code: str | None = None  # wire error code for reason ERROR (default ``internal``)


@dataclass(frozen=True)
class TakeFirstAudio:
    """Emitted once, right before the first chunk: admission → first PCM ready."""

    gpu_first_ms: float


TakeEvent = TakeFirstAudio | AudioChunk | TakeFinished


class TakeHandle(Protocol):
    """A submitted take. Iterate it once for its events; they end with one :class:`TakeFinished`.

    An iteration abandoned before that (the iterator closed, or the task awaiting it cancelled)
    cancels the take, so the engine never generates for nobody.
    """

    take_id: str
    # True when a retake could not reuse its parent's cache where it was kept (a cluster replica
    # gone or full) and was rebuilt elsewhere from the stored codes; the seek ack reports it.
    rebuilt: bool

    def __aiter__(self) -> AsyncIterator[TakeEvent]: ...

    def cancel(self, reason: EndReason = EndReason.CANCELLED) -> None:
        """Stop at the next step boundary; the iterator then yields TakeFinished(reason)."""


class EngineStatus(StrEnum):
    """Where an engine is in its life (``/api/info``; ``/readyz`` answers 200 only while READY)."""

    LOADING = "loading"  # loading weights (or, for a cluster, waiting for a ready replica)
    WARMING_UP = "warming up"  # loaded; capturing graphs and running warm-up takes
    READY = "ready"  # takes are admitted
    FAILED = "failed"  # it could not start (the service's failure says why)
    STOPPED = "stopped"  # closed


class ReplicaState(StrEnum):
    """One replica of a cluster as its router sees it (``/api/info`` → ``replicas[].status``)."""

    LOADING = "loading"  # answering, its engine not ready yet
    READY = "ready"  # answering and ready: takes are routed to it
    FAILED = "failed"  # answering, its engine failed to start
    UNREACHABLE = "unreachable"  # did not answer its last status poll (or none yet): nothing is routed to it
    LOST = "lost"  # seen dying: its takes ended ``replica_lost``; routed to again once a poll finds it ready


@dataclass(frozen=True)
class ReplicaInfo:
    """One engine replica of a cluster, for ``/api/info`` and ``/readyz`` (docs/cluster.md)."""

    name: str
    state: ReplicaState
    active: int = 0  # takes running on it (last poll)
    queued: int = 0
    capacity: int = 0  # slots + queue places
    device: str = ""
    node: str = ""
    pid: int = 0
    restarts: int = 0  # new incarnations the router saw after the first
    error: str | None = None  # why its engine failed to start

    @property
    def ready(self) -> bool:
        """Takes are routed to it."""
        return self.state is ReplicaState.READY

    def to_dict(self) -> dict[str, object]:
        """Its JSON form in ``/api/info``."""
        return {
            "name": self.name,
            "ready": self.ready,
            "status": self.state.value,
            "active": self.active,
            "queued": self.queued,
            "capacity": self.capacity,
            "device": self.device,
            "node": self.node,
            "pid": self.pid,
            "restarts": self.restarts,
            **({"error": self.error} if self.error else {}),
        }


@dataclass(frozen=True)
class EngineInfo:
    name: str  # "moss" or "scripted"
    models: tuple[str, ...]
    default_model: str
    demo: bool  # True when serving a tiny random-weight model (noise)
    device: str
    details: dict[str, str] = field(default_factory=dict)  # what it runs, for people (model, codec, dtype...)
    status: EngineStatus = EngineStatus.LOADING
    metrics: CollectorRegistry | None = None  # rendered by GET /metrics; None: no engine metrics
    replicas: tuple[ReplicaInfo, ...] = ()  # a cluster's replicas; empty otherwise
    codebook_size: int = CODEBOOK_SIZE  # codes lie in [0, codebook_size): what stored or imported codes are held to
    memory_plan: MemoryPlan | None = None  # the start-up memory plan (the real engine, once made)

    @property
    def ready(self) -> bool:
        """Loaded and warmed up: takes are admitted."""
        return self.status is EngineStatus.READY


class Engine(Protocol):
    """The seam (see the module docstring)."""

    @property
    def info(self) -> EngineInfo: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    async def submit(self, spec: TakeSpec) -> TakeHandle:
        """Admit a take (raises EngineBusy when full, ProtocolError when the request cannot fit).

        Cancel-safe: a submit cancelled before it returns has admitted nothing (engines do their
        awaiting before they enqueue), so a closing connection may cancel a run mid-admission."""

    async def render(self, codes: np.ndarray, channels: int) -> bytes:
        """Decode stored codes [N, 12] to int16 PCM (replay and downloads)."""

    async def encode_reference(self, audio: bytes) -> np.ndarray:
        """Encode an uploaded voice (any soundfile-readable bytes) to codes [T, 12]."""


class EngineLifecycle:
    """``async with engine`` for engines written with ``start()`` and ``close()``."""

    async def start(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
