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
    assert pick(400, 0) == GraphShape(512, 0) and pick(400, 0).from_zero  # a fresh prompt: its own causal graph
    assert pick(1, 0) == GraphShape(128, 0) and pick(128, 0) == GraphShape(128, 0)
    assert pick(129, 0) == GraphShape(256, 0)
    assert pick(240, 160) == GraphShape(256, 512)  # a line after its cached opening (issue 24's bench)
    assert pick(1, 1) == GraphShape(128, 512) and pick(128, 384) == GraphShape(128, 512)
    assert pick(129, 384) == GraphShape(256, 1024)  # one key past the window: the next one
    assert pick(512, 512) == GraphShape(512, 1024)  # a long prompt's second chunk (prefill_chunk 512)
    assert pick(512, 4608) == GraphShape(512, 5120) and pick(1, 5119) == GraphShape(128, 5120)
    assert pick(513, 0) is None and pick(513, 100) is None  # wider than the largest bucket: eager
    assert pick(0, 0) is None and pick(2, 5119) is None  # past max_seq_len
    shapes = graphs.shapes()
    assert len(shapes) == len(set(shapes)) == 4 + 4 * 5
    assert graphs.common_shapes() == [GraphShape(r, k) for k in (0, 512) for r in (128, 256, 384, 512)]
    assert graphs.pending()[:8] == sorted(graphs.common_shapes(), key=lambda s: (s.keys, s.rows))
    assert runner.pending_prefill_graphs() == []  # no CUDA graphs on the CPU: nothing to capture


def test_small_runner_has_only_windows_its_slots_address(tiny) -> None:
    runner = ModelRunner(tiny.model, tiny.tokenizer, tiny.config, max_slots=1, max_seq_len=320, device="cpu",
                         dtype=torch.float32)
    graphs = runner.prefill_graphs
    assert graphs.buckets == [128, 256] and graphs.key_buckets == [320]
    assert graphs.shape_for(256, 64) == GraphShape(256, 320) and graphs.shape_for(200, 120) == GraphShape(256, 320)
    assert graphs.shape_for(200, 121) is None  # past max_seq_len
    assert set(graphs.common_shapes()) == set(graphs.shapes())  # everything before serving


def test_idle_captures_interleave_prefill_graphs_with_step_graphs_by_key_window(tiny) -> None:
    runner = ModelRunner(tiny.model, tiny.tokenizer, tiny.config, max_slots=2, max_seq_len=1100, device="cpu",
                         dtype=torch.float32)
    runner.use_cuda_graphs = True
    log: list[tuple[str, int, GraphShape]] = []

    def step_graph(batch: int, keys: int) -> Any:
        log.append(("step", keys, GraphShape(0, keys)))
        runner._graphs[(batch, keys)] = object()  # type: ignore[assignment]

    def prefill_graph(shape: GraphShape) -> None:
        log.append(("prefill", shape.keys, shape))
        runner.prefill_graphs._graphs[shape] = object()  # type: ignore[assignment]

    runner._graph = step_graph  # type: ignore[method-assign,assignment]
    runner.prefill_graphs.capture = prefill_graph  # type: ignore[method-assign]
    total = len(runner.pending_graphs()) + len(runner.pending_prefill_graphs())
    while runner.capture_next():
        pass
    assert len(log) == total and not runner.pending_graphs() and not runner.pending_prefill_graphs()
    # Fresh prompts' graphs first (none captured by a warm-up here), then by key window, steps before prefills; a
    # batched pass's graph after the steps of its window (its window at least the first prefill window, 512).
    graphs = runner.prefill_graphs
    assert [entry[0] for entry in log[:4]] == ["prefill"] * 4 and all(e[1] == 0 for e in log[:4])
    order = [(keys if kind == "step" else graphs.idle_rank(shape), kind == "prefill") for kind, keys, shape in log[4:]]
    assert order == sorted(order)
    assert {keys for kind, keys, _ in log if kind == "prefill"} == {0, 512, 1024, 1100}
    batched = [shape for kind, _, shape in log if kind == "prefill" and shape.pieces > 1]
    assert batched and {s.pieces for s in batched} == {2}  # two slots: passes of two pieces at most
    lone_512 = [i for i, (kind, _, s) in enumerate(log) if kind == "prefill" and s.pieces == 1 and s.keys == 512]
    last_lone_512 = max(lone_512)
    first_step_1024 = min(i for i, (kind, keys, _) in enumerate(log) if kind == "step" and keys == 1024)
    first_batched = min(i for i, (kind, _, s) in enumerate(log) if kind == "prefill" and s.pieces > 1)
    assert last_lone_512 < first_batched < first_step_1024


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
    assert replayed(two) == 0  # two pieces: no batched graph among the captured ones, eager


