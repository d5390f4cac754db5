"""A prefill pass's measured cost kept in the data dir (engine/prefill_cost_record.py, issue 24): a later start with
the same setup reads it instead of timing passes again (0.45 s of an H200's second start), and sizes its passes the
same; another setup times its own; a file that cannot be read is said and written anew."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from moss_rt.engine.prefill_cost_record import FILE_NAME, MAX_ENTRIES, record_cost, recorded_cost, setup_key
from moss_rt.engine.prefill_pace import PrefillCost
from tests.engine.harness import engine_settings, loaded_engine


def test_a_cost_is_given_back_for_its_setup_only_and_the_latest_setups_are_kept(tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    h200, a10 = setup_key({"device": "NVIDIA H200", "slots": 128}), setup_key({"device": "NVIDIA A10", "slots": 128})
    assert h200 == setup_key({"slots": 128, "device": "NVIDIA H200"})  # the order of the setup's keys is not its name
    assert recorded_cost(path, h200) is None  # nothing recorded yet
    record_cost(path, h200, PrefillCost(0.004, 1.5e-5), "NVIDIA H200, 512-row chunks")
    assert recorded_cost(path, h200) == PrefillCost(0.004, 1.5e-5)
    assert recorded_cost(path, a10) is None
    record_cost(path, h200, PrefillCost(0.005, 1.6e-5))  # measured again: replaced
    assert recorded_cost(path, h200) == PrefillCost(0.005, 1.6e-5)
    for n in range(MAX_ENTRIES):
        record_cost(path, setup_key({"n": n}), PrefillCost(0.001, 1e-5))
    assert recorded_cost(path, h200) is None  # the oldest setup gave way
    assert recorded_cost(path, setup_key({"n": 0})) is not None


def test_an_unreadable_record_is_said_and_written_anew_and_a_bad_entry_is_no_cost(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    path, key = tmp_path / FILE_NAME, setup_key({"device": "x"})
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="moss_rt.engine.prefill_cost_record"):
        assert recorded_cost(path, key) is None
    assert "cannot be read" in caplog.text
    record_cost(path, key, PrefillCost(0.002, 2e-5))
    assert recorded_cost(path, key) == PrefillCost(0.002, 2e-5)
    path.write_text(json.dumps({"format": 1, "entries": {key: {"fixed_s": -1, "per_row_s": 0.1}}}))
    assert recorded_cost(path, key) is None  # not a measurement
    path.write_text(json.dumps({"format": 1, "entries": {key: {"fixed_s": "soon"}}}))
    assert recorded_cost(path, key) is None


@pytest.fixture
def as_if_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """The CPU engine sizes its passes as a GPU's does: its device reads as CUDA for the sizing, and timing a pass
    is a stand-in that records what it was asked to time."""
    from moss_rt.engine import moss as moss_module

    timed: list[tuple[int, int, int]] = []

    def time_passes(self: moss_module.MossEngine, chunk: int, small: int, large: int) -> PrefillCost:
        timed.append((chunk, small, large))
        return PrefillCost(0.004, 1.25e-5)

    monkeypatch.setattr(moss_module.MossEngine, "_time_prefill_passes", time_passes)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Stand-in GPU")
    return timed


def _sized(settings, as_if_on_a_gpu) -> tuple[int, bool | None]:  # type: ignore[no-untyped-def]
    with loaded_engine(settings) as engine:
        engine._device = torch.device("cuda")  # (only the sizing asks)
        engine._size_stream_passes()
        assert engine._scheduler is not None
        return engine._scheduler.stream_rows, engine.prefill_cost_measured


def test_a_second_start_sizes_its_passes_from_the_first_ones_record(tiny_data_dir, tmp_path, as_if_on_a_gpu) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "data"
    data.mkdir()
    if (tiny_data_dir / "tiny").is_dir():  # the tiny checkpoints, not written again
        (data / "tiny").symlink_to(tiny_data_dir / "tiny")
    settings = engine_settings(data, overlap=False, prefill_chunk=32, prefill_budget_ms=5.0)
    first = _sized(settings, as_if_on_a_gpu)
    assert first[1] is True and len(as_if_on_a_gpu) == 1  # timed, and recorded
    # (5 ms - 4 ms) / 12.5 us a row = 80 rows
    assert first[0] == 80
    second = _sized(settings, as_if_on_a_gpu)
    assert second == (80, False) and len(as_if_on_a_gpu) == 1  # the record's cost, no pass timed
    # A budget is not part of the setup: the recorded cost sizes passes for any budget.
    assert _sized(dataclasses.replace(settings, prefill_budget_ms=6.0), as_if_on_a_gpu) == (160, False)
    # Another setup (another chunk length: other passes) times its own.
    other = _sized(dataclasses.replace(settings, prefill_chunk=64), as_if_on_a_gpu)
    assert other[1] is True and len(as_if_on_a_gpu) == 2
    assert (data / FILE_NAME).is_file()
