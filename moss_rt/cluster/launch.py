"""Joining a Ray cluster and finding (or creating) the engine replicas: the only module that imports Ray
outside tests, besides the router's error handling.

Replicas are named, detached actors (``replica-0`` .. ``replica-N-1`` in the ``moss_rt`` namespace):
the first front end creates them, every later one (another process, another node) finds the
same actors by name, so any number of front ends serve one set of replicas. Ray restarts a
replica whose process dies (``max_restarts=-1``); a take that was running on it is not retried
(``max_task_retries=0``): its client is told the replica was lost.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from moss_rt.cluster.replica import EngineReplica
from moss_rt.config import Settings
from moss_rt.engine.memory_plan import MAX_AUTO_SLOTS

log = logging.getLogger(__name__)

NAMESPACE = "moss_rt"
REPLICA_PREFIX = "replica-"
# Ray actor calls in flight per replica: every streaming take holds one for its whole life.
EXTRA_CONCURRENCY = 64
# Ray settings of the front-end process (read when it joins; the environment may override them).
# When a replica's connection breaks, Ray waits this long for the cluster to confirm the death
# before failing the calls in flight (default 1 s); a lost replica must be reported within 2 s.
FRONT_END_RAY_ENV = {"RAY_timeout_ms_task_wait_for_death_info": "100"}


def connect(cluster: str) -> bool:
    """Join Ray; True when this call initialised Ray (the caller then shuts it down at exit).

    ``auto``: the cluster named by ``RAY_ADDRESS`` or the one ``ray start`` left on this machine,
    else a new local one; anything else is a cluster address (``HOST:PORT`` or ``ray://HOST:PORT``).
    """
    import ray

    if ray.is_initialized():
        return False
    for key, value in FRONT_END_RAY_ENV.items():
        os.environ.setdefault(key, value)
    address = None if cluster in ("", "auto") else cluster
    ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
    log.info("joined Ray cluster %s: %s", cluster or "auto", ray.cluster_resources())
    return True


def replica_count(settings: Settings) -> int:
    """``--replicas`` when given, else one per GPU in the cluster (one CPU replica without GPUs)."""
    import ray

    if settings.replicas > 0:
        return settings.replicas
    return max(1, int(ray.cluster_resources().get("GPU", 0)))


def replica_settings(settings: Settings) -> Settings:
    """What a replica runs: the same engine settings, as a single process, with absolute paths
    (a replica's working directory is Ray's, not the front end's)."""
    return dataclasses.replace(
        settings,
        cluster="",
        data_dir=settings.data_dir.resolve(),
        voices_dir=settings.voices_dir.resolve(),
    )


def wants_gpu(settings: Settings) -> bool:
    import ray

    if settings.device.startswith("cuda"):
        return True
    return settings.device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1


def replica_handles(settings: Settings) -> list[tuple[str, Any]]:
    """The named replica actors, created where missing (one GPU each when the engine runs on CUDA)."""
    import ray

    n = replica_count(settings)
    gpu = wants_gpu(settings)
    resources: dict[str, Any] = {"num_gpus": 1, "num_cpus": settings.replica_cpus} if gpu else {
        "num_cpus": settings.replica_cpus
    }
    remote_cls = ray.remote(EngineReplica)
    handles = []
    for i in range(n):
        name = f"{REPLICA_PREFIX}{i}"
        actor = remote_cls.options(
            name=name,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,
            max_task_retries=0,
            # max_slots 0: the replica's memory plan decides, at most MAX_AUTO_SLOTS.
            max_concurrency=(settings.max_slots or MAX_AUTO_SLOTS) + settings.max_queue + EXTRA_CONCURRENCY,
            **resources,
        ).remote(replica_settings(settings), name)
        handles.append((name, actor))
    log.info("%d engine replica(s) (%s)", n, "one GPU each" if gpu else f"{settings.replica_cpus:g} CPU each")
    return handles
