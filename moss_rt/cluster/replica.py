"""One engine replica: the single-process engine, run inside a Ray actor (one per GPU).

This module is plain Python (it never imports Ray): :mod:`moss_rt.cluster.launch` wraps
:class:`EngineReplica` with ``ray.remote`` when it creates the actors, so the replica can be
unit-tested as an object. Everything that crosses the process boundary is a small picklable
value; engine exceptions are returned as :class:`Refusal` values, because exceptions whose
``__init__`` takes other arguments than their message do not survive pickling intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import generate_latest

from moss_rt.config import Settings
from moss_rt.engine.base import (
    EndReason,
    Engine,
    EngineBusy,
    EngineInfo,
    EngineStatus,
    TakeEvent,
    TakeHandle,
    TakeSpec,
)
from moss_rt.engine.factory import build_local_engine
from moss_rt.engine.kept_digests import DigestDelta, KeptDigests
from moss_rt.engine.prompt_names import PromptRecipe
from moss_rt.logging_setup import setup_logging
from moss_rt.protocol import ErrorCode, ProtocolError

log = logging.getLogger(__name__)

# Audio one stream item may carry: items below Ray's inline limit (100 KiB, max_direct_call_object_size)
# travel inside the reply; larger ones would go through the object store. One chunk always goes.
RELAY_BATCH_BYTES = 80 * 1024


@dataclass(frozen=True)
class Refusal:
    """Why a replica did not do what it was asked (re-raised as the same exception by the router)."""

    kind: str  # "busy" | "protocol"
    message: str
    retry_after_sec: float = 1.0
    code: str = ErrorCode.INTERNAL.value
    field: str | None = None

    @staticmethod
    def of(exc: Exception) -> Refusal:
        if isinstance(exc, EngineBusy):
            return Refusal("busy", str(exc), retry_after_sec=exc.retry_after_sec)
        if isinstance(exc, ProtocolError):
            return Refusal("protocol", exc.message, code=exc.code.value, field=exc.field)
        raise exc

    def exception(self) -> Exception:
        if self.kind == "busy":
            return EngineBusy(retry_after_sec=self.retry_after_sec)
        return ProtocolError(ErrorCode(self.code), self.message, field=self.field)


@dataclass(frozen=True)
class Admitted:
    """First item of every take stream that the replica's engine accepted."""

    take_id: str


@dataclass(frozen=True)
class ReplicaStatus:
    """What the router needs to route (polled about twice a second)."""

    name: str
    incarnation: str  # new after every (re)start: caches held by an earlier one are gone
    state: EngineStatus  # LOADING (warming up included), READY or FAILED
    active: int
    queued: int
    capacity: int  # slots + queue places
    pid: int
    node: str
    info: EngineInfo | None = None
    error: str | None = None
    extra: dict[str, str] = field(default_factory=dict)
    # The prompt blocks its engine keeps, as changes since the poller's cursor (None: the engine keeps none).
    prompt_blocks: DigestDelta | None = None
    slots: int = 0  # takes it generates at once (0: unknown)

    @property
    def ready(self) -> bool:
        return self.state is EngineStatus.READY

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.active - self.queued)


def writable(spec: TakeSpec) -> TakeSpec:
    """Ray hands numpy arrays over read-only (zero copy); the engine owns its own copies."""
    changes: dict[str, Any] = {
        name: np.array(value, dtype=np.int64)
        for name in ("prefix_codes", "reference_codes")
        if (value := getattr(spec, name)) is not None
    }
    return dataclasses.replace(spec, **changes) if changes else spec


