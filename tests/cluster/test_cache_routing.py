"""Cache-aware routing through the real router (``ClusterEngine.submit``) over recording replicas (no Ray cluster):
lines of one voice and direction land together, and a hot replica spills over once it is too busy.

Each stand-in replica records the takes it is given and admits them; nothing ever finishes and no poll runs, so a
replica's load is exactly the takes routed to it (the router counts them as sent since its last poll). Prompt
blocks are named by the tiny model's real tokenizer, as a front end names them from a replica's recipe.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from moss_rt.cluster.replica import Admitted, ReplicaStatus
from moss_rt.cluster.router import ClusterEngine, Reach, ReplicaView
from moss_rt.config import Settings
from moss_rt.engine.base import EngineStatus, TakeSpec
from moss_rt.engine.kept_digests import KeptDigests
from moss_rt.engine.prompt_names import PromptNamer, PromptRecipe
from moss_rt.model.tiny import build_tiny_tokenizer_json, tiny_config

pytest.importorskip("ray")  # the router names Ray's errors (it never starts Ray here)

TIRED = "Tired, slow, a little hoarse; pauses between the sentences."
BRIGHT = "Bright and quick, almost laughing."
LINES = [
    "It was late, and the house was quiet.",
    "Nobody answered the door.",
    "She knocked again, louder this time.",
    "A light came on upstairs.",
    "Footsteps on the stairs, slow ones.",
    "The door opened an inch.",
    "Who is it, said a voice.",
    "Only me, she said.",
]


class _Ref:
    """An object ref that is already there."""

    def __init__(self, value: object) -> None:
        self._value = value

    def __await__(self) -> Iterator[Any]:
        async def get() -> object:
            return self._value

        return get().__await__()


class _Stream:
    """A take's stream that admits it (a round trip later, as a replica would) and then stays open (the take keeps
    running)."""

    def __init__(self, take_id: str) -> None:
        self._first: Admitted | None = Admitted(take_id)

    async def __anext__(self) -> _Ref:
        if self._first is None:
            await asyncio.Event().wait()
        await asyncio.sleep(0.01)
        first, self._first = self._first, None
        return _Ref(first)


class _Method:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def options(self, **_: object) -> _Method:
        return self

    def remote(self, *args: object) -> object:
        return self._fn(*args)


class RecordingReplica:
    """Stands in for a replica actor: records every take routed to it."""

    def __init__(self) -> None:
        self.takes: list[str] = []
        self.run_take = _Method(self._run)
        self.cancel_take = _Method(lambda *_: None)

    def _run(self, spec: TakeSpec) -> _Stream:
        self.takes.append(spec.take_id)
        return _Stream(spec.take_id)


def recording_router(margin: int, replicas: int = 2) -> tuple[ClusterEngine, dict[str, RecordingReplica]]:
    router = ClusterEngine(Settings(cluster="auto", route_cache_margin=margin))
    actors = {f"replica-{i}": RecordingReplica() for i in range(replicas)}
    for name, actor in actors.items():
        view = ReplicaView(name, actor, reach=Reach.ANSWERING)
        view.status = ReplicaStatus(name, f"{name}-1", EngineStatus.READY, 0, 0, 16, 1, "node", slots=8)
        view.prompts.apply(KeptDigests().since())  # each reported an empty cache
        router._replicas.append(view)
    config = tiny_config()
    router._namer = PromptNamer(PromptRecipe(build_tiny_tokenizer_json(config), config, 16))
    return router, actors


_ids = itertools.count()


def line(instruction: str, i: int) -> TakeSpec:
    return TakeSpec(f"{instruction[:5]}-{i}-{next(_ids)}", text=LINES[i % len(LINES)], instruction=instruction)


def placed(actors: dict[str, RecordingReplica], take_id: str) -> str:
    return next(name for name, actor in actors.items() if take_id in actor.takes)


def prompt_routes(router: ClusterEngine) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for metric in router._metrics.collect():
        for sample in metric.samples:
            if sample.name == "moss_rt_cluster_prompt_routes_total":
                out[(sample.labels["replica"], sample.labels["match"])] = sample.value
    return out


def idle(router: ClusterEngine) -> None:
    """A poll found every replica idle again (the takes routed so far ended)."""
    for view in router._replicas:
        view.pending = 0


def test_lines_of_one_voice_and_direction_land_together() -> None:
    """Two directions, their lines in an uneven order, every take over before the next (loads stay equal): each
    direction's lines all go to one replica. Routing by load alone takes turns and scatters them."""
    order = [TIRED, TIRED, TIRED, BRIGHT, BRIGHT, TIRED, BRIGHT, TIRED, TIRED, BRIGHT, BRIGHT, BRIGHT]

    async def run(margin: int) -> tuple[dict[str, set[str]], ClusterEngine]:
        router, actors = recording_router(margin)
        where: dict[str, set[str]] = {TIRED: set(), BRIGHT: set()}
        for i, instruction in enumerate(order):
            spec = line(instruction, i)
            await router.submit(spec)
            where[instruction].add(placed(actors, spec.take_id))
            idle(router)
        return where, router

    where, router = asyncio.run(run(margin=2))
    assert len(where[TIRED]) == 1 and len(where[BRIGHT]) == 1, where
    routes = prompt_routes(router)
    # Each direction's first line held nowhere (miss); every later one found its direction where it went (hit).
    assert sum(v for (_, match), v in routes.items() if match == "miss") == 2
    assert sum(v for (_, match), v in routes.items() if match == "hit") == len(order) - 2
    assert not any(match == "spill" for _, match in routes)

    by_load, _ = asyncio.run(run(margin=-1))
    assert len(by_load[TIRED]) == 2 and len(by_load[BRIGHT]) == 2, by_load


