"""The garbage collector's pauses: timed by generation, and the start's objects frozen while the engine serves."""

from __future__ import annotations

import gc
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram

from moss_rt.config import Settings
from moss_rt.engine.gc_pauses import GcPauses
from moss_rt.engine.moss import MossEngine
from tests.helpers import run


def _count(histogram: Histogram, generation: str) -> float:
    return sum(
        s.value for m in histogram.collect() for s in m.samples
        if s.name.endswith("_count") and s.labels.get("generation") == generation
    )


def test_each_collection_is_timed_by_its_generation_while_installed() -> None:
    histogram = Histogram("pause", "test", ["generation"], registry=CollectorRegistry())
    pauses = GcPauses(histogram).install()
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        assert _count(histogram, "0") >= 1
        assert _count(histogram, "2") >= 2
    finally:
        pauses.uninstall()
    before = _count(histogram, "2")
    gc.collect(2)
    assert _count(histogram, "2") == before  # uninstalled: no longer called
    assert pauses._on_collect not in gc.callbacks


def test_a_ready_engine_has_frozen_its_start_and_gives_it_back_when_closed(tiny_data_dir: Path) -> None:
    settings = Settings(engine="moss", model="tiny", codec="tiny", device="cpu", data_dir=tiny_data_dir,
                        max_slots=2, max_queue=2, max_seq_len=256)
    engine = MossEngine(settings)

    async def scenario() -> tuple[int, float, int]:
        await engine.start()
        try:
            frozen = gc.get_freeze_count()
            gc.collect(2)  # a full collection now walks only what serving made
            full = engine.metrics.registry.get_sample_value("moss_rt_gc_pause_seconds_count", {"generation": "2"})
        finally:
            await engine.close()
        return frozen, full or 0.0, gc.get_freeze_count()

    frozen, full_collections, after = run(scenario())
    assert frozen > 10_000  # torch, the model, the app: far more than serving makes
    assert "start's objects out of the collector's way (gc.freeze)" in engine.startup.phases
    assert full_collections >= 1
    assert after == 0  # unfrozen at close: a closed engine's cycles are collected like any others


def test_the_gil_switch_interval_is_the_settings_while_the_engine_serves(tiny_data_dir: Path) -> None:
    """``--gil-switch-ms``: the process runs with that interval while the engine serves, and with its own again once
    it is closed; 0 leaves Python's own."""
    import sys

    own = sys.getswitchinterval()
    seen = {}
    for ms in (0.5, 0.0):
        settings = Settings(engine="moss", model="tiny", codec="tiny", device="cpu", data_dir=tiny_data_dir,
                            max_slots=2, max_queue=2, max_seq_len=256, gil_switch_ms=ms)
        engine = MossEngine(settings)

        async def scenario() -> float:
            await engine.start()  # noqa: B023 - awaited within this iteration
            try:
                return sys.getswitchinterval()
            finally:
                await engine.close()  # noqa: B023

        seen[ms] = run(scenario())
        assert sys.getswitchinterval() == own
    assert seen == {0.5: 0.0005, 0.0: own}
