"""Device state: the paged KV cache, per-position hidden states, per-slot sampler state.

A slot is one take. Its positions [0, length) live in fixed-size blocks of one shared pool
(``block_table[slot, p // block_size]``, offset ``p % block_size``; host bookkeeping in
blocks.py): keys/values of every layer and the hidden state after position p (post final
norm), so truncating a slot (a seek) is exact: the next step reads hidden[length-1] without
recomputing anything. Block 0 is scratch: it absorbs the writes of rows that take part in a
batched step without being advanced, and unused table entries point at it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moss_rt.model.config import MossTTSConfig

# Rows of SlotState.slot_ints / slot_floats, in order (and their values in a fresh state).
INT_FIELDS = ("lengths", "frame_index", "seed_lo", "seed_hi", "audio_top_k", "text_top_k")
FLOAT_FIELDS = ("audio_temperature", "audio_top_p", "audio_penalty", "text_temperature", "text_top_p")
INT_DEFAULT = 0
FLOAT_DEFAULT = 1.0  # temperature 1, top-p off, penalty off


@dataclass
class SlotState:
    """Every tensor the step reads or writes; first dimension = slot (except the caches)."""

    k_cache: torch.Tensor  # [layers, blocks * block_size, kv_heads, head_dim]: the pool, position-major
    v_cache: torch.Tensor
    hidden: torch.Tensor  # [blocks * block_size, hidden]
    block_table: torch.Tensor  # [slots, max_blocks_per_slot] int64: block of each slot's position p // block_size
    lengths: torch.Tensor  # [slots] int64: positions filled
    frame_index: torch.Tensor  # [slots] int64: RNG counter of the next frame
    seed_lo: torch.Tensor  # [slots] int64
    seed_hi: torch.Tensor
    audio_temperature: torch.Tensor  # [slots] float32
    audio_top_k: torch.Tensor  # [slots] int64
    audio_top_p: torch.Tensor  # [slots] float32
    audio_penalty: torch.Tensor  # [slots] float32
    text_temperature: torch.Tensor
    text_top_k: torch.Tensor
    text_top_p: torch.Tensor
    presence: torch.Tensor  # [slots, n_vq, audio_vocab] bool: codes generated so far per codebook
    active: torch.Tensor  # [slots] bool: rows advanced by the current step (input)
    codes: torch.Tensor  # [slots, n_vq] int64 (output of the last step)
    stop: torch.Tensor  # [slots] bool (output of the last step)
    slot_ints: torch.Tensor  # [len(INT_FIELDS), slots] int64: the storage of the int64 per-slot fields above
    slot_floats: torch.Tensor  # [len(FLOAT_FIELDS), slots] float32: the storage of the float32 ones

    block_size: int = 16
    max_seq_len: int = 0

    @property
    def positions(self) -> int:
        """Positions a slot can address (max_seq_len + 1: a step writes at most at max_seq_len)."""
        return self.max_seq_len + 1

    @property
    def scratch(self) -> int:
        """The pool position that absorbs writes nobody reads (block 0, offset 0)."""
        return 0

    @classmethod
    def allocate(
        cls,
        config: MossTTSConfig,
        max_slots: int,
        max_seq_len: int,
        device: torch.device,
        dtype: torch.dtype,
        *,
        num_blocks: int,
        block_size: int,
    ) -> SlotState:
        b = config.backbone
        max_blocks = -(-(max_seq_len + 1) // block_size)
        pool = num_blocks * block_size
        kv_shape = (b.num_hidden_layers, pool, b.num_key_value_heads, b.head_dim)

        ints = torch.full((len(INT_FIELDS), max_slots), INT_DEFAULT, dtype=torch.int64, device=device)
        floats = torch.full((len(FLOAT_FIELDS), max_slots), FLOAT_DEFAULT, dtype=torch.float32, device=device)
        i, f = {n: ints[k] for k, n in enumerate(INT_FIELDS)}, {n: floats[k] for k, n in enumerate(FLOAT_FIELDS)}
        return cls(
            # Zero-filled so that positions never written hold finite values (masked keys
            # must not turn into NaN through 0 * inf in the attention kernels).
            k_cache=torch.zeros(kv_shape, dtype=dtype, device=device),
            v_cache=torch.zeros(kv_shape, dtype=dtype, device=device),
            hidden=torch.zeros((pool, b.hidden_size), dtype=dtype, device=device),
            block_table=torch.zeros((max_slots, max_blocks), dtype=torch.int64, device=device),
            lengths=i["lengths"],
            frame_index=i["frame_index"],
            seed_lo=i["seed_lo"],
            seed_hi=i["seed_hi"],
            audio_temperature=f["audio_temperature"],
            audio_top_k=i["audio_top_k"],
            audio_top_p=f["audio_top_p"],
            audio_penalty=f["audio_penalty"],
            text_temperature=f["text_temperature"],
            text_top_k=i["text_top_k"],
            text_top_p=f["text_top_p"],
            presence=torch.zeros((max_slots, config.n_vq, config.audio_vocab_size), dtype=torch.bool, device=device),
            active=torch.zeros((max_slots,), dtype=torch.bool, device=device),
            codes=torch.zeros((max_slots, config.n_vq), dtype=torch.int64, device=device),
            stop=torch.zeros((max_slots,), dtype=torch.bool, device=device),
            slot_ints=ints,
            slot_floats=floats,
            block_size=block_size,
            max_seq_len=max_seq_len,
        )

    def pool_index(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pool positions of ``positions`` [B,T] of table rows ``rows`` [B] (device-only, graph-safe)."""
        blocks = self.block_table[rows[:, None], positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def nbytes(self) -> int:
        """Device bytes held (each storage once: the per-slot scalars are views of two packed tensors)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in vars(self).values() if isinstance(t, torch.Tensor)}
        return sum(storages.values())

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy blocks' keys, values and hidden states, ``(source, destination)`` each (copy on write of shared
        blocks; no destination is a source). One gather and one scatter per tensor whatever their number: the first
        step of 64 retakes branching inside a block copies 64 of them, three copies each when done one by one."""
        if not pairs:
            return
        bs = self.block_size
        # Pool positions of every pair's blocks: [2 (sources, destinations), pairs, positions in a block].
        positions = np.asarray(pairs, dtype=np.int64).T[:, :, None] * bs + np.arange(bs)
        index = torch.from_numpy(positions.reshape(2, -1)).to(self.hidden.device, non_blocking=True)
        src, dst = index[0], index[1]
        for cache in (self.k_cache, self.v_cache):
            cache.index_copy_(1, dst, cache.index_select(1, src))
        self.hidden.index_copy_(0, dst, self.hidden.index_select(0, src))
