"""The CTC network on a CUDA device: one CUDA graph per padded batch shape, replayed.

Eagerly, one call of the MMS-300m network launches ~600 kernels from Python (~30 ms an H200 call whatever its size,
at the sizes streaming makes); replaying a captured graph launches them all at once. A batch is padded to a few
shapes (:func:`moss_rt.align.ctc.padded_shape`), so a graph per shape covers the stream of jobs.

- **Lazily, per shape**: a shape is captured the first time a batch of it comes (two warm-up passes and the capture,
  about three calls' worth, once), then replayed. Not ahead at start: which shapes come depends on the load (takes,
  the window setting, the batch limit), ~11 row counts × 24 lengths could, and capturing them all would hold the
  GPU for many seconds while the engine warms up its own graphs, for shapes a quiet service never sees.
- **Bounded by a memory budget** (``budget_bytes``, default :data:`~moss_rt.align.memory.DEFAULT_GRAPH_MEMORY_BYTES`,
  1.5 GiB; ``--aligner-graph-mb``): graphs are captured for the shapes of a rectangle, at most ``max_rows`` rows of at
  most :data:`GRAPH_MAX_SEC`, whose corner (the *envelope*) a pass fits the budget by
  :func:`~moss_rt.align.memory.pass_bytes` (a conservative bound; rows are cut down until it does). Every graph
  shares one memory pool, captured on one stream, and a fresh pool captures the envelope first: every later shape's
  tensors are no bigger than the envelope's, so its capture reuses the blocks the envelope's pass left free, and the
  pool holds about one pass of the envelope, not the sum of the shapes. The pool is measured after each capture; past
  the budget (the estimate was wrong) the graphs and their pool are all dropped (``resets``) and the region shrinks
  when the envelope alone overflowed; after :data:`MAX_RESETS` the graphs are off and every call runs eagerly.
  Bigger batches (a long take's whole audio, ``POST /api/align`` of a long file) run the same forward eagerly, on
  the same stream (one allocator cache for them and the captures' warm-ups), and so does a shape whose capture
  failed. At most ``max_graphs`` graphs are kept (host memory; the least recently used one makes room).

  Why one stream: the caching allocator reuses a freed block only for the stream it was allocated on, in a graph's
  private pool too. A new side stream for each capture (from PyTorch's pool of 32 per device) kept every capture from
  reusing the blocks of the ones before: on an H200 33 captures held an 11.7 GB pool, ~32 passes' peaks side by side.
- **Inputs and outputs** are two flat device buffers shared by every graph (a shape views their first elements):
  the host copies the batch's audio into a pinned staging buffer (no padding written: the pass masks by length),
  one copy to the device, the replay, one copy of the real rows' log-probabilities back.

:class:`ShapeGraphs` is the decision logic (replay, capture, or run eagerly; the bounds; the counters), with the
capture itself passed in, so it is tested on a CPU with a stand-in (tests/align/test_ctc_graphs.py).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from moss_rt.align.memory import DEFAULT_GRAPH_MEMORY_BYTES

log = logging.getLogger(__name__)

GRAPH_MAX_SEC = 6.0  # the longest padded window captured (the streaming window, 5 s, and then some)
MAX_GRAPHS = 128  # shapes kept captured at once (host memory; the device memory is the shared pool's)
MAX_RESETS = 4  # pools dropped for going past the budget before the graphs are turned off

Shape = tuple[int, int]  # (rows, samples), padded
G = TypeVar("G")


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    eager: int = 0  # calls of a shape too big to capture (or past the budget, or graphs off)
    evicted: int = 0
    failed: int = 0  # shapes whose capture failed (run eagerly from then on)
    capture_sec: float = 0.0  # time spent capturing (warm-up passes included)
    pool_bytes: int | None = 0  # device memory the graphs' shared pool holds (None: the allocator cannot say)
    pool_peak_bytes: int = 0  # the most it held (measured; the estimate where it cannot be)
    budget_bytes: int = 0
    envelope_bytes: int = 0  # the estimated pass of the largest shape captured (what the pool should hold)
    resets: int = 0  # pools dropped because a capture took the pool past the budget
    disabled: bool = False  # graphs off after MAX_RESETS resets: every call eager

    def as_dict(self) -> dict[str, Any]:
        mb = None if self.pool_bytes is None else round(self.pool_bytes / 2**20)
        return {
            **self.__dict__, "capture_sec": round(self.capture_sec, 3), "pool_mb": mb,
            "pool_peak_mb": round(self.pool_peak_bytes / 2**20), "budget_mb": round(self.budget_bytes / 2**20),
        }  # fmt: skip


def halving(rows: int) -> list[int]:
    """Row counts to fall back to, largest first: ``rows``, then halves down to 1."""
    out = [max(1, rows)]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


class ShapeGraphs(Generic[G]):
    """Which graph a padded shape replays: a captured one, one captured now (``capture``), or None (run eagerly),
    within ``budget_bytes`` of pool memory: ``estimate(shape)`` bounds a shape's pass, ``pool_bytes()`` measures the
    pool (None: it cannot), ``new_pool()`` drops the pool (called once every graph is dropped)."""

    def __init__(
        self,
        capture: Callable[[Shape], G],
        *,
        max_rows: int,
        max_samples: int,
        budget_bytes: int,
        estimate: Callable[[Shape], int],
        pool_bytes: Callable[[], int | None] = lambda: None,
        new_pool: Callable[[], None] = lambda: None,
        max_graphs: int = MAX_GRAPHS,
        rows_ladder: Sequence[int] | None = None,
    ) -> None:
        self._capture = capture
        self._estimate = estimate
        self._pool_bytes = pool_bytes
        self._new_pool = new_pool
        self.max_samples = max(1, max_samples)
        self.max_graphs = max(1, max_graphs)
        # The row counts the region may have, largest first (the padded ones: a shape's rows are one of them).
        self._ladder = sorted({r for r in (rows_ladder or halving(max_rows)) if 0 < r <= max_rows}, reverse=True)
        self._graphs: OrderedDict[Shape, G] = OrderedDict()  # least recently used first
        self._failed: set[Shape] = set()  # never tried again (finite: only shapes that fit are tried)
        self.stats = GraphStats(budget_bytes=max(0, budget_bytes))
        self.max_rows = 0
        self._shrink(max_rows)

    def __len__(self) -> int:
        return len(self._graphs)

    def shapes(self) -> list[Shape]:
        return list(self._graphs)

    @property
    def envelope(self) -> Shape:
        """The region's largest shape: captured first in a fresh pool."""
        return self.max_rows, self.max_samples

    def fits(self, shape: Shape) -> bool:
        return not self.stats.disabled and 0 < shape[0] <= self.max_rows and 0 < shape[1] <= self.max_samples

    def _shrink(self, below: int) -> None:
        """The region's rows: the largest of the ladder up to ``below`` whose envelope fits the budget (none: off)."""
        budget = self.stats.budget_bytes
        rows = next((r for r in self._ladder if r <= below and self._estimate((r, self.max_samples)) <= budget), 0)
        self.max_rows = rows
        if rows == 0:
            self.stats.disabled = True
            self.stats.envelope_bytes = 0
            log.warning("aligner: no graph of %d samples fits the %.0f MB graph budget: the CTC network runs eagerly",
                        self.max_samples, budget / 2**20)  # fmt: skip
        else:
            self.stats.envelope_bytes = self._estimate(self.envelope)

    def graph(self, shape: Shape) -> G | None:
        """The graph for ``shape``, captured on first use; None: run it eagerly (too big, failed, over budget)."""
        found = self._graphs.get(shape)
        if found is not None:
            self._graphs.move_to_end(shape)
            self.stats.replays += 1
            return found
        if not self.fits(shape) or shape in self._failed:
            self.stats.eager += 1
            return None
        if not self._graphs and shape != self.envelope and self.envelope not in self._failed:
            # A fresh pool: the largest shape first, so the others' captures reuse its blocks.
            self._add(self.envelope)
            if not self.fits(shape):  # the envelope went past the budget: the region shrank
                self.stats.eager += 1
                return None
        graph = self._add(shape)
        if graph is None:
            self.stats.eager += 1
            return None
        self.stats.replays += 1
        return graph

    def _add(self, shape: Shape) -> G | None:
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)  # its blocks stay in the pool, for the next captures
            self.stats.evicted += 1
        t0 = time.perf_counter()
        try:
            graph = self._capture(shape)
        except Exception:  # a capture the driver refuses: this shape runs eagerly, the words still come
            log.exception("aligner: capturing the CTC network for %d rows × %d samples failed; it runs eagerly", *shape)
            self._failed.add(shape)
            self.stats.failed += 1
            return None
        finally:
            self.stats.capture_sec += time.perf_counter() - t0
        measured = self._pool_bytes()
        self.stats.pool_bytes = measured
        held = self.stats.envelope_bytes if measured is None else measured
        self.stats.pool_peak_bytes = max(self.stats.pool_peak_bytes, held)
        if held > self.stats.budget_bytes:
            alone = not self._graphs
            del graph
            self._reset()
            log.warning(
                "aligner: capturing %d rows × %d samples took the graphs' pool to %.0f MB, past the %.0f MB budget: "
                "the graphs and their pool are dropped (%d times so far)%s", *shape, held / 2**20,
                self.stats.budget_bytes / 2**20, self.stats.resets, "; the graphs' rows shrink" if alone else "",
            )  # fmt: skip
            if alone:  # even one pass of this shape is bigger than estimated: smaller shapes from now on
                self._shrink(shape[0] - 1)
            if self.stats.resets >= MAX_RESETS and not self.stats.disabled:
                self.stats.disabled = True
                log.warning("aligner: the graphs' pool went past its budget %d times: the CTC network runs eagerly "
                            "from now on", self.stats.resets)  # fmt: skip
            return None
        self.stats.captures += 1
        self._graphs[shape] = graph
        log.info("aligner: captured the CTC network for %d rows × %d samples (%d graphs, their pool %s of %.0f MB)",
                 *shape, len(self._graphs), "unknown" if measured is None else f"{measured / 2**20:.0f} MB",
                 self.stats.budget_bytes / 2**20)  # fmt: skip
        return graph

    def _reset(self) -> None:
        """Drop every graph, then their pool (its memory goes back once no graph holds it)."""
        self._graphs.clear()
        self._new_pool()
        self.stats.resets += 1
        self.stats.pool_bytes = 0


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    frames: int


