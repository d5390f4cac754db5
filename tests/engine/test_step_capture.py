"""scheduler.step_may_capture against the real ModelRunner's step: it names exactly the (batch, keys) graph a
step replays, so the codec worker is drained before a step that captures and only then."""

from __future__ import annotations

from typing import Any

import torch

from moss_rt.engine.scheduler import step_may_capture
from moss_rt.model import ModelRunner, load_model
from tests.model.conftest import TINY


class _NoGraph:
    def replay(self) -> None:
        pass


def test_step_may_capture_names_the_graph_the_step_uses() -> None:
    torch.set_num_threads(1)
    loaded = load_model(TINY, device="cpu", dtype=torch.float32)
    runner = ModelRunner(loaded.model, loaded.tokenizer, loaded.config, max_slots=8, max_seq_len=320, device="cpu",
                         dtype=torch.float32, cpu_batch_invariant=False)
    used: list[tuple[int, int]] = []

    def graph(batch: int, key_len: int) -> Any:  # stands in for the CUDA graph the step would replay
        used.append((batch, key_len))
        return _NoGraph()

    # The CPU runner pretends to step through graphs: which (batch, keys) would it replay?
    runner.use_cuda_graphs = True
    runner._graph = graph  # type: ignore[method-assign]
    every = [(b, k) for k in runner.key_buckets() for b in runner._batch_buckets()]
    missing: list[tuple[int, int]] = []
    runner.pending_graphs = lambda: list(missing)  # type: ignore[method-assign]
    prompt = runner.build_prompt(text="The night is long.")
    slots = [runner.alloc_slot() for _ in range(3)]
    for s in slots:
        runner.prefill(s, prompt)
    for case in ([slots[0]], slots, slots[1:], [slots[2]], [slots[0]]):
        missing[:] = []
        assert not step_may_capture(runner, case)  # every graph there: the step never drains the codec
        predicted = []
        for bk in every:  # exactly one missing graph makes this step capture: the one it replays
            missing[:] = [bk]
            if step_may_capture(runner, case):
                predicted.append(bk)
        runner.step(case)
        assert predicted == [used[-1]], (case, predicted, used[-1])

def test_step_may_capture_without_the_runners_rules_is_safe() -> None:
    class Opaque:
        def pending_graphs(self) -> list[tuple[int, int]]:
            return [(1, 64)]

    class Done:
        def pending_graphs(self) -> list[tuple[int, int]]:
            return []

    assert step_may_capture(Opaque(), [0])  # unknown bucket rules, graphs missing: drain first
    assert not step_may_capture(Done(), [0])
    assert not step_may_capture(object(), [0])  # a stand-in runner without graphs
