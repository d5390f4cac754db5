"""The engine bench reads the engine's own /metrics series: renamed or relabelled metrics must not leave its
per-step breakdowns silently empty (bench/engine_bench.py ``round_phases``, ``codec_by_shape``)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from moss_rt.engine.metrics import EngineMetrics
from tests.engine.helpers import bench_module


@pytest.fixture(scope="module")
def engine_bench():
    with bench_module("engine_bench.py") as module:
        yield module


def snapshot(metrics: EngineMetrics, engine_bench) -> dict[str, float]:
    return engine_bench.parse_metrics(generate_latest(metrics.registry).decode())


def test_round_phases_per_step_from_the_engines_series(engine_bench) -> None:
    metrics = EngineMetrics()
    before = snapshot(metrics, engine_bench)
    for _ in range(4):  # four rounds: a 15 ms step (9 ms of it the thread's CPU) and a 1 ms flush each
        metrics.round_phase_time.labels("step").observe(0.015)
        metrics.round_phase_cpu.labels("step").inc(0.009)
        metrics.round_phase_time.labels("flush").observe(0.001)
        metrics.round_phase_cpu.labels("flush").inc(0.0005)
    after = snapshot(metrics, engine_bench)

    phases = engine_bench.round_phases(lambda name: after.get(name, 0.0) - before.get(name, 0.0), after, 4.0)

    assert phases == {
        "flush": {"wall_ms_per_step": 1.0, "cpu_ms_per_step": 0.5},
        "step": {"wall_ms_per_step": 15.0, "cpu_ms_per_step": 9.0},
    }


def test_codec_by_shape_from_the_engines_series(engine_bench) -> None:
    metrics = EngineMetrics()
    before = snapshot(metrics, engine_bench)
    for _ in range(2):
        metrics.codec_shape_time.labels("8", "1").observe(0.060)
    metrics.codec_shape_time.labels("1", "0").observe(0.020)
    after = snapshot(metrics, engine_bench)

    shapes = engine_bench.codec_by_shape(lambda name: after.get(name, 0.0) - before.get(name, 0.0), after, 10.0)

    assert shapes == {
        "T=1 eager": {"calls": 1.0, "ms_per_call": 20.0, "ms_per_step": 2.0},
        "T=8 graph": {"calls": 2.0, "ms_per_call": 60.0, "ms_per_step": 12.0},
    }


def test_first_audio_parts_name_what_the_engines_end_frame_carries(engine_bench) -> None:
    """The bench's parts of a take's first audio are the ones the engine reports (a renamed part would read as
    missing in the bench, not fail it), and a burst's summary is each part's p50 / p95 over the takes. The parts
    after the take starts running come from the scheduler's own ``first_audio_path``; the three before it are named
    where the scheduler ends a take, and are listed here."""
    from types import SimpleNamespace

    from moss_rt.engine.scheduler import first_audio_path

    marks = SimpleNamespace(running_at=1.0, first_frame_at=1.010, first_chunk_at=1.011, first_decode_at=1.013,
                            first_audio=1.020)
    reported = {"prompt_ms", "queue_ms", "prefill_ms"} | set(first_audio_path(marks))  # the end's timings
    assert set(engine_bench.FIRST_AUDIO_PATH) == reported

    paths = [{"queue_ms": float(ms), "decode_ms": 7.0} for ms in range(1, 101)]
    parts = engine_bench.first_audio_parts(paths)
    assert parts["queue_ms"] == pytest.approx([50.5, 95.05])
    assert parts["decode_ms"] == [7.0, 7.0]
    assert all(v != v for v in parts["prefill_ms"])  # no take had it: NaN, not 0
