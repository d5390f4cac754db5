"""CUDA graphs of prefill passes: a lone prompt piece (one slot, up to 512 rows) or a small batch of short pieces
(2-16 slots, up to 256 rows each), from position 0 or after a prefix.

Why: run eagerly, a pass over one 400-row prompt is launch-bound (about 22 ms on an H200 for 4 ms of GEMMs: 36
layers of Python and kernel launches, 22-40 ms for the 240 rows after a cached opening), and it is most of what a
lone arrival's first audio waits for; a take that arrives while others stream is prefilled this way too. Replayed
from a graph it costs about its GEMMs.

Two families of graphs, both one per row bucket (``PREFILL_GRAPH_ROWS`` up to the runner's ``max_seq_len``):

- **from position 0** (``GraphShape(rows, keys=0)``): a fresh prompt. The attention is plainly causal over the
  pass's own rows (flash attention, chunk_attention's ``causal`` case), no key of the cache is read.
- **after a prefix** (``GraphShape(rows, keys=K)``): the piece starts at a position > 0, after rows the slot already
  holds, above all the opening the prompt cache shares between lines (``engine/prompt_cache.py``): a fresh line
  then prefills only its own rows, from there. The start is runtime data (a static input tensor); the attention
  reads the slot's paged keys 0..K-1 (K: a key bucket, ``PREFILL_GRAPH_MIN_KEYS`` doubling up to the runner's
  ``max_seq_len``) under the causal key mask, so one graph serves any start with start + rows <= K. Keys past the piece
  are masked out (unused table entries point at the zero-filled scratch block: finite, never NaN). The same code
  path serves later chunks of a long prompt, which the scheduler feeds in chunks of at most ``prefill_chunk`` (512)
  rows: each is a lone piece after a prefix.

**Batches of short pieces** (``GraphShape(rows, keys, pieces)``, ``pieces`` > 1): a script render's lines (each
a few dozen rows after the cast's shared opening, a handful arriving per round), a burst of retakes' re-prefilled
rows, several lines after their cached openings. Run eagerly such a pass is as launch-bound as a lone piece (one
padded backbone call: the same ~700 kernels whatever its rows), and slower still when the server's other threads
hold Python's GIL between its launches: measured on an H200 during a 200-line render with 16 directors, 50-68 ms a
pass for ~190 rows (2 ms of GEMMs), and every director arriving in such a round waited for it. Replayed, it costs
about its padded GEMMs. Each piece is padded to the graph's row bucket (``BATCH_GRAPH_ROWS``) and the pass to its
piece bucket (``BATCH_GRAPH_PIECES``): padding pieces have no rows (they write only to scratch). Only passes within
``BATCH_GRAPH_MAX_ROWS`` padded rows (that times ``BATCH_GRAPH_KEYS_PER_ROW`` keys, and ``BATCH_GRAPH_MAX_PIECE_KEYS``
pieces x keys) have graphs: larger ones are
compute-bound, where a graph saves nothing and padding would cost. They are all captured while the engine is idle.

Why fresh prompts keep their own graphs instead of using an after-a-prefix graph with start 0 (which would be
correct too): the from-zero pass reads no cache keys and skips half of the score work (causal flash), while the
masked path gathers K keys per layer, repeats them to the query heads and scores every row against all of them:
an estimated 1 ms more on a 400-row prompt (8.2 ms graphed). Cold lines must not get slower to make warm ones faster.

Which graphs exist when (capture count is ready time): ``capture_common`` (the runner's warm-up, before ready)
takes every row bucket from position 0 and after a prefix within the first key bucket (512 positions: the lines of
ordinary prompts), 8 graphs at full size; the rest (after a prefix at longer key windows: long prompts' later
chunks, retakes continuing late in a take) are captured while the engine is idle (``pending`` /
``ModelRunner.capture_next``). A piece whose graph is not captured yet, or that is wider than the largest bucket,
or a pass of several takes (bursts: compute-bound), runs eagerly as before. No graph is captured on first use:
a capture costs three passes.

Padded rows (the piece padded to its bucket) write their keys, values and hidden state to the scratch position,
as in any padded pass (``step.prefill_batch_rows``), so the cache holds exactly the piece's rows and nothing else
of the slot (nor of any other) changes. The GEMMs see the bucket's row count and the attention the bucket's key
window instead of the piece's: the cache equals an eager pass to float rounding, not bit for bit (as a batched
pass does).

Graphs are captured with every row marked padded (the capture's runs write only to scratch) and replay from their
static inputs; they share the runner's graph memory pool (they and the step graphs run on one thread, never at
once, and keep no output tensor: the pool holds the largest pass's transients, an estimated 150 MB for 512 rows over
5,120 keys at full size, not the sum).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from moss_rt.model.network import MossTTSLocalModel
from moss_rt.model.state import SlotState
from moss_rt.model.step import Tables, prefill_batch_rows

logger = logging.getLogger(__name__)

PREFILL_GRAPH_ROWS = (128, 256, 384, 512)
# Batched passes: pieces per pass and rows per piece (its widest piece), padded rows (pieces x rows) at most, and
# padded rows x key window at most (the masked attention's scores and repeated keys grow with both).
BATCH_GRAPH_PIECES = (2, 4, 8, 16)
BATCH_GRAPH_ROWS = (32, 64, 128, 256)
BATCH_GRAPH_MAX_ROWS = 2048
BATCH_GRAPH_KEYS_PER_ROW = 1024
# Padded rows a batched graph holds unless prefill_graph_rows says otherwise (and the longest take if shorter). A
# graph-sized pass is the one pass of a round while takes stream, and it holds every running stream for its length:
# measured on H200s in four sessions (bench/RESULTS.md, sessions 12, 13, 20, 21), 2,048-row passes (~32-40 ms) made a
# burst of 64 retakes with new instructions 20-35 % slower at p95 than 1,024-row ones (~16-20 ms) and cancels twice as
# slow, while fresh lines' first audio gained 5-20 %. Directing is the product's core, so 1,024.
BATCH_GRAPH_DEFAULT_ROWS = 1024
# ...and pieces x key window at most: the masked attention gathers each piece's keys and values (repeated to the
# query heads), so a pass of many short pieces over a long window would hold a lot: 16 pieces over 1,024 keys at full
# size hold about 0.5 GB of them, the most any batched graph's pool keeps.
BATCH_GRAPH_MAX_PIECE_KEYS = 16384
# The smallest key window of an after-a-prefix graph: a line's prompt (a few hundred rows) fits; a smaller window
# would save a few µs of attention per layer for one more capture per row bucket.
PREFILL_GRAPH_MIN_KEYS = 512


class GraphShape(NamedTuple):
    """One prefill graph: ``rows`` the row bucket (of each piece); ``keys`` the key window after a prefix, 0 from
    position 0; ``pieces`` the slots a pass holds (1: a lone piece)."""

    rows: int
    keys: int
    pieces: int = 1

    @property
    def padded_rows(self) -> int:
        return self.rows * self.pieces

    @property
    def from_zero(self) -> bool:
        return self.keys == 0


@dataclass
class _PrefillGraph:
    slots: torch.Tensor  # [P] the slots (padding pieces: the first piece's, never written)
    rows: torch.Tensor  # [P, T, channels] the pieces, zero-padded
    starts: torch.Tensor  # [P] each piece's first position (always 0 from position 0)
    counts: torch.Tensor  # [P] each piece's rows (0: a padding piece)
    graph: Any = None  # the captured torch.cuda.CUDAGraph (anything with replay())


class PrefillGraphs:
    def __init__(
        self,
        model: MossTTSLocalModel,
        state: SlotState,
        tables: Tables,
        max_rows: int,
        pool: Any,
        max_pieces: int = 1,
        max_padded_rows: int = 0,
    ) -> None:
        self.model, self.state, self.tables = model, state, tables
        self.buckets = [b for b in PREFILL_GRAPH_ROWS if b <= max_rows]
        self.key_buckets = _key_buckets(state.max_seq_len)
        # Batched graphs: no more pieces than the runner has slots, no more padded rows than a pass may hold (by
        # default BATCH_GRAPH_DEFAULT_ROWS, or the longest take if shorter; ``max_padded_rows`` sets it, at most
        # BATCH_GRAPH_MAX_ROWS).
        self.piece_buckets = [p for p in BATCH_GRAPH_PIECES if p <= max_pieces]
        self.max_padded_rows = min(BATCH_GRAPH_MAX_ROWS, max_padded_rows or min(max_rows, BATCH_GRAPH_DEFAULT_ROWS))
        self._pool = pool  # the runner's graph memory pool handle
        self._graphs: dict[GraphShape, _PrefillGraph] = {}
        self.replays = 0  # passes that ran through a graph

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def shape_for(self, rows: int, start: int) -> GraphShape | None:
        """The graph a lone piece of ``rows`` rows at positions [start, start+rows) replays; None: no graph's
        shape holds it (wider than the largest bucket, or past the last key window)."""
        bucket = self.bucket(rows)
        if bucket is None or rows < 1 or start < 0:
            return None
        if start == 0:
            return GraphShape(bucket, 0)
        keys = next((k for k in self.key_buckets if k >= start + rows), None)
        return None if keys is None else GraphShape(bucket, keys)

    def shape_for_pass(self, widths: list[int], starts: list[int]) -> GraphShape | None:
        """The graph a pass of pieces (``widths[i]`` rows at positions starts[i]..) replays: a lone piece's
        (shape_for), or the smallest batched shape holding every piece (piece, row and key buckets); None: none
        does (too many pieces, too wide, past the padded-rows bounds)."""
        if len(widths) == 1:
            return self.shape_for(widths[0], starts[0])
        if not widths or min(widths) < 1 or min(starts) < 0:
            return None
        pieces = next((p for p in self.piece_buckets if p >= len(widths)), None)
        rows = next((r for r in BATCH_GRAPH_ROWS if r >= max(widths)), None)
        if pieces is None or rows is None:
            return None
        if not any(starts):
            shape = GraphShape(rows, 0, pieces)
        else:
            end = max(s + w for s, w in zip(starts, widths, strict=True))
            keys = next((k for k in self.key_buckets if k >= end), None)
            if keys is None:
                return None
            shape = GraphShape(rows, keys, pieces)
        return shape if self._batch_fits(shape) else None

    def _batch_fits(self, shape: GraphShape) -> bool:
        keys = shape.keys or shape.rows
        return (
            shape.padded_rows <= self.max_padded_rows
            and shape.padded_rows * keys <= BATCH_GRAPH_MAX_ROWS * BATCH_GRAPH_KEYS_PER_ROW
            and shape.pieces * keys <= BATCH_GRAPH_MAX_PIECE_KEYS
        )

    def shapes(self) -> list[GraphShape]:
        """Every graph this runner may capture: lone pieces from position 0 per bucket, then after a prefix per key
        window and bucket (only windows some piece of that bucket can use: rows past the next smaller bucket,
        start >= 1); then batched passes (pieces x rows buckets within the padded-rows bounds) from position 0 and
        per key window."""
        out = [GraphShape(b, 0) for b in self.buckets]
        for keys in self.key_buckets:
            for i, b in enumerate(self.buckets):
                smallest = self.buckets[i - 1] + 1 if i else 1  # the fewest rows this bucket serves
                if 1 + smallest <= keys:
                    out.append(GraphShape(b, keys))
        for keys in (0, *self.key_buckets):
            for pieces in self.piece_buckets:
                for rows in BATCH_GRAPH_ROWS:
                    shape = GraphShape(rows, keys, pieces)
                    if (keys == 0 or rows < keys) and self._batch_fits(shape):
                        out.append(shape)
        return out

    def common_shapes(self) -> list[GraphShape]:
        """The graphs captured before serving: every bucket from position 0 and after a prefix in the first window."""
        first = self.key_buckets[0] if self.key_buckets else 0
        return [s for s in self.shapes() if s.pieces == 1 and s.keys in (0, first)]

    def idle_rank(self, shape: GraphShape) -> float:
        """Where the graph comes among the idle-time captures, as a key window the runner compares with its step
        graphs' (steps of a shorter window first): a lone piece at its window (0 from position 0: a cold line's first
        audio waits on it); a batched pass just after the steps of its window (at least the first: the step graphs
        every take needs come first, and a pass with no graph yet only runs eagerly, as before)."""
        if shape.pieces == 1:
            return float(shape.keys)
        first = self.key_buckets[0] if self.key_buckets else 0
        return max(shape.keys, first) + 0.5

    def pending(self) -> list[GraphShape]:
        """Graphs not captured yet, the likeliest first (idle_rank; then few pieces, few rows)."""
        return sorted(
            (s for s in self.shapes() if s not in self._graphs), key=lambda s: (self.idle_rank(s), s.pieces, s.rows)
        )

    def run(self, slot: int, rows: torch.Tensor, start: int = 0) -> bool:
        """Prefill ``rows`` [T, channels] at positions start..start+T-1 of ``slot`` through a graph; False (nothing
        done) when no captured graph fits them. The slot's blocks for those positions must already be writable and
        pushed (the runner's prefill_batch), and positions 0..start-1 hold the slot's prefix."""
        return self.run_pass([(slot, rows, start)])

    def run_pass(self, pieces: list[tuple[int, torch.Tensor, int]]) -> bool:
        """Prefill (slot, rows [T, channels], start) pieces of distinct slots in one pass through a graph; False
        (nothing done) when no captured graph holds them (a lone piece's graph, or a batched one: shape_for_pass). As
        :meth:`run`: blocks writable and pushed, prefixes held."""
        widths = [int(rows.shape[0]) for _, rows, _ in pieces]
        starts = [int(start) for _, _, start in pieces]
        shape = self.shape_for_pass(widths, starts)
        g = self._graphs.get(shape) if shape is not None else None
        if g is None:
            return False
        # Built on the host and copied once (one copy per input, not per piece): padding pieces have no rows and
        # point at the first piece's slot (read, never written: their rows all go to scratch).
        count, (width, channels) = int(g.slots.shape[0]), g.rows.shape[1:]
        padded = torch.zeros((count, width, channels), dtype=torch.int64)
        for b, (_, rows, _) in enumerate(pieces):
            padded[b, : widths[b]] = rows
        pad = count - len(pieces)
        slots = [slot for slot, _, _ in pieces]
        meta = torch.tensor([slots + [slots[0]] * pad, starts + [0] * pad, widths + [0] * pad], dtype=torch.int64)
        g.rows.copy_(padded)
        g.slots.copy_(meta[0])
        g.starts.copy_(meta[1])
        g.counts.copy_(meta[2])
        g.graph.replay()
        self.replays += 1
        return True

    def capture_common(self) -> None:
        for shape in self.common_shapes():
            self.capture(shape)

    def capture_all(self) -> None:
        for shape in self.shapes():
            self.capture(shape)

    def capture(self, shape: GraphShape) -> None:
        if shape not in self._graphs:
            self._graphs[shape] = self._capture(shape)

    def run_padded(self, shape: GraphShape) -> None:
        """The pass of graph ``shape`` run once, eagerly, from its static inputs with every row padding: it writes
        only the scratch position (kernels compiled ahead of the capture, engine/warm_compile.py)."""
        self._pass(self._statics(shape), shape)

    def _pass(self, g: _PrefillGraph, shape: GraphShape) -> None:
        # From position 0 the key window is the pass's own rows (causal); after a prefix it is the bucket's keys.
        key_len = shape.rows if shape.from_zero else shape.keys
        prefill_batch_rows(
            self.model, self.state, self.tables, g.slots, g.rows, g.starts, g.counts, key_len,
            from_zero=shape.from_zero,
        )

    def _statics(self, shape: GraphShape) -> _PrefillGraph:
        """The graph's static inputs, every row padding (counts 0: a pass over them writes only to scratch)."""
        device = self.state.hidden.device

        def zeros(*dims: int) -> torch.Tensor:
            return torch.zeros(dims, dtype=torch.int64, device=device)

        p = shape.pieces
        return _PrefillGraph(
            slots=zeros(p), rows=zeros(p, shape.rows, self.model.config.n_channels), starts=zeros(p), counts=zeros(p)
        )

    def _capture(self, shape: GraphShape) -> _PrefillGraph:
        t0 = time.perf_counter()
        device = self.state.hidden.device
        g = self._statics(shape)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._pass(g, shape)  # one warm-up outside the capture (kernels compiled or loaded)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._pass(g, shape)
        torch.cuda.synchronize(device)
        g.graph = graph
        logger.info(
            "captured prefill graph %srows=%d %s in %.0f ms", f"pieces={shape.pieces} " if shape.pieces > 1 else "",
            shape.rows, "from position 0" if shape.from_zero else f"after a prefix, keys={shape.keys}",
            (time.perf_counter() - t0) * 1e3,
        )
        return g


def _key_buckets(max_seq_len: int) -> list[int]:
    """Key windows of the after-a-prefix graphs: PREFILL_GRAPH_MIN_KEYS doubling, the last one ``max_seq_len``
    (a prompt piece ends there at the latest: the runner refuses longer ones)."""
    out, keys = [], PREFILL_GRAPH_MIN_KEYS
    while keys < max_seq_len:
        out.append(keys)
        keys *= 2
    return [*out, max_seq_len]
