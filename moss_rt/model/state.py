"""Preallocated per-slot device state: KV cache, per-position hidden states, sampler state.

A slot is one take. Its cache row holds keys/values for positions [0, length); the
hidden state after position p (post final norm) is kept for every p, so truncating a
slot (a seek) is exact: the next step reads hidden[length-1] without recomputing
anything. One extra position per slot (index ``scratch``) absorbs the writes of rows
that take part in a batched step without being advanced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moss_rt.model.config import MossTTSConfig


@dataclass
class SlotState:
    """Every tensor the step reads or writes; first dimension = slot (except the caches)."""

    k_cache: torch.Tensor  # [layers, slots, kv_heads, positions, head_dim]
    v_cache: torch.Tensor
    hidden: torch.Tensor  # [slots, positions, hidden]
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

    @property
    def positions(self) -> int:
        return int(self.hidden.shape[1])

    @property
    def scratch(self) -> int:
        return self.positions - 1

    @classmethod
    def allocate(
        cls, config: MossTTSConfig, max_slots: int, max_seq_len: int, device: torch.device, dtype: torch.dtype
    ) -> SlotState:
        b = config.backbone
        positions = max_seq_len + 1
        kv_shape = (b.num_hidden_layers, max_slots, b.num_key_value_heads, positions, b.head_dim)

        def vec(fill: float, kind: torch.dtype) -> torch.Tensor:
            return torch.full((max_slots,), fill, dtype=kind, device=device)

        return cls(
            # Zero-filled so that positions never written hold finite values (masked keys
            # must not turn into NaN through 0 * inf in the attention kernels).
            k_cache=torch.zeros(kv_shape, dtype=dtype, device=device),
            v_cache=torch.zeros(kv_shape, dtype=dtype, device=device),
            hidden=torch.zeros((max_slots, positions, b.hidden_size), dtype=dtype, device=device),
            lengths=vec(0, torch.int64),
            frame_index=vec(0, torch.int64),
            seed_lo=vec(0, torch.int64),
            seed_hi=vec(0, torch.int64),
            audio_temperature=vec(1.0, torch.float32),
            audio_top_k=vec(0, torch.int64),
            audio_top_p=vec(1.0, torch.float32),
            audio_penalty=vec(1.0, torch.float32),
            text_temperature=vec(1.0, torch.float32),
            text_top_k=vec(0, torch.int64),
            text_top_p=vec(1.0, torch.float32),
            presence=torch.zeros((max_slots, config.n_vq, config.audio_vocab_size), dtype=torch.bool, device=device),
            active=torch.zeros((max_slots,), dtype=torch.bool, device=device),
            codes=torch.zeros((max_slots, config.n_vq), dtype=torch.int64, device=device),
            stop=torch.zeros((max_slots,), dtype=torch.bool, device=device),
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))
