"""Several graph-sized prefill passes a round (``--prefill-round-passes``) on the device: the same codes and PCM.

A take streams; six new lines with long prompts arrive. On CUDA their prefill passes are cut to what one
prefill graph holds (engine/prefill_pace), so they take more than one pass: with ``prefill_round_passes`` 1 a round
runs one of them and a step comes between; with 4 a round runs them back to back. Which rows share a pass is the
same either way, so every take's codes and PCM are the same, bit for bit. The ``cpu`` variant runs the same body
(no prefill graphs there: a pass is cut by rows alone, one a round whatever the setting).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from moss_rt.engine.slots import Phase
from tests.engine.harness import engine_settings, loaded_engine, new_take, spec
from tests.gpu.conftest import DEVICES

# ~150 prompt rows each: two graph passes hold the six (a pass holds four pieces of up to 256 rows).
LONG_LINE = "The storm came up the coast all night, and by morning the harbour was a field of broken masts and rope."


def _run(data_dir: Any, device: str, round_passes: int) -> tuple[dict[str, Any], list[int]]:
    """Every take's chunks and end, and the prefill passes of each round that ran any."""
    settings = engine_settings(data_dir, overlap=True, device=device, prefill_round_passes=round_passes)
    with loaded_engine(settings, all_graphs=True) as engine:
        sched, runner = engine._scheduler, engine._runner
        assert sched is not None and runner is not None
        passes: list[int] = []
        prefill = runner.prefill_batch

        def counted(requests: Any) -> Any:
            passes[-1] += 1
            return prefill(requests)

        runner.prefill_batch = counted  # type: ignore[method-assign]
        takes = [new_take(engine, spec("streaming", 1, 24, 8))]
        sched.add(takes[0])
        lines = [spec(f"line{i}", 10 + i, 8, 8, text=f"{LONG_LINE} ({i})") for i in range(6)]
        arrived = False
        for _ in range(5000):
            if all(t.channel.finished for t in takes):
                break
            if not arrived and takes[0].phase is Phase.RUNNING and takes[0].frames >= 2:
                takes += [new_take(engine, s) for s in lines]  # arrive while it streams
                for take in takes[1:]:
                    sched.add(take)
                arrived = True
            passes.append(0)
            engine._wake.clear()
            if not sched.iterate():
                engine._wake.wait(0.05)
        else:
            raise AssertionError("the takes did not end")
        assert arrived
        out = {}
        for take in takes:
            ch: Any = take.channel
            assert not ch.problems, (take.take_id, ch.problems)
            out[take.take_id] = {"chunks": [(c.first_frame, c.codes.tobytes(), c.pcm) for c in ch.chunks],
                                 "end": (ch.end.reason, ch.end.n_frames, ch.end.error)}
            assert ch.end.error is None, ch.end
        return out, [n for n in passes if n]


@pytest.mark.parametrize("device", DEVICES)
def test_several_prefill_passes_a_round_give_the_same_codes_and_pcm(device, tiny_data_dir) -> None:
    one, one_rounds = _run(tiny_data_dir, device, 1)
    four, four_rounds = _run(tiny_data_dir, device, 4)
    assert one.keys() == four.keys() and len(one) == 7
    for take_id in one:
        assert four[take_id] == one[take_id], take_id
        codes = np.frombuffer(b"".join(c[1] for c in one[take_id]["chunks"]), np.int64)
        assert codes.size == 12 * one[take_id]["end"][1]  # every frame of it came out
    assert max(one_rounds) == 1  # one pass a round
    assert sum(one_rounds) == sum(four_rounds)  # the same passes...
    if device == "cuda":  # ...graph-sized, several in one round while the first take streams
        assert sum(one_rounds) > 2 and max(four_rounds) > 1, (one_rounds, four_rounds)
    else:  # no prefill graphs on the CPU: one pass a round whatever the setting
        assert four_rounds == one_rounds
