"""Batched streaming codec calls for the scheduler: small batches through CUDA graphs, large ones eager.

The full-size codec decoder is launch-bound when run eagerly (about 55 ms per call on an H200 whatever
the batch), while a captured graph replays a small call in about 9 ms. Graphs are captured per exact
(batch, T) (the decoder reads every stream's state through its block table, so one graph serves any set
of streams), so batches are padded up to a few bucket sizes with padding rows (states on the decoder's
scratch blocks, whose output is thrown away and whose position is reset before every call; the first entry
of every graphed batch is one). The likeliest graphs are captured before ready and the rest while the engine
is idle; until then a shape runs eagerly rather than stalling every stream for a capture, unless it keeps
coming under steady load (EAGER_CALLS_BEFORE_CAPTURE). Shapes without a graph (an odd chunk length in a
large batch, a long chunk) always run eagerly.

With ``defer_captures`` (the engine, whose codec runs on a worker thread next to the model's), calls are
counted when the scheduler hands them over (``note_call``, on its thread) and a shape that has come often
enough is listed in ``wanted`` instead of being captured inside ``decode``: a capture must not run while
another thread works on the device, so the scheduler has it captured between rounds (``capture_wanted``
through the codec worker, while it waits). Counting at hand-over keeps the point where a shape turns from
eager to graphed the same whether the codec runs overlapped or inline.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from moss_rt.codec.streaming import DecoderState, StreamingDecoder

log = logging.getLogger(__name__)

SMALL_BUCKETS = (2, 4, 8, 16)  # graphed batch sizes (padding stream included), every chunk length 1..8
# Plus max_slots + 2; graphed for the first chunk (T=1) and full chunks (T=8). 64 and 96 streams (a server of that
# many takes, every one due on the cadence) fit with their padding row: a 64-row bucket would send them to the next.
LARGE_BUCKETS = (32, 48, 64 + 2, 96 + 2)
SMALL_T = tuple(range(1, 9))
# Streams per codec call (bounds its activations: ~1 GB for 128 streams of 8 frames at full size); the top bucket is
# this + 2. Measured on H200s (bench/RESULTS.md, session 32): with every take its own line, 128 takes' full chunks
# in one call instead of two of 64 took the codec from 14.9-15.6 to 11.8-12.8 ms a step and the aggregate from
# 428-441x to 457-482x (two machines, each A/B'd on itself).
MAX_CALL_STREAMS = 128
# Buckets past this get their first- and full-chunk graphs after ready, while idle (first in line there), not in the
# start: only a server with more than 64 takes due on one step meets them, and each costs a start an eager warm-up
# call of up to 130 streams before its capture (an H200's second start captured its codec graphs in 2.9 s with
# them, 1.6 s without).
READY_MAX_BUCKET = 64 + 2
LARGE_T = (1, 8)
# A graphable shape that keeps coming while the engine is never idle (a server under steady load) is
# captured on its this-many-th eager call: a capture stalls the streams about as long as ~20 eager calls
# cost over graphed ones (~1 s vs ~55 ms a call on an H200), so waiting for an idle moment that never
# comes would cost more than it saves.
EAGER_CALLS_BEFORE_CAPTURE = 8


def graph_buckets(max_streams: int) -> tuple[int, ...]:
    """Batch sizes that get graphs; the last one holds every stream plus the leading padding stream."""
    top = max_streams + 2
    return tuple(sorted({b for b in (*SMALL_BUCKETS, *LARGE_BUCKETS) if b < top} | {top}))


class CodecBatcher:
    def __init__(self, decoder: StreamingDecoder, max_streams: int, *, defer_captures: bool = False) -> None:
        self.decoder = decoder
        self.defer_captures = defer_captures
        self.wanted: list[tuple[int, int]] = []  # shapes due for capture (defer_captures)
        self.graphs = bool(getattr(decoder, "cuda_graphs", False))
        # One call decodes at most this many streams: its activations (and a graph's pool) stay bounded
        # whatever the slot count; more streams due together are decoded in several calls.
        self.max_batch = max(1, min(max_streams, MAX_CALL_STREAMS))
        self.buckets = graph_buckets(self.max_batch)
        self._warm: set[tuple[int, int]] = set()
        self._eager_calls: dict[tuple[int, int], int] = defaultdict(int)
        self._pads: list[DecoderState] = []
        if self.graphs:
            # Every padding row shares the decoder's scratch pool row: its output is thrown away and rows
            # of a batched call never read each other's state, so padding costs no stream memory.
            self._pads = [decoder.scratch_state() for _ in range(self.pad_streams(self.max_batch))]

    @staticmethod
    def pad_streams(max_streams: int) -> int:
        """Padding rows a graphed call may need (the widest bucket gap); they hold no decoder slot."""
        buckets = graph_buckets(max_streams)
        return max(b - (prev + 1) for prev, b in zip((0, *buckets), buckets, strict=False)) + 1

    def shapes(self) -> list[tuple[int, int]]:
        """Every (batch bucket, chunk length) that gets a graph, the likeliest first: the first chunk (T=1)
        and full chunks (T=8) of small batches, then larger batches, then the odd chunk lengths."""
        out = []
        for b in self.buckets:
            for t in SMALL_T if b <= SMALL_BUCKETS[-1] else LARGE_T:
                if t <= self.decoder.max_chunk_frames and b <= self.decoder.max_streams:
                    out.append((b, t))
        return sorted(out, key=lambda bt: (bt[1] not in LARGE_T, bt[0], bt[1]))

    def pending(self) -> list[tuple[int, int]]:
        return [] if not self.graphs else [bt for bt in self.shapes() if bt not in self._warm]

    def ahead_shapes(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Graph shapes not captured yet, whose kernels may compile ahead (``compile_shape``): the first-chunk and
        full-chunk ones (T in LARGE_T, what ``warm_up(main_only=True)`` captures), then the odd chunk lengths. With
        or without graphs: eager calls of these shapes compile the same kernels."""
        missing = [bt for bt in self.shapes() if bt not in self._warm]
        return [bt for bt in missing if bt[1] in LARGE_T], [bt for bt in missing if bt[1] not in LARGE_T]

    def compile_shape(self, bucket: int, t: int) -> None:
        """One eager call of graph shape (bucket, t) on the decoder's scratch row, compiling its kernels ahead of its
        capture (engine/warm_compile.py; before any capture, while nothing else decodes)."""
        self.decoder.compile_shape(bucket, t)

    def capture_next(self, main_only: bool = False, max_bucket: int | None = None) -> bool:
        """Capture the likeliest missing graph (the engine calls this while idle); False: none left (with
        ``main_only``: no first-chunk or full-chunk shape left, T in LARGE_T; with ``max_bucket``: none of a batch
        bucket up to it). Until a shape has its graph, calls of that shape run eagerly (same numbers, slower)."""
        pending = [bt for bt in self.pending() if bt[1] in LARGE_T] if main_only else self.pending()
        if max_bucket is not None:
            pending = [bt for bt in pending if bt[0] <= max_bucket]
        if not pending:
            return False
        b, t = pending[0]
        self.decoder.warmup([b], [t], contiguous_from=None)
        self._warm.add((b, t))
        return True

    def warm_up(self, limit: int | None = None, main_only: bool = False, max_bucket: int | None = None) -> None:
        """Capture graphs now (all, the ``limit`` likeliest, or with ``main_only`` every first-chunk and
        full-chunk shape; with ``max_bucket`` only batch buckets up to it): a shape without one runs eagerly,
        never captures in the middle of streaming."""
        n = 0
        while (limit is None or n < limit) and self.capture_next(main_only, max_bucket):
            n += 1

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Run the decoder without graphs (renders, rebuilds, big batches); numerics are the same."""
        saved = self.decoder.cuda_graphs if self.graphs else False
        if self.graphs:
            self.decoder.cuda_graphs = False
        try:
            yield
        finally:
            if self.graphs:
                self.decoder.cuda_graphs = saved

    def _capture_under_load(self, bucket: int, t: int) -> None:
        log.info("codec shape (batch %d, %d frames) keeps coming under load: capturing its graph", bucket, t)
        self.decoder.warmup([bucket], [t], contiguous_from=None)  # writes only the scratch blocks
        self._warm.add((bucket, t))

    def capture_wanted(self) -> bool:
        """Capture the shapes listed in ``wanted`` (defer_captures); False when there were none."""
        wanted, self.wanted = self.wanted, []
        for bucket, t in wanted:
            if (bucket, t) not in self._warm:
                self._capture_under_load(bucket, t)
        return bool(wanted)

    def _groups(self, chunks: Sequence[np.ndarray]) -> list[tuple[int, list[int]]]:
        """(T, stream indices) of each decoder call a ``decode`` makes: equal T together, max_batch at most."""
        by_t: dict[int, list[int]] = defaultdict(list)
        for i, chunk in enumerate(chunks):
            by_t[int(chunk.shape[0])].append(i)
        size = self.max_batch
        return [(t, every[at : at + size]) for t, every in by_t.items() for at in range(0, len(every), size)]

    def streams_per_call(self, t: int, cap: int) -> int:
        """Streams one call of ``t``-frame chunks should hold at most, for a wanted ``cap``: never more than
        max_batch, and with graphs, for a chunk length that gets graphs only in the small buckets (not T in LARGE_T),
        no more than the largest small bucket holds (a larger batch of it would run eagerly: about 55 ms on an H200).
        Depends on the configuration only, never on which graphs are captured yet (calls must not follow timings)."""
        cap = max(1, min(int(cap), self.max_batch))
        if self.graphs and t not in LARGE_T:
            cap = min(cap, SMALL_BUCKETS[-1] - 1)
        return cap

    def graphed(self, n: int, t: int) -> bool:
        """Whether a call of ``n`` streams of ``t``-frame chunks replays a captured graph now (else it runs eagerly)."""
        bucket = self._bucket(min(n, self.max_batch))
        return self.graphs and bucket is not None and (bucket, t) in self._warm

    def _bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n + 1), None)

    def note_call(self, chunks: Sequence[np.ndarray]) -> None:
        """``defer_captures``: count the shapes of a ``decode`` of these chunks that is about to be handed over."""
        for t, idxs in self._groups(chunks):
            self._count_eager(self._bucket(len(idxs)), t)

    def _count_eager(self, bucket: int | None, t: int) -> None:
        if not self.graphs or bucket is None or (bucket, t) in self._warm:
            return
        self._eager_calls[(bucket, t)] += 1
        if self._eager_calls[(bucket, t)] >= EAGER_CALLS_BEFORE_CAPTURE and (bucket, t) in self.shapes():
            if not self.defer_captures:
                self._capture_under_load(bucket, t)
            elif (bucket, t) not in self.wanted:
                self.wanted.append((bucket, t))

    def decode(self, states: Sequence[DecoderState], chunks: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Audio [2, 3840*T_i] float32 for each stream; streams with equal T share one call."""
        out: list[np.ndarray | None] = [None] * len(states)
        for t, idxs in self._groups(chunks):
            audio = self._decode_group([states[i] for i in idxs], [chunks[i] for i in idxs], t, self.decoder.decode)
            for i, a in zip(idxs, audio, strict=True):
                out[i] = a
        return [a for a in out if a is not None]

    def advance(self, states: Sequence[DecoderState], chunks: Sequence[np.ndarray]) -> None:
        """Advance each state through its chunk and throw the audio away (rebuilding retakes' states from their
        kept frames): the same batched, graphed calls as :meth:`decode`, no copy to the host. Returns once the
        device is done, like every codec call (the worker's stream is idle whenever the worker is)."""
        for t, idxs in self._groups(chunks):
            self._decode_group([states[i] for i in idxs], [chunks[i] for i in idxs], t, self.decoder.decode_tensors)
        device = getattr(self.decoder, "device", None)
        if device is not None and getattr(device, "type", None) == "cuda":
            import torch  # here: importing the scheduler needs no torch

            torch.cuda.current_stream(device).synchronize()

    def decode_pcm(
        self, states: Sequence[DecoderState], chunks: Sequence[np.ndarray], channels: Sequence[int]
    ) -> list[bytes]:
        """int16 PCM bytes per stream (``audio.to_int16_pcm`` of ``decode``'s audio, bit for bit), converted on the
        decoder's device: one conversion and one copy to the host per call, padding rows never copied (codec/pcm)."""
        from moss_rt.codec.pcm import int16_pcm  # here: importing the scheduler needs no torch

        out: list[bytes] = [b""] * len(states)
        for t, idxs in self._groups(chunks):
            group = [states[i] for i in idxs]
            audio = self._decode_group(group, [chunks[i] for i in idxs], t, self.decoder.decode_tensors)
            for i, pcm in zip(idxs, int16_pcm(audio, [channels[i] for i in idxs]), strict=True):
                out[i] = pcm
        return out

    def _decode_group(
        self, states: list[DecoderState], chunks: list[np.ndarray], t: int, run: Callable[..., list[Any]]
    ) -> list[Any]:
        n = len(states)
        bucket = self._bucket(n)
        if not self.defer_captures:
            self._count_eager(bucket, t)
        if not self.graphs or bucket is None or (bucket, t) not in self._warm:
            with self.eager():
                return run(states, chunks)
        pads = self._pads[: bucket - n]
        for pad in pads:
            pad.frames = 0  # padding output is discarded; keep its positions small and fixed
        silence = np.zeros((t, chunks[0].shape[1]), dtype=np.int64)
        batch_states = [pads[0], *states, *pads[1:]]
        batch_chunks = [silence, *chunks, *([silence] * (len(pads) - 1))]
        audio = run(batch_states, batch_chunks)
        return audio[1 : 1 + n]

    def close(self) -> None:
        self._pads = []  # scratch-row states: nothing to give back