def test_a_burst_of_one_directions_lines_lands_together() -> None:
    """Lines of one direction arriving at once (each admission still on its way when the next is routed) follow
    the first one, up to the margin; a burst of another direction, at the same time, goes to the other replica."""

    async def run() -> None:
        router, actors = recording_router(margin=3)
        tired = [line(TIRED, i) for i in range(4)]
        bright = [line(BRIGHT, i) for i in range(4)]
        mixed = [tired[0], tired[1], tired[2], bright[0], bright[1], tired[3], bright[2], bright[3]]
        await asyncio.gather(*(router.submit(spec) for spec in mixed))
        assert len({placed(actors, s.take_id) for s in tired}) == 1
        assert len({placed(actors, s.take_id) for s in bright}) == 1
        assert placed(actors, tired[0].take_id) != placed(actors, bright[0].take_id)

    asyncio.run(run())


def test_a_hot_replica_spills_over_past_the_margin() -> None:
    """Lines of one direction keep arriving and none ends: the replica holding the direction gets them until it
    is more than ``margin`` takes above the other; then the other gets one (a spill), keeps the direction too,
    and from there the two share the lines, never more than the margin apart."""
    margin = 2

    async def run() -> None:
        router, actors = recording_router(margin)
        homes = []
        for i in range(12):
            spec = line(TIRED, i)
            await router.submit(spec)
            homes.append(placed(actors, spec.take_id))
            loads = [len(a.takes) for a in actors.values()]
            assert max(loads) - min(loads) <= margin + 1, loads
        hot = homes[0]
        assert homes[: margin + 1] == [hot] * (margin + 1)
        cold = homes[margin + 1]
        assert cold != hot
        routes = prompt_routes(router)
        assert routes[(cold, "spill")] == 1 and routes[(hot, "miss")] == 1
        assert routes[(hot, "hit")] >= margin
        assert routes.get((cold, "hit"), 0) >= 1  # later lines found the direction on the cold replica too
        assert len(actors[cold].takes) >= 12 // 2 - margin

    asyncio.run(run())