class GraphedCtc:
    """A :class:`~moss_rt.align.ctc_net.CtcNet` on a CUDA device, run through :class:`ShapeGraphs`. One thread
    calls :meth:`run` (the aligner's worker); every pass it makes (warm-ups, captures, eager calls) runs on its one
    stream."""

    def __init__(self, net: Any, device: Any, *, max_rows: int, sample_rate: int, normalize: bool,
                 vocab: int, estimate: Callable[[Shape], int], budget_bytes: int = DEFAULT_GRAPH_MEMORY_BYTES,
                 rows_ladder: Sequence[int] | None = None, max_graphs: int = MAX_GRAPHS,
                 max_sec: float = GRAPH_MAX_SEC) -> None:  # fmt: skip
        import torch

        self.net = net
        self.device = torch.device(device)
        self.sample_rate = sample_rate
        self.normalize = normalize
        self._stream = torch.cuda.Stream(device=self.device)  # one stream: the allocator reuses blocks per stream
        self._pool = torch.cuda.graph_pool_handle()
        self.graphs: ShapeGraphs[_Captured] = ShapeGraphs(
            self._capture, max_rows=max(1, max_rows), max_samples=int(max_sec * sample_rate),
            budget_bytes=budget_bytes, estimate=estimate, pool_bytes=self._pool_bytes, new_pool=self._new_pool,
            max_graphs=max_graphs, rows_ladder=rows_ladder,
        )  # fmt: skip
        rows = max(1, self.graphs.max_rows)  # the region only shrinks: buffers for its first envelope
        elements = rows * self.graphs.max_samples
        frames = int(net.frames(torch.tensor(self.graphs.max_samples)).item())
        self._staging = torch.zeros(elements, dtype=torch.float32).pin_memory()
        self._audio = torch.zeros(elements, dtype=torch.float32, device=self.device)
        self._lengths = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self._out = torch.zeros(rows * frames * vocab, dtype=torch.float32, device=self.device)
        self._vocab = vocab

    @property
    def stats(self) -> dict[str, Any]:
        return {**self.graphs.stats.as_dict(), "graphs": len(self.graphs), "max_rows": self.graphs.max_rows}

    @property
    def max_rows(self) -> int:
        """Rows a call may have and still replay a graph (0: graphs off)."""
        return 0 if self.graphs.stats.disabled else self.graphs.max_rows

    @property
    def buffer_bytes(self) -> int:
        """The device buffers' bytes (inputs and outputs)."""
        return sum(t.numel() * t.element_size() for t in (self._audio, self._lengths, self._out))

    def run(self, batch: Sequence[np.ndarray], shape: Shape) -> np.ndarray:
        """Log-probabilities [len(batch), frames, vocabulary] of the audios of ``batch`` padded to ``shape``."""
        import torch

        rows, samples = shape
        lengths = np.full(rows, samples, dtype=np.int64)  # padding rows: all (masked-off) samples, dropped after
        lengths[: len(batch)] = [len(a) for a in batch]
        if self.graphs.fits(shape):
            staging = self._staging.numpy()
            for row, a in enumerate(batch):
                staging[row * samples : row * samples + len(a)] = a
            self._audio[: rows * samples].copy_(self._staging[: rows * samples], non_blocking=True)
            self._lengths[:rows].copy_(torch.from_numpy(lengths))
        captured = self.graphs.graph(shape)
        if captured is None:  # too big to capture (or its capture failed, or over budget): the same pass, eagerly
            audio = np.zeros((rows, samples), dtype=np.float32)
            for row, a in enumerate(batch):
                audio[row, : len(a)] = a
            # On the aligner's stream: its allocator cache is the captures' warm-ups' (one cache, not two).
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                x = torch.from_numpy(audio).to(self.device)
                lp = self.net(x, torch.from_numpy(lengths).to(self.device), normalize=self.normalize)
                return np.asarray(lp[: len(batch)].cpu().numpy())
        captured.graph.replay()
        out = self._out[: rows * captured.frames * self._vocab].view(rows, captured.frames, self._vocab)
        return np.asarray(out[: len(batch)].cpu().numpy())

    def _statics(self, shape: Shape) -> tuple[Any, Any, Any]:
        rows, samples = shape
        return self._audio[: rows * samples].view(rows, samples), self._lengths[:rows], self._out

    def _new_pool(self) -> None:
        import torch

        # The old handle's memory goes back to the allocator once its last graph is gone (the graphs were dropped
        # just before): the allocator hands it to the driver at its next cache release (an allocation that would
        # not fit otherwise, or empty_cache), not here: this thread must not free memory under the engine's captures.
        self._pool = torch.cuda.graph_pool_handle()

    def _capture(self, shape: Shape) -> _Captured:
        import torch

        audio, lengths, out = self._statics(shape)
        current = torch.cuda.current_stream(self.device)
        side = self._stream
        if shape[0] * shape[1] > self._audio.numel() or shape[0] > self._lengths.numel():
            raise ValueError(f"shape {shape} is outside the graphs' buffers")
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):  # kernels chosen and workspaces allocated outside the capture
                lp = self.net(audio, lengths, normalize=self.normalize)
        current.wait_stream(side)
        frames = int(lp.shape[1])
        flat = out[: shape[0] * frames * self._vocab]
        del lp
        graph = torch.cuda.CUDAGraph()
        # Captured by hand rather than with torch.cuda.graph(), which synchronises the device and empties the
        # allocator's cache first: the engine's threads keep using the device while this captures, and their cached
        # blocks are theirs. thread_local: their allocations and synchronisations do not break this capture.
        side.wait_stream(current)
        with torch.cuda.stream(side):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                lp = self.net(audio, lengths, normalize=self.normalize)
                flat.view(lp.shape).copy_(lp)
                del lp
            finally:
                graph.capture_end()
        current.wait_stream(side)
        side.synchronize()
        return _Captured(graph, frames)

    def _pool_bytes(self) -> int | None:
        """Device memory the graphs' shared pool holds (its segments); None where the allocator cannot say."""
        import torch

        try:
            try:
                segments = torch.cuda.memory_snapshot(self._pool, include_traces=False)
            except TypeError:  # an older torch: no include_traces
                segments = torch.cuda.memory_snapshot(self._pool)
        except Exception:  # no per-pool snapshots: say nothing rather than something wrong
            log.debug("aligner: no snapshot of the graph pool", exc_info=True)
            return None
        return int(sum(seg.get("total_size", 0) for seg in segments))
