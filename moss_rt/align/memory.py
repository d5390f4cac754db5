"""The CTC aligner's device memory, worked out from the network's config: what one pass of a padded batch shape
allocates at its peak (an upper bound), and what the aligner holds in all on the engine's GPU (for the engine's
memory plan). Pure arithmetic (no torch), tested on a CPU (tests/align/test_ctc_memory.py).

Where the aligner's device memory goes (docs/words.md, "Device memory"):

- its weights (fp16 on a GPU: ~0.63 GB for the MMS-300m aligners) and the graphs' input/output buffers;
- the CUDA graphs' one memory pool, bounded by ``graph_memory_bytes`` (:data:`DEFAULT_GRAPH_MEMORY_BYTES`): only
  shapes whose pass fits it are captured (:mod:`moss_rt.align.ctc_graphs`);
- the allocator's cache of the eager passes (the captures' warm-up passes, and calls too big for a graph), on the
  aligner's one stream: calls are split so that none computes more than the same budget (:func:`pass_bytes`).

So the aligner holds at most its weights, the buffers and twice the budget: :func:`reserve_bytes`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
MIB = 1 << 20
DEFAULT_GRAPH_MEMORY_BYTES = 3 * GIB // 2
# The feature encoder runs at most this many input samples at once (rows are split into groups): its first
# convolution's output, 512 channels at a fifth of the sample rate in fp16, is ~205 bytes a sample, the biggest
# tensor of the pass (with its layer norm's output beside it, ~410 bytes a sample). 8 rows of 6 s: ~315 MB.
# A multiple of the graphs' longest window (6 s), so the largest captured shape's chunk is the largest chunk of any
# captured shape (every later capture fits in the blocks its pass left in the pool).
FEATURE_CHUNK_SAMPLES = 8 * 6 * 16000
# Allowances that make the bound conservative: a convolution's cuDNN workspace as big as its output, the math
# attention's scores and probabilities (SDPA may pick it for a masked batch), the allocator's rounding (2 MB a
# live tensor), and a quarter more for the pool's fragmentation.
LIVE_TENSORS = 24
ROUNDING_BYTES = 2 * MIB
FRAGMENTATION = 1.25
# Parameters of the MMS-300m aligners: the weights' estimate when the checkpoint is not on disk yet.
MMS_300M_PARAMS = 315_500_000


@dataclass(frozen=True)
class NetDims:
    """What a wav2vec2 CTC network's activations depend on (from its ``config.json``)."""

    conv_dim: tuple[int, ...]
    conv_kernel: tuple[int, ...]
    conv_stride: tuple[int, ...]
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    group_norm: bool  # feat_extract_norm "group": the first layer's norm runs in fp32 (bigger temporaries)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any) -> NetDims:
        get = config.get if isinstance(config, Mapping) else (lambda key, default=None: getattr(config, key, default))
        return cls(
            conv_dim=tuple(int(c) for c in get("conv_dim", (512,) * 7)),
            conv_kernel=tuple(int(k) for k in get("conv_kernel", (10, 3, 3, 3, 3, 2, 2))),
            conv_stride=tuple(int(s) for s in get("conv_stride", (5, 2, 2, 2, 2, 2, 2))),
            hidden=int(get("hidden_size", 1024)),
            intermediate=int(get("intermediate_size", 4096)),
            heads=int(get("num_attention_heads", 16)),
            vocab=int(get("vocab_size", 32)),
            group_norm=get("feat_extract_norm", "group") == "group",
        )


