"""The CTC network on a CUDA device: one CUDA graph per padded batch shape, replayed.

Eagerly, one call of the MMS-300m network launches ~600 kernels from Python (~30 ms an H200 call whatever its size,
at the sizes streaming makes); replaying a captured graph launches them all at once. A batch is padded to a few
shapes (:func:`moss_rt.align.ctc.padded_shape`), so a graph per shape covers the stream of jobs.

- **Lazily, per shape**: a shape is captured the first time a batch of it comes (two warm-up passes and the capture,
  about three calls' worth, once), then replayed. Not ahead at start: which shapes come depends on the load (takes,
  the window setting, the batch limit), ~11 row counts × 24 lengths could, and capturing them all would hold the
  GPU for many seconds while the engine warms up its own graphs, for shapes a quiet service never sees.
- **Bounded**: only shapes of at most ``max_rows`` rows and ``max_elements`` samples (rows × samples; the
  streaming jobs' shapes: up to the batch limit of rows of :data:`GRAPH_MAX_SEC`) are captured, at most
  ``max_graphs`` of them (the least recently used one is dropped for a new one). Bigger batches (a long take's
  whole audio, ``POST /api/align`` of a long file) run the same forward eagerly, and so does a shape whose capture
  failed. All graphs share one memory pool: they replay one at a time on the aligner's one worker thread and
  their inputs and outputs live outside the pool, so the pool holds what the largest shape's pass needs, not the
  sum. The pool's size is logged at each capture and in :attr:`GraphedCtc.stats`.
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

log = logging.getLogger(__name__)

GRAPH_MAX_SEC = 6.0  # the longest padded window captured (the streaming window, 5 s, and then some)
MAX_GRAPHS = 128  # shapes kept captured at once (host memory; the device memory is the shared pool's)

Shape = tuple[int, int]  # (rows, samples), padded
G = TypeVar("G")


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    eager: int = 0  # calls of a shape too big to capture
    evicted: int = 0
    failed: int = 0  # shapes whose capture failed (run eagerly from then on)
    capture_sec: float = 0.0  # time spent capturing (warm-up passes included)
    pool_bytes: int | None = 0  # device memory the graphs' shared pool holds (None: the allocator cannot say)

    def as_dict(self) -> dict[str, Any]:
        mb = None if self.pool_bytes is None else round(self.pool_bytes / 2**20)
        return {**self.__dict__, "capture_sec": round(self.capture_sec, 3), "pool_mb": mb}


class ShapeGraphs(Generic[G]):
    """Which graph a padded shape replays: a captured one, one captured now (``capture``), or None (run eagerly)."""

    def __init__(
        self, capture: Callable[[Shape], G], *, max_rows: int, max_elements: int, max_graphs: int = MAX_GRAPHS
    ) -> None:
        self._capture = capture
        self.max_rows = max_rows
        self.max_elements = max_elements
        self.max_graphs = max(1, max_graphs)
        self._graphs: OrderedDict[Shape, G] = OrderedDict()  # least recently used first
        self._failed: set[Shape] = set()  # never tried again (finite: only shapes that fit are tried)
        self.stats = GraphStats()

    def __len__(self) -> int:
        return len(self._graphs)

    def shapes(self) -> list[Shape]:
        return list(self._graphs)

    def fits(self, shape: Shape) -> bool:
        return shape[0] <= self.max_rows and shape[0] * shape[1] <= self.max_elements

    def graph(self, shape: Shape) -> G | None:
        """The graph for ``shape``, captured on first use; None: too big, run it eagerly."""
        found = self._graphs.get(shape)
        if found is not None:
            self._graphs.move_to_end(shape)
            self.stats.replays += 1
            return found
        if not self.fits(shape) or shape in self._failed:
            self.stats.eager += 1
            return None
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
            self.stats.evicted += 1
        t0 = time.perf_counter()
        try:
            graph = self._capture(shape)
        except Exception:  # a capture the driver refuses: this shape runs eagerly, the words still come
            log.exception("aligner: capturing the CTC network for %d rows × %d samples failed; it runs eagerly", *shape)
            self._failed.add(shape)
            self.stats.failed += 1
            self.stats.eager += 1
            return None
        finally:
            self.stats.capture_sec += time.perf_counter() - t0
        self.stats.captures += 1
        self.stats.replays += 1
        self._graphs[shape] = graph
        return graph


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    frames: int


class GraphedCtc:
    """A :class:`~moss_rt.align.ctc_net.CtcNet` on a CUDA device, run through :class:`ShapeGraphs`. One thread
    calls :meth:`run` (the aligner's worker)."""

    def __init__(self, net: Any, device: Any, *, max_rows: int, sample_rate: int, normalize: bool,
                 vocab: int, max_graphs: int = MAX_GRAPHS, max_sec: float = GRAPH_MAX_SEC) -> None:  # fmt: skip
        import torch

        self.net = net
        self.device = torch.device(device)
        self.sample_rate = sample_rate
        self.normalize = normalize
        max_elements = max(1, max_rows) * int(max_sec * sample_rate)
        self.graphs: ShapeGraphs[_Captured] = ShapeGraphs(
            self._capture, max_rows=max(1, max_rows), max_elements=max_elements, max_graphs=max_graphs
        )
        frames = int(net.frames(torch.tensor(max_elements)).item()) + max(1, max_rows)
        self._staging = torch.zeros(max_elements, dtype=torch.float32).pin_memory()
        self._audio = torch.zeros(max_elements, dtype=torch.float32, device=self.device)
        self._lengths = torch.zeros(max(1, max_rows), dtype=torch.int64, device=self.device)
        self._out = torch.zeros(frames * vocab, dtype=torch.float32, device=self.device)
        self._vocab = vocab
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def stats(self) -> dict[str, Any]:
        return {**self.graphs.stats.as_dict(), "graphs": len(self.graphs)}

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
        if captured is None:  # too big to capture (or its capture failed): the same pass, eagerly
            audio = np.zeros((rows, samples), dtype=np.float32)
            for row, a in enumerate(batch):
                audio[row, : len(a)] = a
            x = torch.from_numpy(audio).to(self.device)
            lp = self.net(x, torch.from_numpy(lengths).to(self.device), normalize=self.normalize)
            return np.asarray(lp[: len(batch)].cpu().numpy())
        captured.graph.replay()
        out = self._out[: rows * captured.frames * self._vocab].view(rows, captured.frames, self._vocab)
        return np.asarray(out[: len(batch)].cpu().numpy())

    def _statics(self, shape: Shape) -> tuple[Any, Any, Any]:
        rows, samples = shape
        return self._audio[: rows * samples].view(rows, samples), self._lengths[:rows], self._out

    def _capture(self, shape: Shape) -> _Captured:
        import torch

        audio, lengths, out = self._statics(shape)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
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
        self.graphs.stats.pool_bytes = self._pool_bytes()
        pool = self.graphs.stats.pool_bytes
        log.info(
            "aligner: captured the CTC network for %d rows × %.2f s (%d graphs, their memory pool %s)",
            shape[0], shape[1] / self.sample_rate, len(self.graphs) + 1,
            "unknown" if pool is None else f"{pool / 2**20:.0f} MB",
        )  # fmt: skip
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
