"""Prefill graphs (model/prefill_graphs.py) without CUDA: which lone pieces replay which graph, the order of the idle
captures, and the graph's own pass (the function captured) against the eager pass on the CPU.

The CPU has no CUDA graphs: the runner is told it has them and its graphs are stand-ins that run the captured
function eagerly from the graph's static inputs (``_stand_ins``), so everything but the capture itself runs here.
tests/gpu/test_model_gpu.py runs the same scenario through real graphs on CUDA.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from moss_rt.model import ModelRunner
from moss_rt.model.prefill_graphs import GraphShape, PrefillGraphs
from moss_rt.model.runner import PrefillRequest
from tests.model.conftest import TINY


class _EagerReplay:
    def __init__(self, graphs: PrefillGraphs, g: Any, shape: GraphShape) -> None:
        self.graphs, self.g, self.shape = graphs, g, shape

    def replay(self) -> None:
        self.graphs._pass(self.g, self.shape)


def _stand_ins(runner: ModelRunner, shapes: list[GraphShape] | None = None) -> None:
    """The runner replays prefill "graphs" of these shapes (default: all): the captured pass, run eagerly."""
    runner.use_cuda_graphs = True  # only prefill passes run while it is set: a step would try a real capture
    graphs = runner.prefill_graphs
    for shape in graphs.shapes() if shapes is None else shapes:
        g = graphs._statics(shape)
        g.graph = _EagerReplay(graphs, g, shape)
        graphs._graphs[shape] = g


@contextmanager
def eager(runner: ModelRunner) -> Iterator[None]:
    """Passes in this block run eagerly whatever graphs the runner holds."""
    saved = runner.use_cuda_graphs
    runner.use_cuda_graphs = False
    try:
        yield
    finally:
        runner.use_cuda_graphs = saved


def _pool(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    st = runner.state
    return st.k_cache.clone(), st.v_cache.clone(), st.hidden.clone()


def piece_after_prefix(runner: ModelRunner, rows: np.ndarray, start: int, count: int) -> int:
    """A slot continuing a kept ``start``-row prefix (its blocks shared, the branch block copied on the first write:
    what the prompt cache gives a line whose opening an earlier line computed), then ``rows[start:start+count]``
    prefilled as one lone piece. Checks what the piece must leave alone: the slot's prefix (bit for bit), the kept
    prefix's blocks, other slots and the slot's own positions past the piece (nothing but the piece's positions, the
    copied branch block and the scratch block changes in the pool). Returns the slot."""
    holder = runner.alloc_slot()
    with eager(runner):  # the same prefix whether the piece then runs through a graph or not
        runner.prefill(holder, rows[:start])
    kept = runner.detach(holder)
    slot = runner.alloc_slot()
    runner.attach(slot, kept, start)
    prefix = runner.slot_cache(slot, start)
    before = _pool(runner)
    runner.prefill_batch([PrefillRequest(slot, rows[start : start + count], start)])
    assert runner.slot_length(slot) == start + count
    for x, y in zip(runner.slot_cache(slot, start), prefix, strict=True):
        assert torch.equal(x, y)
    st, bs = runner.state, runner.state.block_size
    written = torch.zeros(st.hidden.shape[0], dtype=torch.bool, device=st.hidden.device)
    branch = start // bs * bs  # the block holding position start: copied when it was shared
    index = st.pool_index(torch.tensor([slot], device=written.device),
                          torch.arange(branch, start + count, device=written.device)[None])
    written[index[0]] = True
    written[st.scratch : st.scratch + bs] = True  # padded rows write here; nobody reads it
    for name, a, b in zip(("keys", "values", "hidden"), before, _pool(runner), strict=True):
        unchanged = a[:, ~written] if name != "hidden" else a[~written]
        now = b[:, ~written] if name != "hidden" else b[~written]
        assert torch.equal(unchanged, now), f"{name} outside the piece changed"
    runner.drop(kept)
    return slot


def test_lone_pieces_choose_their_graph(tiny) -> None:
    runner = ModelRunner(tiny.model, tiny.tokenizer, tiny.config, max_slots=1, max_seq_len=5120, device="cpu",
                         dtype=torch.float32)
    graphs = runner.prefill_graphs
    assert graphs.buckets == [128, 256, 384, 512]
    assert graphs.key_buckets == [512, 1024, 2048, 4096, 5120]
    pick = graphs.shape_for
    assert pick(400, 0) == (512, 0) and pick(400, 0).from_zero  # a fresh prompt: its own causal graph
    assert pick(1, 0) == (128, 0) and pick(128, 0) == (128, 0) and pick(129, 0) == (256, 0)
    assert pick(240, 160) == (256, 512)  # a line after its cached opening (issue 24's bench)
    assert pick(1, 1) == (128, 512) and pick(128, 384) == (128, 512)
    assert pick(129, 384) == (256, 1024)  # one key past the window: the next one
    assert pick(512, 512) == (512, 1024)  # a long prompt's second chunk (prefill_chunk 512)
    assert pick(512, 4608) == (512, 5120) and pick(1, 5119) == (128, 5120)
    assert pick(513, 0) is None and pick(513, 100) is None  # wider than the largest bucket: eager
    assert pick(0, 0) is None and pick(2, 5119) is None  # past max_seq_len
    shapes = graphs.shapes()
    assert len(shapes) == len(set(shapes)) == 4 + 4 * 5
    assert graphs.common_shapes() == [(128, 0), (256, 0), (384, 0), (512, 0),
                                      (128, 512), (256, 512), (384, 512), (512, 512)]
    assert graphs.pending()[:8] == sorted(graphs.common_shapes(), key=lambda s: (s.keys, s.rows))
    assert runner.pending_prefill_graphs() == []  # no CUDA graphs on the CPU: nothing to capture


def test_small_runner_has_only_windows_its_slots_address(tiny) -> None:
    runner = ModelRunner(tiny.model, tiny.tokenizer, tiny.config, max_slots=1, max_seq_len=320, device="cpu",
                         dtype=torch.float32)
    graphs = runner.prefill_graphs
    assert graphs.buckets == [128, 256] and graphs.key_buckets == [320]
    assert graphs.shape_for(256, 64) == (256, 320) and graphs.shape_for(200, 120) == (256, 320)
    assert graphs.shape_for(200, 121) is None  # past max_seq_len
    assert set(graphs.common_shapes()) == set(graphs.shapes())  # everything before serving


def test_idle_captures_interleave_prefill_graphs_with_step_graphs_by_key_window(tiny) -> None:
    runner = ModelRunner(tiny.model, tiny.tokenizer, tiny.config, max_slots=2, max_seq_len=1100, device="cpu",
                         dtype=torch.float32)
    runner.use_cuda_graphs = True
    log: list[tuple[str, int, int]] = []

    def step_graph(batch: int, keys: int) -> Any:
        log.append(("step", keys, batch))
        runner._graphs[(batch, keys)] = object()  # type: ignore[assignment]

    def prefill_graph(shape: GraphShape) -> None:
        log.append(("prefill", shape.keys, shape.rows))
        runner.prefill_graphs._graphs[shape] = object()  # type: ignore[assignment]

    runner._graph = step_graph  # type: ignore[method-assign,assignment]
    runner.prefill_graphs.capture = prefill_graph  # type: ignore[method-assign]
    total = len(runner.pending_graphs()) + len(runner.pending_prefill_graphs())
    while runner.capture_next():
        pass
    assert len(log) == total and not runner.pending_graphs() and not runner.pending_prefill_graphs()
    # Fresh prompts' graphs first (none captured by a warm-up here), then by key window, steps before prefills.
    assert [entry[0] for entry in log[:4]] == ["prefill"] * 4 and all(e[1] == 0 for e in log[:4])
    order = [(keys, kind == "prefill") for kind, keys, _ in log[4:]]
    assert order == sorted(order)
    assert {keys for kind, keys, _ in log if kind == "prefill"} == {0, 512, 1024, 1100}


@pytest.fixture(scope="module")
def long_rows() -> np.ndarray:
    from moss_rt.model import load_model

    loaded = load_model(TINY, device="cpu", dtype=torch.float32)
    runner = ModelRunner(loaded.model, loaded.tokenizer, loaded.config, max_slots=1, max_seq_len=64, device="cpu",
                         dtype=torch.float32)
    prompt = runner.build_prompt(text="The night is long, and the stars are listening.", instruction="Whisper.")
    return np.resize(prompt, (1100, prompt.shape[1]))  # the prompt's rows repeated: valid rows of any length


# (start, rows): bucket edges (127/128/129 rows, 512), a line after its opening, later windows, block-aligned
# starts (no copy on write) and unaligned ones (the branch block copied).
CASES = [(1, 1), (37, 127), (40, 128), (16, 129), (160, 240), (400, 200), (511, 2), (512, 512), (600, 490)]


def test_piece_after_a_prefix_through_the_graph_pass_equals_eager(tiny, long_rows) -> None:
    def make() -> ModelRunner:
        return ModelRunner(tiny.model, tiny.tokenizer, tiny.config, max_slots=3, max_seq_len=1100, device="cpu",
                           dtype=torch.float32)

    graphed, plain = make(), make()
    _stand_ins(graphed)
    for start, count in CASES:
        replays = graphed.prefill_graphs.replays
        a = piece_after_prefix(graphed, long_rows, start, count)
        assert graphed.prefill_graphs.replays == replays + 1, (start, count)
        b = piece_after_prefix(plain, long_rows, start, count)
        assert plain.prefill_graphs.replays == 0
        for name, x, y in zip(("keys", "values", "hidden"), graphed.slot_cache(a, start + count),
                              plain.slot_cache(b, start + count), strict=True):
            where = f"{name} of {count} rows after {start}"
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}")
        graphed.free_slot(a)
        plain.free_slot(b)


def test_only_lone_pieces_within_a_captured_shape_replay(tiny, long_rows) -> None:
    # cpu_batch_invariant=False: several pieces share one pass, as on CUDA (the CPU default splits them by slot).
    runner = ModelRunner(tiny.model, tiny.tokenizer, tiny.config, max_slots=2, max_seq_len=1100, device="cpu",
                         dtype=torch.float32, cpu_batch_invariant=False)
    _stand_ins(runner, [GraphShape(256, 0), GraphShape(256, 512)])
    graphs = runner.prefill_graphs
    first, second = runner.alloc_slot(), runner.alloc_slot()

    def replayed(requests: list[PrefillRequest]) -> int:
        before = graphs.replays
        runner.prefill_batch(requests)
        return graphs.replays - before

    assert replayed([PrefillRequest(first, long_rows[:200])]) == 1  # fresh, 256 from position 0
    assert replayed([PrefillRequest(first, long_rows[200:400], 200)]) == 1  # after a prefix, 256 x 512
    assert replayed([PrefillRequest(first, long_rows[400:600], 400)]) == 0  # window 1024: not captured
    assert replayed([PrefillRequest(first, long_rows[:100])]) == 0  # bucket 128: not captured
    assert replayed([PrefillRequest(first, long_rows[:600])]) == 0  # wider than any bucket
    two = [PrefillRequest(first, long_rows[:200]), PrefillRequest(second, long_rows[:200])]
    assert replayed(two) == 0  # a burst's pass stays eager
