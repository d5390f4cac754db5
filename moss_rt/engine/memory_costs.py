"""What each consumer of the memory plan costs, from the loaded model's config and codec (no allocation)."""

from __future__ import annotations

import torch

from moss_rt.codec.kv_quant import FP8
from moss_rt.codec.model import CodecModel
from moss_rt.codec.streaming import scratch_state_bytes, stream_state_bytes
from moss_rt.engine.memory_plan import GIB, MIB, MemoryCosts
from moss_rt.engine.scheduler import PREFILL_KEYS_PER_ROW
from moss_rt.model.config import MossTTSConfig

# Graph pools (step graphs per batch/key bucket, codec graphs per batch/chunk bucket, the lone-prompt prefill
# graphs: about 50 MB for the 512-row one from position 0 at full size, an estimated 150 MB for 512 rows after a
# prefix over 5,120 keys, up to an estimated 0.5 GB for a batched pass of 16 short pieces over 1,024 keys (their
# gathered keys and values); one shared pool holds the largest, not the sum), cuBLAS/cuDNN
# workspaces and the allocator's rounding, beyond the prefill pass below. Checked against the
# device's peak after warm-up (bench/RESULTS.md); the margin covers the rest.
GRAPH_BASE_BYTES = 3 * GIB // 2
GRAPH_BYTES_PER_SLOT = 8 * MIB  # step and codec-graph activations grow with the batch


def memory_costs(
    config: MossTTSConfig,
    codec: CodecModel,
    dtype: torch.dtype,
    *,
    prefill_max_rows: int,
    codec_chunk_frames: int,
    codec_extra_streams: int,
    keys_per_row: int = PREFILL_KEYS_PER_ROW,
    aligner_bytes: int = 0,
) -> MemoryCosts:
    b = config.backbone
    itemsize = torch.tensor([], dtype=dtype).element_size()
    per_position = (2 * b.num_hidden_layers * b.num_key_value_heads * b.head_dim + b.hidden_size) * itemsize
    # Sampler state: the repetition-penalty bitmap dominates; a dozen scalars besides.
    slot_bytes = config.n_vq * config.audio_vocab_size + 16 * 8 + config.n_vq * 8
    # One prefill pass at its bounds: fp32 attention scores (rows x keys x heads) and the activations
    # of its rows (residual stream, q/k/v, gate/up/down).
    scores = prefill_max_rows * keys_per_row * b.num_attention_heads * 4
    activations = prefill_max_rows * (8 * b.hidden_size + 3 * b.intermediate_size) * itemsize
    return MemoryCosts(
        bytes_per_position=per_position,
        slot_bytes=slot_bytes,
        # The decoder's block pools hold one whole window per codec stream (StreamingDecoder's pool_streams
        # default) plus the scratch row's blocks: exactly these figures.
        codec_bytes_per_stream=stream_state_bytes(codec, codec_chunk_frames, dtype),
        codec_extra_streams=codec_extra_streams,
        codec_fixed_bytes=scratch_state_bytes(codec, codec_chunk_frames, dtype),
        # With fp8 K/V (values and their per-row scales): the memory plan decides which (--codec-state-dtype).
        codec_fp8_bytes_per_stream=stream_state_bytes(codec, codec_chunk_frames, FP8),
        codec_fp8_fixed_bytes=scratch_state_bytes(codec, codec_chunk_frames, FP8),
        work_bytes=GRAPH_BASE_BYTES + scores + activations,
        work_bytes_per_slot=GRAPH_BYTES_PER_SLOT,
        aligner_bytes=aligner_bytes,  # the word aligner on this device (moss_rt.align.select.planned_reserve_bytes)
    )
