"""CUDA graphs of a lone fresh prompt's prefill pass: one slot, rows from position 0, up to 512 rows.

Why: run eagerly, a pass over one 400-row prompt is launch-bound (about 22 ms on an H200 for 4 ms of GEMMs: 36
layers of Python and kernel launches), and it is most of what a lone arrival's first audio waits for; a take that
arrives while others stream is prefilled this way too. Replayed from a graph it costs about its GEMMs.

One graph per row bucket (``PREFILL_GRAPH_ROWS`` up to the runner's ``max_seq_len``): the prompt is padded to the
bucket, and padded rows write their keys, values and hidden state to the scratch position, as in any padded pass
(``step.prefill_batch_rows``), so the cache holds exactly the prompt's rows. The GEMMs then see the bucket's row
count instead of the prompt's: the cache equals an eager pass to float rounding, not bit for bit (as a batched pass
does). Batched passes of several takes (bursts) and later chunks of long prompts stay eager: they are compute-bound.

Graphs are captured with every row marked padded (the capture's runs write only to scratch) and replay from their
static inputs; they share the runner's graph memory pool (they and the step graphs run on one thread, never at once).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from moss_rt.model.network import MossTTSLocalModel
from moss_rt.model.state import SlotState
from moss_rt.model.step import Tables, prefill_batch_rows

logger = logging.getLogger(__name__)

PREFILL_GRAPH_ROWS = (128, 256, 384, 512)


@dataclass
class _PrefillGraph:
    slots: torch.Tensor  # [1] the slot
    rows: torch.Tensor  # [1, T, channels] the prompt, zero-padded
    starts: torch.Tensor  # [1] always 0
    counts: torch.Tensor  # [1] the prompt's rows
    graph: torch.cuda.CUDAGraph | None = None


class PrefillGraphs:
    def __init__(
        self,
        model: MossTTSLocalModel,
        state: SlotState,
        tables: Tables,
        max_rows: int,
        pool: Any,
    ) -> None:
        self.model, self.state, self.tables = model, state, tables
        self.buckets = [b for b in PREFILL_GRAPH_ROWS if b <= max_rows]
        self._pool = pool  # the runner's graph memory pool handle
        self._graphs: dict[int, _PrefillGraph] = {}
        self.replays = 0  # passes that ran through a graph

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def run(self, slot: int, rows: torch.Tensor) -> bool:
        """Prefill ``rows`` [T, channels] at positions 0..T-1 of ``slot`` through a graph; False (nothing done) when
        no captured graph fits them. The slot's blocks must already be writable (the runner's prefill_batch)."""
        bucket = self.bucket(int(rows.shape[0]))
        g = self._graphs.get(bucket) if bucket is not None else None
        if g is None:
            return False
        n = int(rows.shape[0])
        g.rows.zero_()
        g.rows[0, :n].copy_(rows)
        g.slots.fill_(slot)
        g.counts.fill_(n)
        assert g.graph is not None
        g.graph.replay()
        self.replays += 1
        return True

    def capture_all(self) -> None:
        for bucket in self.buckets:
            if bucket not in self._graphs:
                self._graphs[bucket] = self._capture(bucket)

    def _pass(self, g: _PrefillGraph, width: int) -> None:
        prefill_batch_rows(
            self.model, self.state, self.tables, g.slots, g.rows, g.starts, g.counts, width, from_zero=True
        )

    def _capture(self, width: int) -> _PrefillGraph:
        t0 = time.perf_counter()
        device = self.state.hidden.device
        channels = self.model.config.n_channels

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        g = _PrefillGraph(slots=zeros(1), rows=zeros(1, width, channels), starts=zeros(1), counts=zeros(1))
        # counts = 0: every row is padding, so these runs (and the capture) write only to the scratch position.
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up kernels and the allocator outside the capture
                self._pass(g, width)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._pass(g, width)
        torch.cuda.synchronize(device)
        g.graph = graph
        logger.info("captured prefill graph rows=%d in %.0f ms", width, (time.perf_counter() - t0) * 1e3)
        return g