def test_passes_of_several_pieces_choose_their_batched_graph(tiny) -> None:
    # The largest passes there are (--prefill-graph-rows 2048), where every other bound comes into play.
    runner = ModelRunner(tiny.model, tiny.tokenizer, tiny.config, max_slots=16, max_seq_len=5120, device="cpu",
                         dtype=torch.float32, prefill_graph_rows=2048)
    graphs = runner.prefill_graphs
    assert graphs.piece_buckets == [2, 4, 8, 16]
    pick = graphs.shape_for_pass
    assert pick([240], [160]) == GraphShape(256, 512)  # one piece: the lone graph
    # A render's lines: a few dozen rows each after the cast's shared opening (issue 26's bench).
    assert pick([30] * 6, [220] * 6) == GraphShape(32, 512, 8)
    assert pick([30, 33], [220, 200]) == GraphShape(64, 512, 2)
    assert pick([30, 64], [0, 0]) == GraphShape(64, 0, 2) and pick([30, 64], [0, 0]).from_zero  # fresh prompts
    assert pick([100, 10], [0, 5]) == GraphShape(128, 512, 2)  # one starts after a prefix: the masked window
    assert pick([10, 10], [500, 0]) == GraphShape(32, 512, 2) and pick([10, 10], [503, 0]) == GraphShape(32, 1024, 2)
    assert pick([256] * 8, [200] * 8) == GraphShape(256, 512, 8)  # 2,048 padded rows over 512 keys: the largest
    assert pick([256] * 8, [600] * 8) == GraphShape(256, 1024, 8)  # 2,048 rows over 1,024 keys: the bound
    assert pick([256] * 8, [1000] * 8) is None  # 2,048 rows over 2,048 keys: too many scores, eager
    assert pick([64] * 16, [400] * 16) == GraphShape(64, 512, 16)
    assert pick([64] * 16, [1000] * 16) is None  # 16 pieces' keys over 2,048 positions: too much gathered, eager
    assert pick([64] * 8, [1000] * 8) == GraphShape(64, 2048, 8)
    assert pick([257, 10], [0, 0]) is None  # a piece wider than the batched buckets: eager
    assert pick([200] * 16, [0] * 16) is None  # 16 x 256 padded rows: compute-bound, eager
    assert pick([8] * 17, [0] * 17) is None  # more pieces than any bucket
    shapes = graphs.shapes()
    assert len(shapes) == len(set(shapes))
    batched = [s for s in shapes if s.pieces > 1]
    assert all(s.padded_rows <= 2048 and s.padded_rows * (s.keys or s.rows) <= 2048 * 1024
               and s.pieces * (s.keys or s.rows) <= 16384 for s in batched)
    assert {s.keys for s in batched} == {0, 512, 1024, 2048, 4096, 5120}
    assert max(s.pieces for s in batched if s.keys == 4096) == 4  # long windows: few pieces only
    assert max(s.pieces for s in batched if s.keys == 5120) == 2
    assert all(s.pieces == 1 for s in graphs.common_shapes())  # batched graphs are captured while idle only
    small = ModelRunner(tiny.model, tiny.tokenizer, tiny.config, max_slots=3, max_seq_len=1024, device="cpu",
                        dtype=torch.float32)
    assert small.prefill_graphs.piece_buckets == [2]
    assert small.prefill_graphs.shape_for_pass([30] * 3, [220] * 3) is None  # no 4-piece graph on 3 slots


def test_batched_graphs_hold_the_longest_take_unless_prefill_graph_rows_says_otherwise(tiny) -> None:
    """At 1,024 positions a batched pass holds 1,024 padded rows (four lines of ~240 rows); --prefill-graph-rows lifts
    that to 2,048 (eight), never past the bounds on scores and gathered keys."""
    def runner(**kw: int) -> ModelRunner:
        return ModelRunner(tiny.model, tiny.tokenizer, tiny.config, max_slots=16, max_seq_len=1024, device="cpu",
                           dtype=torch.float32, **kw)

    default, lifted = runner(), runner(prefill_graph_rows=2048)
    lines = ([240] * 8, [160] * 8)  # eight lines' rows after the cast's cached opening
    assert default.prefill_graphs.shape_for_pass(*lines) is None  # 2,048 padded rows: past the longest take, eager
    assert default.prefill_graphs.shape_for_pass([240] * 4, [160] * 4) == GraphShape(256, 512, 4)
    assert lifted.prefill_graphs.shape_for_pass(*lines) == GraphShape(256, 512, 8)
    assert max(s.padded_rows for s in default.prefill_graphs.shapes()) == 1024
    assert max(s.padded_rows for s in lifted.prefill_graphs.shapes()) == 2048
    assert lifted.prefill_graphs.shape_for_pass([256] * 8, [1000] * 8) is None  # the scores' bound still holds
    assert runner(prefill_graph_rows=8192).prefill_graphs.max_padded_rows == 2048  # never past BATCH_GRAPH_MAX_ROWS
    assert runner(prefill_graph_rows=512, prefill_max_rows=256).prefill_graphs.max_padded_rows == 256  # nor a pass


