"""Batched streaming codec calls for the scheduler: small batches through CUDA graphs, large ones eager.

The full-size codec decoder is launch-bound when run eagerly (about 55 ms per call on an H200 whatever
the batch), while a captured graph replays a small call in about 9 ms. Graphs are captured per exact
(batch, T), so small batches are padded up to a few bucket sizes with padding streams (states of their
own whose output is thrown away and whose position is reset before every call), and the first entry
of every graphed batch is a padding stream: the slot list is then never contiguous, so only the
decoder's "gathered" graphs are ever used (its contiguous-range graphs are keyed by start slot too,
which would mean a capture per slot). Large batches (many streams flushing together) run eagerly:
their cost is compute, not launches, and they happen once per chunk.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from moss_rt.codec.streaming import DecoderState, StreamingDecoder

log = logging.getLogger(__name__)

GRAPH_BUCKETS = (2, 4, 8, 16)  # graphed batch sizes, padding stream included
GRAPH_WARM_T = tuple(range(1, 9))  # chunk lengths captured at start-up (first chunk 1, default chunk 8)


class CodecBatcher:
    def __init__(self, decoder: StreamingDecoder) -> None:
        self.decoder = decoder
        self.graphs = bool(getattr(decoder, "cuda_graphs", False))
        self._pads: list[DecoderState] = []
        if self.graphs:
            # Allocated first, so they hold the lowest slots and real streams never sit next to pad 0.
            self._pads = [decoder.new_state() for _ in range(GRAPH_BUCKETS[-1] // 2)]

    @staticmethod
    def pad_streams() -> int:
        """Decoder slots the padding streams need (reserve them in ``max_streams``)."""
        return GRAPH_BUCKETS[-1] // 2

    def warm_up(self) -> None:
        if self.graphs:
            self.decoder.warmup(GRAPH_BUCKETS, GRAPH_WARM_T, contiguous_from=None)

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

    def decode(self, states: Sequence[DecoderState], chunks: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Audio [2, 3840*T_i] float32 for each stream; streams with equal T share one call."""
        groups: dict[int, list[int]] = defaultdict(list)
        for i, chunk in enumerate(chunks):
            groups[int(chunk.shape[0])].append(i)
        out: list[np.ndarray | None] = [None] * len(states)
        for t, idxs in groups.items():
            audio = self._decode_group([states[i] for i in idxs], [chunks[i] for i in idxs], t)
            for i, a in zip(idxs, audio, strict=True):
                out[i] = a
        return [a for a in out if a is not None]

    def _decode_group(self, states: list[DecoderState], chunks: list[np.ndarray], t: int) -> list[np.ndarray]:
        n = len(states)
        bucket = next((b for b in GRAPH_BUCKETS if b >= n + 1), None)
        if not self.graphs or bucket is None or t > self.decoder.max_chunk_frames:
            with self.eager():
                return self.decoder.decode(states, chunks)
        pads = self._pads[: bucket - n]
        for pad in pads:
            pad.frames = 0  # padding output is discarded; keep its positions small and fixed
        silence = np.zeros((t, chunks[0].shape[1]), dtype=np.int64)
        batch_states = [pads[0], *states, *pads[1:]]
        batch_chunks = [silence, *chunks, *([silence] * (len(pads) - 1))]
        audio = self.decoder.decode(batch_states, batch_chunks)
        return audio[1 : 1 + n]

    def close(self) -> None:
        for pad in self._pads:
            pad.close()
        self._pads = []
