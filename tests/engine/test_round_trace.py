"""--round-trace: a JSON line per scheduling round that adds up to what the engine did; bounded; never fatal."""

from __future__ import annotations

from pathlib import Path

from moss_rt.engine.round_trace import RoundTrace, read_trace
from tests.engine.harness import drive, engine_settings, loaded_engine, spec


def test_the_rounds_add_up_to_the_takes_steps_and_prefill(tiny_data_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "trace" / "rounds.jsonl"
    settings = engine_settings(tiny_data_dir, overlap=True, round_trace=str(path))
    with loaded_engine(settings) as engine:
        sched = engine._scheduler
        assert sched is not None and sched.trace is not None
        steps_before = sched.steps
        prefilled = engine.metrics.registry.get_sample_value("moss_rt_prompt_rows_total", {"source": "prefill"}) or 0
        drive(engine, [spec("a", 1, 12, 4), spec("b", 2, 9, 3, text="Another line, said slowly.")])
        steps = sched.steps - steps_before
        rows = (engine.metrics.registry.get_sample_value("moss_rt_prompt_rows_total", {"source": "prefill"})
                or 0) - prefilled
    rounds = read_trace(path)  # the engine closed: every line is out (the warm-up's rounds too)
    assert sum(r["admitted"] for r in rounds) >= 2
    assert sum(r["steps"] for r in rounds) >= steps > 0
    assert sum(r["rows"] for r in rounds) >= rows > 0
    assert all(set(r["parts"]) >= {"control", "step", "flush", "admit", "prepare"} for r in rounds)
    assert all(r["ms"] >= 0 and r["gc_ms"] >= 0 and r["batch"] <= 2 for r in rounds)
    assert [r["t"] for r in rounds] == sorted(r["t"] for r in rounds)


def test_a_trace_stops_at_its_size_bound_and_an_unwritable_one_is_skipped(tmp_path: Path) -> None:
    trace = RoundTrace(tmp_path / "small.jsonl", max_bytes=200)
    for i in range(20):
        trace.record({"t": float(i), "ms": 1.0})
    assert not trace.active and trace.written <= 200
    lines = (tmp_path / "small.jsonl").read_text().splitlines()
    assert "stopped" in lines[-1]
    assert [r["t"] for r in read_trace(tmp_path / "small.jsonl")] == [float(i) for i in range(len(lines) - 1)]
    (tmp_path / "file").write_text("")
    blocked = RoundTrace(tmp_path / "file" / "rounds.jsonl")  # its folder is a file
    assert not blocked.active
    blocked.record({"t": 0.0})  # nothing, no error