def frames(dims: NetDims, samples: int) -> int:
    """Emission frames of ``samples`` input samples (the convolutions' output length)."""
    for kernel, stride in zip(dims.conv_kernel, dims.conv_stride, strict=True):
        samples = max(0, (samples - kernel) // stride + 1)
    return samples


def pass_bytes(
    dims: NetDims, rows: int, samples: int, *, itemsize: int = 2, chunk_samples: int = FEATURE_CHUNK_SAMPLES
) -> int:
    """An upper bound of the device memory one pass of :class:`~moss_rt.align.ctc_net.CtcNet` over ``rows`` ×
    ``samples`` allocates at its peak (what a CUDA graph of that shape needs in its pool; what an eager call leaves in
    the allocator's cache), beyond its inputs, outputs and weights. Monotone in ``rows`` and ``samples``.

    The pass's phases: the input's normalisation (fp32), the feature encoder a chunk of rows at a time (its first
    convolution's output and its norm's), and the transformer layers (the residual stream, q/k/v, the feed-forward's
    intermediate); what lives through the pass (the normalised input, the mask) is under every phase."""
    rows, samples = max(1, rows), max(1, samples)
    elements = rows * samples
    # Normalisation: the mask (bool), the centred input (fp32) and the model-dtype copy live through the pass;
    # the fp32 temporaries (where, difference, square, product) only here.
    persistent = elements * (1 + 4 + itemsize)
    normalise = elements * 4 * 4
    # Feature encoder, one chunk of rows at a time: a convolution's output, its norm's output (fp32 temporaries
    # for a group norm) and a workspace as big as the output; the chunks' outputs gathered and concatenated.
    # A chunk holds min(rows, chunk_samples // samples) rows (at least one): at most this many samples, a bound that
    # grows with rows and samples (the chunk itself can shrink when a longer row no longer fits it twice).
    chunk = min(rows * samples, max(chunk_samples, samples))
    first = frames(dims, samples)
    widest = 0
    length = chunk
    for channels, kernel, stride in zip(dims.conv_dim, dims.conv_kernel, dims.conv_stride, strict=True):
        length = max(0, (length - kernel) // stride + 1)
        widest = max(widest, length * channels * itemsize)
    norm_factor = 3 + (6 if dims.group_norm else 0)  # out, norm out, workspace (+ fp32 copies for a group norm)
    features = widest * norm_factor + 2 * rows * first * dims.conv_dim[-1] * itemsize
    # Transformer: H is the residual stream [rows, frames, hidden]; a layer holds it, its norm, q/k/v, the attention's
    # output and its reshaped copy, the output projection (8 H) or the feed-forward's intermediate twice (its
    # activation's input and output) beside the residual, its norm and its output; the attention's scores and
    # probabilities when SDPA falls back to the math kernel; the positional convolution and the head are smaller.
    h = rows * first * dims.hidden * itemsize
    ffn = 3 * h + 2 * rows * first * dims.intermediate * itemsize
    scores = 2 * rows * dims.heads * first * first * itemsize
    head = rows * first * dims.vocab * (itemsize + 4 + 4)  # logits, fp32 copy, log-softmax
    transformer = max(8 * h + scores, ffn, 5 * h + head)
    peak = persistent + max(normalise, features, transformer) + LIVE_TENSORS * ROUNDING_BYTES
    return int(peak * FRAGMENTATION)


def io_bytes(dims: NetDims, rows: int, samples: int) -> int:
    """The graphs' device buffers: the input audio (fp32), lengths, and the log-probabilities (fp32)."""
    return rows * samples * 4 + rows * 8 + rows * frames(dims, samples) * dims.vocab * 4


def weights_bytes(params: int, itemsize: int = 2) -> int:
    return params * itemsize


def reserve_bytes(weights: int, io: int, graph_memory_bytes: int) -> int:
    """All the aligner may hold on its device: weights, buffers, the graphs' pool (at most the budget) and the
    allocator's cache of eager passes (each at most the budget, on the aligner's one stream)."""
    return weights + io + 2 * max(0, graph_memory_bytes)


def largest_rows(fits: Any, rows: Sequence[int]) -> int:
    """The first (largest) of ``rows`` (descending) that ``fits(rows)``; 0 when none does."""
    return next((r for r in rows if fits(r)), 0)
