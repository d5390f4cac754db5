"""engine/gpu_streams: which stream priority the engine's thread takes, by the levels a device offers (PyTorch's
range: 0 the normal, lower numbers first; up to four levels)."""

from __future__ import annotations

import pytest

from moss_rt.engine.gpu_streams import below_highest


@pytest.mark.parametrize(
    ("greatest", "engine"),
    [
        (-3, -2),  # four levels (an H200 under PyTorch): the codec's priority lane -3, the engine -2, steady calls 0
        (-2, -1),  # three levels: still one between the priority lane and steady calls
        (-1, -1),  # two levels: the engine shares the highest with the priority lane, never steady calls' level
    ],
)
def test_the_engine_runs_below_the_priority_lane_and_above_steady_calls(greatest: int, engine: int) -> None:
    assert below_highest(greatest, 0) == engine
    assert greatest <= below_highest(greatest, 0) < 0
