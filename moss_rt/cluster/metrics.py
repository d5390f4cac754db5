"""One ``/metrics`` for the cluster: every replica's engine series, labelled ``replica="NAME"``,
plus per-replica state gauges. The replicas' text is fetched by the router's poll (a collector
cannot await), so a scrape shows numbers at most one poll old.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from moss_rt.cluster.router import ReplicaView

log = logging.getLogger(__name__)


class ReplicaCollector(Collector):
    def __init__(self, replicas: Callable[[], Sequence[ReplicaView]]) -> None:
        self._replicas = replicas

    def describe(self) -> Iterable[Metric]:
        return []  # families depend on what the replicas report

    def collect(self) -> Iterable[Metric]:
        replicas = list(self._replicas())
        families: dict[str, Metric] = {}
        for replica in replicas:
            try:
                parsed = list(text_string_to_metric_families(replica.metrics_text.decode()))
            except ValueError:
                log.warning("unreadable metrics from replica %s", replica.name)
                continue
            for fam in parsed:
                out = families.get(fam.name)
                if out is None:
                    out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for sample in fam.samples:
                    out.samples.append(sample._replace(labels={**sample.labels, "replica": replica.name}))
        yield from families.values()
        ready = GaugeMetricFamily("moss_rt_replica_ready", "1 while the replica is routed to", labels=["replica"])
        restarts = GaugeMetricFamily("moss_rt_replica_restarts", "Restarts of the replica seen by this front end",
                                     labels=["replica"])
        free = GaugeMetricFamily("moss_rt_replica_free_places", "Slots + queue places left (last poll)",
                                 labels=["replica"])
        prompts = GaugeMetricFamily(
            "moss_rt_replica_prompt_blocks", "Prompt blocks the replica reported keeping (cache-aware routing)",
            labels=["replica"],
        )
        for replica in replicas:
            ready.add_metric([replica.name], 1.0 if replica.routable else 0.0)
            restarts.add_metric([replica.name], float(replica.restarts))
            free.add_metric([replica.name], float(max(0, replica.candidate().free)))
            prompts.add_metric([replica.name], float(len(replica.prompts)))
        yield ready
        yield restarts
        yield free
        yield prompts
