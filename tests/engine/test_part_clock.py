"""PartClock: the parts of engine-thread work land in their own metric, engine by engine (its labelled children are
looked up once per metric and part, so a second engine's registry must not receive the first one's laps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from moss_rt.engine.metrics import PartClock


def _metrics() -> tuple[CollectorRegistry, Histogram, Counter]:
    registry = CollectorRegistry()
    time = Histogram("part_seconds", "parts", ["part"], registry=registry)
    cpu = Counter("part_cpu_seconds", "parts' CPU", ["part"], registry=registry)
    return registry, time, cpu


def test_each_clock_records_into_its_own_registry_by_part() -> None:
    first, second = _metrics(), _metrics()
    clock = PartClock(first[1], first[2])
    clock.lap("match")
    clock.lap("room")
    clock.lap("match")
    other = PartClock(second[1], second[2])
    other.lap("room")

    def count(reg: CollectorRegistry, part: str) -> float | None:
        return reg.get_sample_value("part_seconds_count", {"part": part})

    assert count(first[0], "match") == 2 and count(first[0], "room") == 1
    assert count(second[0], "room") == 1 and count(second[0], "match") is None
    assert first[0].get_sample_value("part_cpu_seconds_total", {"part": "match"}) is not None