class EngineReplica:
    """Owns one engine on this worker process; starts it on the first call that needs it.

    Ray restarts a killed replica by constructing it again, so the engine cannot be started in
    ``__init__`` (no event loop there); the router's status poll starts it instead.
    """

    def __init__(self, settings: Settings, name: str) -> None:
        self._settings = settings
        self._name = name
        self._incarnation = uuid.uuid4().hex[:12]
        self._engine: Engine | None = None
        self._starting: asyncio.Task[None] | None = None
        self._error: str | None = None
        self._takes: dict[str, TakeHandle] = {}

    # -- lifecycle ----------------------------------------------------------------------

    def _ensure_started(self) -> asyncio.Task[None]:
        if self._starting is None:
            setup_logging(self._settings.log_level)
            self._engine = build_local_engine(self._settings)
            self._starting = asyncio.get_running_loop().create_task(self._start(), name=f"{self._name}-start")
        return self._starting

    async def _start(self) -> None:
        assert self._engine is not None
        try:
            await self._engine.__aenter__()
            log.info("replica %s (%s) ready on %s", self._name, self._incarnation, self._engine.info.device)
        except Exception as exc:
            self._error = f"{type(exc).__name__}: {exc}"
            log.exception("replica %s failed to start", self._name)

    async def start(self) -> ReplicaStatus:
        """Start the engine and wait until it is loaded (or failed)."""
        await asyncio.shield(self._ensure_started())
        return await self.status()

    async def status(self, since: tuple[str, int] | None = None) -> ReplicaStatus:
        """State for routing; with ``since`` (a router's cursor) also the prompt blocks kept or given back."""
        self._ensure_started()
        engine = self._engine
        kept: KeptDigests | None = getattr(engine, "kept_prompts", None)
        info = engine.info if engine is not None else None
        s = self._settings
        if self._error:
            state = EngineStatus.FAILED
        else:
            state = EngineStatus.READY if info is not None and info.ready else EngineStatus.LOADING
        # The engine's memory plan decides its slots when --max-slots is 0 (the default).
        plan = None if info is None else info.memory_plan
        slots = plan.max_slots if plan is not None else s.max_slots
        return ReplicaStatus(
            name=self._name,
            incarnation=self._incarnation,
            state=state,
            active=int(getattr(engine, "active_count", 0)),
            queued=int(getattr(engine, "queued_count", 0)),
            capacity=slots + s.max_queue,
            pid=os.getpid(),
            node=socket.gethostname(),
            # Without the registry: it stays here (metrics_text renders it) and does not pickle.
            info=dataclasses.replace(info, metrics=None) if info is not None else None,
            error=self._error,
            prompt_blocks=kept.since(*since) if kept is not None and since is not None else None,
            slots=slots,
        )

    async def prompt_recipe(self) -> PromptRecipe | None:
        """What a front end needs to name prompt blocks as this engine keeps them (None: no prompt cache)."""
        engine = await self._ready_engine()
        recipe = getattr(engine, "prompt_recipe", None)
        # A real tokenizer's JSON takes a while to write: not on the loop that streams takes.
        return None if recipe is None else await asyncio.to_thread(recipe)

    async def close(self) -> None:
        if self._engine is not None:
            await self._engine.__aexit__(None, None, None)

    # -- takes --------------------------------------------------------------------------

    async def run_take(self, spec: TakeSpec) -> AsyncIterator[Admitted | Refusal | tuple[TakeEvent, ...]]:
        """Stream one take: ``Admitted`` (or a ``Refusal`` and nothing else), then its events in order, in
        tuples of one or more (what was queued when the front end took the previous item).

        Called as a Ray streaming generator with backpressure: while the front end has not read
        its chunks, this generator does not read the engine's channel, so the engine pauses the
        take exactly as it pauses a slow local client.
        """
        await asyncio.shield(self._ensure_started())
        engine = self._engine
        assert engine is not None
        try:
            handle = await engine.submit(writable(spec))
        except (EngineBusy, ProtocolError) as exc:
            yield Refusal.of(exc)
            return
        self._takes[spec.take_id] = handle
        try:
            yield Admitted(spec.take_id)
            # If the front end goes away (or cancels this stream), this iteration is abandoned and
            # the handle cancels its take: it never runs for nobody.
            batches = getattr(handle, "batches", None)
            if batches is None:
                async for event in handle:
                    yield (event,)
            else:
                # Events that piled up while the front end had not asked for more travel as one item:
                # every item costs the front end the same, whatever it carries (docs/cluster.md).
                async for batch in batches(RELAY_BATCH_BYTES):
                    yield tuple(batch)
        finally:
            self._takes.pop(spec.take_id, None)

    async def cancel_take(self, take_id: str, reason: str) -> bool:
        handle = self._takes.get(take_id)
        if handle is None:
            return False
        handle.cancel(EndReason(reason))
        return True

    # -- non-streaming work ---------------------------------------------------------------

    async def render(self, codes: np.ndarray, channels: int) -> bytes | Refusal:
        engine = await self._ready_engine()
        try:
            return await engine.render(np.array(codes, dtype=np.int64), channels)
        except (EngineBusy, ProtocolError) as exc:
            return Refusal.of(exc)

    async def encode_reference(self, audio: bytes) -> np.ndarray | Refusal:
        engine = await self._ready_engine()
        try:
            return await engine.encode_reference(audio)
        except (EngineBusy, ProtocolError) as exc:
            return Refusal.of(exc)

    async def metrics_text(self) -> bytes:
        """The engine's own Prometheus registry, rendered (the router relabels it per replica)."""
        registry = self._engine.info.metrics if self._engine is not None else None
        return b"" if registry is None else generate_latest(registry)

    async def _ready_engine(self) -> Engine:
        with contextlib.suppress(Exception):
            await asyncio.shield(self._ensure_started())
        if self._engine is None:
            raise RuntimeError("replica engine was not built")
        return self._engine