def test_batched_graphs_hold_1024_rows_by_default_on_longer_takes(tiny) -> None:
    """A server on the memory plan's take length (thousands of positions) holds the 1,024-row passes the directing
    benchmarks measured, not 2,048: a 2,048-row pass holds every running stream twice as long."""
    long = ModelRunner(tiny.model, tiny.tokenizer, tiny.config, max_slots=16, max_seq_len=4096, device="cpu",
                       dtype=torch.float32)
    graphs = long.prefill_graphs
    assert graphs.max_padded_rows == 1024
    assert graphs.shape_for_pass([240] * 4, [160] * 4) == GraphShape(256, 512, 4)
    assert graphs.shape_for_pass([240] * 8, [160] * 8) is None  # eight lines: past the default, not a graph
    assert max(s.padded_rows for s in graphs.shapes()) == 1024


# (start, rows) of each piece of one batched pass, after kept prefixes: a render's short lines, mixed starts (one
# fresh), block-aligned and unaligned starts, and a pass of pieces all from position 0.
BATCH_CASES = [
    [(220, 30), (200, 33), (16, 1), (0, 40)],
    [(37, 64), (500, 12)],
    [(0, 30), (0, 64), (0, 5)],
]


def pieces_after_prefixes(runner: ModelRunner, rows: np.ndarray, cases: list[tuple[int, int]]) -> list[int]:
    """Slots continuing kept prefixes (as piece_after_prefix), then every case's piece prefilled in ONE pass. Checks
    that nothing but the pieces' positions (their copied branch blocks) and the scratch block changes. Returns the
    slots."""
    slots, kept = [], []
    for start, _ in cases:
        if start:
            holder = runner.alloc_slot()
            with eager(runner):
                runner.prefill(holder, rows[:start])
            kept.append(runner.detach(holder))
            slot = runner.alloc_slot()
            runner.attach(slot, kept[-1], start)
        else:
            slot = runner.alloc_slot()
        slots.append(slot)
    before = _pool(runner)
    runner.prefill_batch([PrefillRequest(slot, rows[start : start + count], start)
                          for slot, (start, count) in zip(slots, cases, strict=True)])
    st, bs = runner.state, runner.state.block_size
    written = torch.zeros(st.hidden.shape[0], dtype=torch.bool, device=st.hidden.device)
    for slot, (start, count) in zip(slots, cases, strict=True):
        assert runner.slot_length(slot) == start + count
        branch = start // bs * bs
        index = st.pool_index(torch.tensor([slot], device=written.device),
                              torch.arange(branch, start + count, device=written.device)[None])
        written[index[0]] = True
    written[st.scratch : st.scratch + bs] = True
    for name, a, b in zip(("keys", "values", "hidden"), before, _pool(runner), strict=True):
        unchanged = a[:, ~written] if name != "hidden" else a[~written]
        now = b[:, ~written] if name != "hidden" else b[~written]
        assert torch.equal(unchanged, now), f"{name} outside the pieces changed"
    for ref in kept:
        runner.drop(ref)
    return slots


def test_a_batched_pass_through_its_graph_pass_equals_eager(tiny, long_rows) -> None:
    def make() -> ModelRunner:
        return ModelRunner(tiny.model, tiny.tokenizer, tiny.config, max_slots=8, max_seq_len=1100, device="cpu",
                           dtype=torch.float32, cpu_batch_invariant=False)

    graphed, plain = make(), make()
    _stand_ins(graphed)
    for cases in BATCH_CASES:
        replays = graphed.prefill_graphs.replays
        a = pieces_after_prefixes(graphed, long_rows, cases)
        assert graphed.prefill_graphs.replays == replays + 1, cases  # one replay for the whole pass
        b = pieces_after_prefixes(plain, long_rows, cases)
        for x_slot, y_slot, (start, count) in zip(a, b, cases, strict=True):
            for name, x, y in zip(("keys", "values", "hidden"), graphed.slot_cache(x_slot, start + count),
                                  plain.slot_cache(y_slot, start + count), strict=True):
                where = f"{name} of {count} rows after {start} in {cases}"
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}")
        for slot in a:
            graphed.free_slot(slot)
        for slot in b:
            plain.free_slot(slot)
