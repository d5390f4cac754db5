"""``ClusterEngine``: the engine seam over a set of Ray replicas, so ``web/`` serves a cluster unchanged.

The front end (the aiohttp app) holds one of these instead of a local engine. It polls every
replica's status about twice a second (readiness, load, process incarnation, the prompt blocks its
cache keeps, metrics), routes each take by :mod:`moss_rt.cluster.routing`, and turns a replica's
death into a ``replica_lost`` end for exactly the takes that ran on it. Nothing is routed to a
replica that is loading, did not answer its last poll, or was seen dying, until a poll finds it
ready again (Ray restarts it).

Cache-aware routing names each take's prompt blocks here, without the model: the first ready
replica hands over a :class:`~moss_rt.engine.prompt_names.PromptRecipe` (tokenizer, config, block
size) and a :class:`~moss_rt.engine.prompt_names.PromptNamer` computes the same digests the
replicas' prompt caches keep (docs/cluster.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import os
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter

from moss_rt.cluster.affinity import HeldPrompts
from moss_rt.cluster.metrics import ReplicaCollector
from moss_rt.cluster.remote_take import RemoteTake
from moss_rt.cluster.replica import Admitted, Refusal, ReplicaStatus
from moss_rt.cluster.routing import Candidate, Route, plan_routes
from moss_rt.config import Settings
from moss_rt.engine.base import (
    EndReason,
    EngineBusy,
    EngineInfo,
    EngineLifecycle,
    EngineStatus,
    ReplicaInfo,
    ReplicaState,
    TakeSpec,
)
from moss_rt.engine.prompt_names import NamedPrompt, PromptNamer, PromptRecipe
from moss_rt.protocol import DEFAULT_MODEL_ALIAS

log = logging.getLogger(__name__)

POLL_SEC = 0.5  # status (and metrics) poll period per replica
STATUS_TIMEOUT_SEC = 5.0  # a replica that does not answer a poll this long is not routed to
BACKPRESSURE_ITEMS = 8  # chunks a replica may stream ahead of what the front end has read
HOLDERS_KEPT = 65536  # take -> replica entries remembered for sticky retakes
ADMIT_TIMEOUT_SEC = 30.0  # a replica that neither admits nor refuses a take this long is passed over
# An answering replica's state, from what its engine reported.
_REPLICA_STATES = {
    EngineStatus.LOADING: ReplicaState.LOADING,
    EngineStatus.WARMING_UP: ReplicaState.LOADING,
    EngineStatus.READY: ReplicaState.READY,
    EngineStatus.FAILED: ReplicaState.FAILED,
    EngineStatus.STOPPED: ReplicaState.UNREACHABLE,
}


class Reach(enum.Enum):
    """Whether the router hears from a replica."""

    ANSWERING = "answering"  # answered its last status poll
    SILENT = "silent"  # did not answer its last poll (or none yet): slow, unreachable or starting
    LOST = "lost"  # seen dying (its process, or a take's stream, broke); until a poll answers again


@dataclass
class ReplicaView:
    """The router's knowledge of one replica."""

    name: str
    actor: Any
    status: ReplicaStatus | None = None  # what its last answered poll said
    reach: Reach = Reach.SILENT
    pending: int = 0  # takes sent since the last status
    restarts: int = 0  # new incarnations seen after the first
    lost: asyncio.Event = field(default_factory=asyncio.Event)  # set when this incarnation is gone
    metrics_text: bytes = b""
    prompts: HeldPrompts = field(default_factory=HeldPrompts)  # prompt blocks it keeps (cache-aware routing)

    @property
    def incarnation(self) -> str:
        return "" if self.status is None else self.status.incarnation

    @property
    def state(self) -> ReplicaState:
        if self.reach is Reach.LOST:
            return ReplicaState.LOST
        if self.reach is Reach.SILENT or self.status is None:
            return ReplicaState.UNREACHABLE
        return _REPLICA_STATES[self.status.state]

    @property
    def routable(self) -> bool:
        return self.state is ReplicaState.READY

    def candidate(self) -> Candidate:
        s = self.status
        free = 0 if s is None else s.free - self.pending
        load = self.pending + (0 if s is None else s.active + s.queued)
        idle = s.slots - load if s is not None and s.slots > 0 else None
        return Candidate(self.name, self.incarnation, self.routable, free, load, idle)

    def info(self) -> ReplicaInfo:
        s = self.status
        if s is None:
            return ReplicaInfo(self.name, self.state, restarts=self.restarts)
        return ReplicaInfo(
            self.name, self.state, active=s.active, queued=s.queued, capacity=s.capacity,
            device=s.info.device if s.info else "", node=s.node, pid=s.pid, restarts=self.restarts, error=s.error,
        )  # fmt: skip


class ClusterEngine(EngineLifecycle):
    """The Engine seam (see ``moss_rt.engine.base``) over Ray replicas: ``async with`` joins Ray and
    waits for a ready replica; leaving it stops watching (replicas stay up for other front ends)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._replicas: list[ReplicaView] = []
        self._holders: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._turn = 0
        self._owns_ray = False
        self._watch: asyncio.Task[None] | None = None
        self._metrics = CollectorRegistry(auto_describe=True)
        self._routes = Counter(
            "moss_rt_cluster_routes", "Takes routed, by route: new, sticky (to the parent's cache), rebuilt",
            ["route"], registry=self._metrics,
        )
        self._lost_takes = Counter(
            "moss_rt_cluster_lost_takes", "Takes ended because their replica was lost", ["replica"],
            registry=self._metrics,
        )
        self._prompt_routes = Counter(
            "moss_rt_cluster_prompt_routes",
            "New and rebuilt takes by the replica they went to and its prompt match: hit (it held the longest run "
            "of the take's prompt blocks any replica held), spill (another held more but was too busy), miss "
            "(no replica held any beyond the generic opening)",
            ["replica", "match"], registry=self._metrics,
        )
        self._prompt_rows = Counter(
            "moss_rt_cluster_prompt_rows_routed",
            "Prompt rows (beyond the generic opening) the replica was known to hold when a take went there",
            ["replica"], registry=self._metrics,
        )
        self._relay_items = Counter(
            "moss_rt_cluster_relay_items", "Stream items received from replicas (one relay hop each)",
            registry=self._metrics,
        )
        self._relay_chunks = Counter(
            "moss_rt_cluster_relay_chunks",
            "Audio chunks those items carried (more than one per item: events that piled up travelled together)",
            registry=self._metrics,
        )
        # Cache-aware routing: set once a ready replica handed over its prompt recipe (None: it has none).
        self._namer: PromptNamer | None = None
        self._recipe_task: asyncio.Task[None] | None = None  # asking a replica for it (one at a time)
        self._front_end = f"{socket.gethostname()}:{os.getpid()}"
        self._metrics.register(ReplicaCollector(lambda: self._replicas))

    # ------------------------------------------------------------------ seam: state
    @property
    def ready(self) -> bool:
        """At least one replica is routed to."""
        return any(r.routable for r in self._replicas)

    @property
    def info(self) -> EngineInfo:
        """The first ready replica's info, with the cluster's readiness, metrics and replica list."""
        statuses = [r.status for r in self._replicas if r.status is not None and r.status.info is not None]
        ready = [s for s in statuses if s.ready]
        base = next(iter(ready or statuses), None)
        cluster = {
            "cluster": self.settings.cluster or "auto",
            "replicas": str(len(self._replicas)),
            "replicas_ready": str(sum(r.routable for r in self._replicas)),
            "front_end": self._front_end,  # which front end answered (several may share a port)
            "cache_routing": "on" if self._namer is not None and self.settings.route_cache_margin >= 0 else "off",
        }
        replicas = tuple(r.info() for r in self._replicas)
        status = EngineStatus.READY if self.ready else EngineStatus.LOADING
        if base is None or base.info is None:
            return EngineInfo(
                name=self.settings.engine,
                models=(DEFAULT_MODEL_ALIAS,),
                default_model=DEFAULT_MODEL_ALIAS,
                demo=False,
                device="cluster",
                details=cluster,
                status=status,
                metrics=self._metrics,
                replicas=replicas,
            )
        info = base.info
        return dataclasses.replace(
            info,
            demo=any(s.info.demo for s in statuses if s.info is not None),
            details={**info.details, **cluster},
            status=status,
            metrics=self._metrics,
            replicas=replicas,
            memory_plan=None,  # each replica has its own (its slots are in its capacity)
        )

    def replica_of(self, take_id: str) -> str | None:
        """The replica a take was admitted on (as far as this front end remembers)."""
        holder = self._holders.get(take_id)
        return None if holder is None else holder[0]

    # ------------------------------------------------------------------ seam: lifecycle
    async def start(self) -> None:
        from moss_rt.cluster import launch

        self._owns_ray = await asyncio.to_thread(launch.connect, self.settings.cluster)
        handles = await asyncio.to_thread(launch.replica_handles, self.settings)
        self._replicas = [ReplicaView(name, actor) for name, actor in handles]
        # Loading starts on every replica at once; the first poll would start them too.
        for r in self._replicas:
            r.actor.start.remote()
        self._watch = asyncio.create_task(self._watch_replicas(), name="cluster-watch")
        while not self.ready:
            statuses = [r.status for r in self._replicas]
            if statuses and all(s is not None and s.state is EngineStatus.FAILED for s in statuses):
                errors = "; ".join(f"{s.name}: {s.error}" for s in statuses if s is not None)
                raise RuntimeError(f"every engine replica failed to start: {errors}")
            await asyncio.sleep(POLL_SEC / 2)
        log.info("cluster ready: %d/%d replicas", sum(r.routable for r in self._replicas), len(self._replicas))

    async def close(self) -> None:
        """Stop watching. Replicas stay up for other front ends; a Ray instance this process
        started itself goes down with it (and its replicas with it)."""
        for task in (self._watch, self._recipe_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._watch = self._recipe_task = None
        for r in self._replicas:
            r.lost.set()  # any take still streaming ends now instead of waiting on a gone cluster
        if self._owns_ray:
            import ray

            await asyncio.to_thread(ray.shutdown)

    # ------------------------------------------------------------------ seam: work
    async def submit(self, spec: TakeSpec) -> RemoteTake:
        holder = self._holders.get(spec.parent_take) if spec.parent_take else None
        named = await self._name_prompt(spec)
        now = time.monotonic()
        cached = {} if named is None else {r.name: r.prompts.specific_rows(named, now) for r in self._replicas}
        routes = plan_routes(
            [r.candidate() for r in self._replicas],
            retake=spec.parent_take is not None,
            holder=holder,
            turn=self._turn,
            cached=cached,
            margin=self.settings.route_cache_margin,
        )
        if not routes:
            raise EngineBusy(retry_after_sec=5.0)  # no replica ready (loading or restarting)
        refusal: Exception = EngineBusy(retry_after_sec=1.0)
        by_name = {r.name: r for r in self._replicas}
        for route in routes:
            replica = by_name[route.name]
            # Expected there from now on, not from its admission: the next line of a burst follows it.
            sticky = spec.parent_take is not None and not route.rebuilt  # to its parent's cache, not by prompt
            expected = replica.prompts.expect(named.keys, now) if named is not None and not sticky else []
            handle: RemoteTake | Exception | None = None
            try:
                handle = await self._try_submit(replica, spec, route.rebuilt)
            finally:
                if not isinstance(handle, RemoteTake):
                    replica.prompts.unexpect(expected)  # not there after all (refused, lost, or cancelled)
            if isinstance(handle, RemoteTake):
                self._turn = (self._replicas.index(replica) + 1) % len(self._replicas)
                kind = "new" if spec.parent_take is None else ("rebuilt" if route.rebuilt else "sticky")
                self._routes.labels(kind).inc()
                self._remember(spec.take_id, replica)
                if named is not None and kind != "sticky":
                    self._count_prompt_route(replica, route, cached)
                return handle
            if handle is not None:
                refusal = handle
                if not isinstance(handle, EngineBusy):
                    raise handle  # bad input is bad everywhere: no point asking the next replica
        raise refusal

    async def _name_prompt(self, spec: TakeSpec) -> NamedPrompt | None:
        """The take's prompt block keys, when routing is cache-aware (tokenizing runs on a helper thread)."""
        namer = self._namer
        if namer is None or self.settings.route_cache_margin < 0:
            return None
        try:
            return await asyncio.to_thread(namer.name, spec)
        except Exception as exc:  # bad input is the replica's to refuse, with its own message
            log.debug("take %s: prompt not named (%r); routed by load", spec.take_id, exc)
            return None

    def _relayed(self, chunks: int) -> None:
        self._relay_items.inc()
        if chunks:
            self._relay_chunks.inc(chunks)

    def _count_prompt_route(self, replica: ReplicaView, route: Route, cached: dict[str, int]) -> None:
        best = max(cached.values(), default=0)
        match = "miss" if best == 0 else ("hit" if route.cached_rows == best else "spill")
        self._prompt_routes.labels(replica.name, match).inc()
        self._prompt_rows.labels(replica.name).inc(route.cached_rows)

    async def _try_submit(self, replica: ReplicaView, spec: TakeSpec, rebuilt: bool) -> RemoteTake | Exception | None:
        """The take's handle, the replica's refusal, or None when the replica turned out dead."""
        from ray.exceptions import RayActorError

        incarnation = replica.incarnation
        lost = replica.lost
        replica.pending += 1
        stream = replica.actor.run_take.options(_generator_backpressure_num_objects=BACKPRESSURE_ITEMS).remote(spec)
        try:
            first = await asyncio.wait_for(self._first_item(stream), ADMIT_TIMEOUT_SEC)
        except (RayActorError, StopAsyncIteration):
            self._mark_lost(replica, incarnation)
            return None
        except TimeoutError:
            log.warning("replica %s did not admit take %s within %.0f s", replica.name, spec.take_id,
                        ADMIT_TIMEOUT_SEC)
            self._abandon(replica, stream, spec.take_id)
            return EngineBusy(retry_after_sec=1.0)
        except asyncio.CancelledError:
            # submit is cancel-safe: a take the replica admitted meanwhile must not run for nobody.
            self._abandon(replica, stream, spec.take_id)
            raise
        if isinstance(first, Refusal):
            replica.pending = max(0, replica.pending - 1)
            return first.exception()
        assert isinstance(first, Admitted), first
        return RemoteTake(
            take_id=spec.take_id,
            replica=replica.name,
            actor=replica.actor,
            stream=stream,
            lost=lost,
            start_frame=spec.start_frame,
            rebuilt=rebuilt,
            on_lost=lambda: self._take_lost(replica, incarnation),
            on_item=self._relayed,
        )

    @staticmethod
    def _abandon(replica: ReplicaView, stream: Any, take_id: str) -> None:
        """Give up a take stream before it was handed out: end the stream and the take on the replica."""
        import ray

        with contextlib.suppress(Exception):
            ray.cancel(stream)
        with contextlib.suppress(Exception):
            replica.actor.cancel_take.remote(take_id, EndReason.CANCELLED.value)

    @staticmethod
    async def _first_item(stream: Any) -> object:
        return await (await stream.__anext__())

    async def render(self, codes: np.ndarray, channels: int) -> bytes:
        return await self._call_any("render", np.asarray(codes, dtype=np.int64), channels)  # type: ignore[return-value]

    async def encode_reference(self, audio: bytes) -> np.ndarray:
        return await self._call_any("encode_reference", audio)  # type: ignore[return-value]

    async def _call_any(self, method: str, *args: object) -> object:
        """Run a stateless job (render, reference encode) on the least loaded ready replica; a
        replica that dies meanwhile is skipped and the next one asked."""
        from ray.exceptions import RayActorError

        for route in plan_routes([r.candidate() for r in self._replicas], turn=self._turn):
            replica = next(r for r in self._replicas if r.name == route.name)
            incarnation = replica.incarnation
            try:
                result = await getattr(replica.actor, method).remote(*args)
            except RayActorError:
                self._mark_lost(replica, incarnation)
                continue
            if isinstance(result, Refusal):
                raise result.exception()
            return result
        raise EngineBusy(retry_after_sec=5.0)

    # ------------------------------------------------------------------ bookkeeping
    def _remember(self, take_id: str, replica: ReplicaView) -> None:
        self._holders[take_id] = (replica.name, replica.incarnation)
        self._holders.move_to_end(take_id)
        while len(self._holders) > HOLDERS_KEPT:
            self._holders.popitem(last=False)

    def _take_lost(self, replica: ReplicaView, incarnation: str) -> None:
        self._lost_takes.labels(replica.name).inc()
        self._mark_lost(replica, incarnation)

    def _mark_lost(self, replica: ReplicaView, incarnation: str) -> None:
        """That incarnation of the replica is gone: end its takes, route nothing there until a poll
        finds it ready again."""
        if replica.incarnation != incarnation:
            return  # already replaced by a newer incarnation
        if replica.reach is not Reach.LOST:
            log.warning("replica %s lost (incarnation %s)", replica.name, incarnation)
        replica.reach = Reach.LOST
        replica.lost.set()

    # ------------------------------------------------------------------ polling
    async def _ask_recipe(self, replica: ReplicaView) -> None:
        """Get the prompt recipe from a ready replica (all run the same model). Asked until one answers;
        an answer of None (no prompt cache there) is final: the task stays, done, and nobody asks again."""
        try:
            recipe: PromptRecipe | None = await asyncio.wait_for(replica.actor.prompt_recipe.remote(), 60.0)
            self._namer = None if recipe is None else await asyncio.to_thread(PromptNamer, recipe)
        except Exception as exc:  # this replica died or timed out meanwhile: the next poll asks a ready one
            self._recipe_task = None
            log.warning("no prompt recipe from replica %s yet: %r", replica.name, exc)
            return
        if self._namer is None:
            log.info("cache-aware routing off: the replicas keep no prompt blocks (scripted engine or "
                     "--no-prompt-cache); takes are routed by load")
        else:
            log.info("cache-aware routing on (block size %d, margin %d takes)", self._namer.block_size,
                     self.settings.route_cache_margin)

    async def _watch_replicas(self) -> None:
        # One loop per replica: a slow or hung one does not delay what is known about the others.
        await asyncio.gather(*(self._watch_one(r) for r in self._replicas))

    async def _watch_one(self, replica: ReplicaView) -> None:
        while True:
            await self._poll(replica)
            await asyncio.sleep(POLL_SEC)

    async def _poll(self, replica: ReplicaView) -> None:
        from ray.exceptions import RayActorError

        t0 = time.monotonic()
        try:
            status: ReplicaStatus = await asyncio.wait_for(
                replica.actor.status.remote(replica.prompts.cursor), STATUS_TIMEOUT_SEC
            )
        except RayActorError:
            self._mark_lost(replica, replica.incarnation)
            return
        except (TimeoutError, Exception) as exc:  # slow or unreachable: not routed to, takes left alone
            if replica.reach is Reach.ANSWERING:
                log.warning("replica %s did not answer its status poll: %r", replica.name, exc)
                replica.reach = Reach.SILENT  # (one seen dying stays LOST)
            return
        previous = replica.incarnation
        if previous and status.incarnation != previous:
            # Restarted by Ray: whatever ran on the old process (and its caches) is gone.
            self._mark_lost(replica, previous)
            replica.prompts.forget()  # the new process keeps nothing yet
            replica.restarts += 1
            log.info("replica %s restarted (incarnation %s)", replica.name, status.incarnation)
        if replica.reach is Reach.LOST or replica.lost.is_set():
            # Answering again (restarted, or it was only unreachable): a fresh event for the takes
            # it gets from now on; the ones already told it was lost have ended.
            replica.lost = asyncio.Event()
        replica.status = status
        replica.reach = Reach.ANSWERING
        replica.pending = 0
        if status.prompt_blocks is not None:
            replica.prompts.apply(status.prompt_blocks)
        if status.ready and self._namer is None and self._recipe_task is None:
            # Its own task: a slow answer must not hold up this replica's polls.
            self._recipe_task = asyncio.create_task(self._ask_recipe(replica), name="cluster-prompt-recipe")
        if status.ready:
            with contextlib.suppress(Exception):
                budget = max(0.5, STATUS_TIMEOUT_SEC - (time.monotonic() - t0))
                replica.metrics_text = await asyncio.wait_for(replica.actor.metrics_text.remote(), budget)
