"""The MOSS-TTS-Local v1.5 network: Qwen3 backbone, frame-local transformer, heads.

Module and parameter names equal the released checkpoint's tensor names
(``transformer.layers.0.self_attn.q_proj.weight``, ``local_transformer.h.0.attn.c_attn.bias``,
``audio_lm_heads.3.weight``, ...), so loading is a plain name match.

The forward functions take explicit key/value buffers and position tensors instead of
cache objects; the runner owns those buffers (see runner.py). Nothing here syncs with
the host, so the same code runs eagerly and inside CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from moss_rt.meta_init import embedding
from moss_rt.model import chunk_attention, fused_layers, fused_local, paged_attention
from moss_rt.model.config import BackboneConfig, LocalConfig, MossTTSConfig
from moss_rt.model.fused_weights import fuse_projections, fused_weight, materialize
from moss_rt.model.layers import (
    RMSNorm,
    activation,
    attention_scale,
    grouped_attention,
    rotate_half_split,
    rotate_interleaved,
)

# --------------------------------------------------------------------------- backbone


@dataclass(frozen=True)
class PackedKeys:
    """A prefill pass after a prefix with its pieces packed end to end (chunk_attention.packed_causal_attention):
    ``read`` [Nk,Hkv] rows of the pool viewed as [positions * Hkv, D] holding each piece's keys in order (entries past
    the last piece's point at the scratch position); ``cu_q`` / ``cu_k`` [B+1] int32 where each piece's query rows and
    keys begin; ``max_q`` / ``max_k`` at least any piece's."""

    read: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


@dataclass(frozen=True)
class PagedIndex:
    """Where a pass reads and writes the paged cache (pool positions, see state.py).

    ``write`` [B,T]: the pool position of each query row's key/value (scratch for rows that are
    not advanced); ``read`` [B,Hkv,S]: rows of the pool viewed as [positions * Hkv, D] holding key
    s of KV head h of each batch row's slot, so one gather yields [B,Hkv,S,D] in the layout the
    attention GEMMs read without a further copy.
    """

    write: torch.Tensor
    read: torch.Tensor
    positions: torch.Tensor  # [B,S] the pool positions themselves (the decode kernel reads through them)
    # Every row's chunk starts at position 0 and S == T: row t sees keys 0..t, the mask need not be read
    # (a pass of fresh prompts; chunk_attention then runs causal flash attention).
    causal: bool = False
    # [B] int32, a decode step's: each row's keys end before this (length + 1; 0 for a row not advanced), so the
    # decode kernel walks no tile of the key bucket past them (paged_attention.py). None: every key is walked.
    extent: torch.Tensor | None = None
    # A pass after a prefix whose pieces attend packed (MOSS_RT_PACKED_PREFILL): ``read`` and the key mask unused.
    packed: PackedKeys | None = None

    @classmethod
    def build(
        cls, write: torch.Tensor, read_positions: torch.Tensor, kv_heads: int, causal: bool = False,
        extent: torch.Tensor | None = None, packed: PackedKeys | None = None,
    ) -> PagedIndex:
        """From pool positions: ``read_positions`` [B,S] of the keys each row attends to."""
        heads = torch.arange(kv_heads, device=read_positions.device)
        read = read_positions[:, None, :] * kv_heads + heads[None, :, None]
        return cls(write, read, read_positions, causal, extent, packed)


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        index: PagedIndex,
        key_mask: torch.Tensor,
    ) -> torch.Tensor:
        """x [B,T,H]; cos/sin [B,T,D]; caches [pool positions,Hkv,D] (one layer of the runner's pool).

        Writes this chunk's keys/values at ``index.write`` [B,T], then attends over the keys at
        ``index.read`` [B,S] (gathered from the pool) with ``key_mask`` [B,T,S]; a decode step
        (T == 1) on CUDA reads them in place instead (paged_attention.py), when Triton is there.
        """
        batch, tq, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, tq, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(batch, tq, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, tq, self.num_kv_heads, self.head_dim)
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)
        q = q * c + rotate_half_split(q) * s
        k = k * c + rotate_half_split(k) * s
        k_cache[index.write] = k  # value [B,T,Hkv,D] at [B,T] pool positions
        v_cache[index.write] = v
        if tq == 1 and paged_attention.available(q):
            out = paged_attention.paged_decode_attention(
                q[:, 0], k_cache, v_cache, index.positions, key_mask[:, 0], self.scale, index.extent
            )
            return self.o_proj(out[:, None])
        return self.o_proj(self._chunk_attention(q, k_cache, v_cache, index, key_mask))

    def _chunk_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: PagedIndex, key_mask: torch.Tensor
    ) -> torch.Tensor:
        """A prefill pass's attention, queries q [B,T,Hq,D] over their slots' keys in the pool: packed pieces
        (index.packed), or the keys gathered per batch row under the key mask (chunk_attention). [B,T,Hq*D]."""
        batch, tq = q.shape[0], q.shape[1]
        packed = index.packed
        if packed is not None:
            keys = k_cache.view(-1, self.head_dim)[packed.read]  # [Nk,Hkv,D]
            values = v_cache.view(-1, self.head_dim)[packed.read]
            out = chunk_attention.packed_causal_attention(
                q.reshape(batch * tq, self.num_heads, self.head_dim), keys, values, packed.cu_q, packed.cu_k,
                packed.max_q, packed.max_k, self.scale,
            )
            return out.view(batch, tq, self.num_heads * self.head_dim)
        keys = k_cache.view(-1, self.head_dim)[index.read]  # [B,Hkv,S,D], contiguous
        values = v_cache.view(-1, self.head_dim)[index.read]
        return chunk_attention.chunk_attention(q, keys, values, key_mask, self.scale, index.causal)

    def forward_fused(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        index: PagedIndex,
        key_mask: torch.Tensor,
    ) -> torch.Tensor:
        """``forward`` with one q/k/v GEMM and one kernel for q/k norms, RoPE and the cache writes (fused_layers)."""
        batch, tq, hidden = x.shape
        rows = batch * tq
        projections = [self.q_proj, self.k_proj, self.v_proj]
        fused = fused_weight(self, projections)
        if fused is not None:
            qkv = F.linear(x, fused[0], fused[1])
        else:  # the views were replaced (module.to): the same values, three GEMMs
            qkv = torch.cat([p(x) for p in projections], dim=-1)
        q = fused_layers.qk_norm_rope_write(
            qkv.view(rows, -1), cos.reshape(rows, -1), sin.reshape(rows, -1), self.q_norm.weight,
            self.k_norm.weight, self.q_norm.eps, index.write.reshape(rows), k_cache, v_cache,
            self.num_heads, self.num_kv_heads,
        )
        if tq == 1 and paged_attention.available(q):
            out = paged_attention.paged_decode_attention(
                q, k_cache, v_cache, index.positions, key_mask[:, 0], self.scale, index.extent
            )
            return self.o_proj(out[:, None])
        q4 = q.view(batch, tq, self.num_heads, self.head_dim)
        return self.o_proj(self._chunk_attention(q4, k_cache, v_cache, index, key_mask))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """x [M,H]: one gate/up GEMM and one SiLU-mul kernel (fused_layers)."""
        fused = fused_weight(self, [self.gate_proj, self.up_proj])
        if fused is not None:
            gate_up = F.linear(x, fused[0], fused[1])
        else:
            gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
        return self.down_proj(fused_layers.silu_mul(gate_up))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3Backbone(nn.Module):
    """``transformer.*``: embed_tokens, layers, norm."""

    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_caches: torch.Tensor,
        v_caches: torch.Tensor,
        index: PagedIndex,
        key_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Run all layers on embedded rows x [B,T,H]; caches are the pool [L,positions,Hkv,D] (PagedIndex).

        Returns the hidden states after the final RMSNorm (what the local transformer reads).
        On CUDA (unless MOSS_RT_FUSED_BACKBONE=0) the same maths runs through fused kernels (``_forward_fused``).
        """
        if fused_layers.available(x):
            return self._forward_fused(x, cos, sin, k_caches, v_caches, index, key_mask)
        for layer_index, layer in enumerate(cast("list[Qwen3DecoderLayer]", self.layers)):
            h = layer.input_layernorm(x)
            x = x + layer.self_attn(h, cos, sin, k_caches[layer_index], v_caches[layer_index], index, key_mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def _forward_fused(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_caches: torch.Tensor,
        v_caches: torch.Tensor,
        index: PagedIndex,
        key_mask: torch.Tensor,
    ) -> torch.Tensor:
        """``forward`` on fused kernels: each residual add is folded into the RMSNorm that follows it."""
        batch, tq, hidden = x.shape
        residual = x.reshape(batch * tq, hidden)
        delta: torch.Tensor | None = None  # the block output still to be added (none before the first layer)
        for layer_index, layer in enumerate(cast("list[Qwen3DecoderLayer]", self.layers)):
            norm = layer.input_layernorm
            residual, h = fused_layers.add_rmsnorm(residual, delta, norm.weight, norm.eps)
            attn = layer.self_attn.forward_fused(
                h.view(batch, tq, hidden), cos, sin, k_caches[layer_index], v_caches[layer_index], index, key_mask
            )
            norm = layer.post_attention_layernorm
            residual, h = fused_layers.add_rmsnorm(residual, attn.view(batch * tq, hidden), norm.weight, norm.eps)
            delta = layer.mlp.forward_fused(h)
        _, out = fused_layers.add_rmsnorm(residual, delta, self.norm.weight, self.norm.eps)
        return out.view(batch, tq, hidden)


# --------------------------------------------------------------------------- local transformer


class LocalAttention(nn.Module):
    def __init__(self, cfg: LocalConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = cfg.n_head
        self.head_dim = cfg.head_dim
        self.embed_dim = cfg.n_embd
        self.scale = attention_scale(
            cfg.head_dim, cfg.scale_attn_weights, cfg.scale_attn_by_inverse_layer_idx, layer_idx
        )
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, pos: int
    ) -> torch.Tensor:
        """One local position: x [B,1,E]; cos/sin [D] for ``pos``; buffers [B,heads,n_vq,D]."""
        batch = x.shape[0]
        q, k, v = self.c_attn(x).split(self.embed_dim, dim=-1)
        q = q.view(batch, 1, self.num_heads, self.head_dim)
        k = k.view(batch, 1, self.num_heads, self.head_dim)
        v = v.view(batch, 1, self.num_heads, self.head_dim)
        q = q * cos + rotate_interleaved(q) * sin
        k = k * cos + rotate_interleaved(k) * sin
        k_buf[:, :, pos] = k[:, 0]
        v_buf[:, :, pos] = v[:, 0]
        # Keys 0..pos are exactly the causal window, so no mask is needed.
        out = grouped_attention(q, k_buf[:, :, : pos + 1], v_buf[:, :, : pos + 1], None, self.scale)
        return self.c_proj(out)


class LocalMLP(nn.Module):
    def __init__(self, cfg: LocalConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(cfg.n_embd, cfg.n_inner)
        self.fc_out = nn.Linear(cfg.n_inner, cfg.n_embd)
        self.act = activation(cfg.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


class LocalBlock(nn.Module):
    def __init__(self, cfg: LocalConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = LocalAttention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = LocalMLP(cfg)


class LocalTransformer(nn.Module):
    """``local_transformer.*``: GPT-2 style pre-LN blocks ``h`` and final ``ln_f`` (no wte/wpe)."""

    def __init__(self, cfg: LocalConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.h = nn.ModuleList(LocalBlock(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)

    def new_buffers(self, batch: int, length: int, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
        """Per-frame key/value scratch: [2*n_layer] tensors of [B,heads,length,D]."""
        shape = (batch, self.cfg.n_head, length, self.cfg.head_dim)
        return [torch.empty(shape, device=device, dtype=dtype) for _ in range(2 * len(self.h))]

    def step(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, buffers: list[torch.Tensor], pos: int
    ) -> torch.Tensor:
        """Advance one local position: x [B,E] -> ln_f output [B,E].

        On CUDA (unless MOSS_RT_FUSED_LOCAL=0) the same maths runs through fused kernels (``_step_fused``).
        """
        if fused_local.available(x):
            return self._step_fused(x, cos, sin, buffers, pos)
        h = x.unsqueeze(1)
        for index, block in enumerate(cast("list[LocalBlock]", self.h)):
            h = h + block.attn(block.ln_1(h), cos, sin, buffers[2 * index], buffers[2 * index + 1], pos)
            h = h + block.mlp(block.ln_2(h))
        return self.ln_f(h)[:, 0]

    def _step_fused(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, buffers: list[torch.Tensor], pos: int
    ) -> torch.Tensor:
        """``step`` on fused kernels: each residual add is folded into the LayerNorm that follows it, RoPE, the
        k/v writes and the attention are one kernel; the GEMMs and the activation are the torch path's."""
        residual = x
        delta: torch.Tensor | None = None  # the block output still to be added (none before the first block)
        for index, block in enumerate(cast("list[LocalBlock]", self.h)):
            attn = block.attn
            residual, h = fused_local.add_layernorm(residual, delta, block.ln_1.weight, block.ln_1.bias, block.ln_1.eps)
            heads = fused_local.rope_write_attention(
                attn.c_attn(h), cos, sin, buffers[2 * index], buffers[2 * index + 1], pos, attn.num_heads, attn.scale
            )
            residual, h = fused_local.add_layernorm(
                residual, attn.c_proj(heads), block.ln_2.weight, block.ln_2.bias, block.ln_2.eps
            )
            delta = block.mlp(h)
        _, out = fused_local.add_layernorm(residual, delta, self.ln_f.weight, self.ln_f.bias, self.ln_f.eps)
        return out


# --------------------------------------------------------------------------- whole model


class MossTTSLocalModel(nn.Module):
    """Parameters under the checkpoint's names; tied heads share their embedding tensors."""

    def __init__(self, config: MossTTSConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.transformer = Qwen3Backbone(config.backbone)
        self.local_transformer = LocalTransformer(config.local)
        self.audio_embeddings = nn.ModuleList(embedding(config.audio_vocab_size, hidden) for _ in range(config.n_vq))
        self.text_lm_head = nn.Linear(hidden, config.backbone.vocab_size, bias=False)
        self.audio_lm_heads = nn.ModuleList(
            nn.Linear(hidden, config.audio_vocab_size, bias=False) for _ in range(config.n_vq)
        )
        self.local_text_lm_head: nn.Linear | None = (
            nn.Linear(hidden, 2, bias=False) if config.local_text_head_mode == "binary" else None
        )
        self.tie_weights()

    # The checkpoint stores tied tensors as separate copies; in memory they are one.
    def tied_keys(self) -> dict[str, str]:
        """target key -> source key for every tied parameter."""
        return self.tied_keys_for(self.config)

    @staticmethod
    def tied_keys_for(config: MossTTSConfig) -> dict[str, str]:
        tied = {"text_lm_head.weight": "transformer.embed_tokens.weight"}
        tied.update({f"audio_lm_heads.{i}.weight": f"audio_embeddings.{i}.weight" for i in range(config.n_vq)})
        return tied

    def tie_weights(self) -> None:
        self.text_lm_head.weight = self.transformer.embed_tokens.weight
        for emb, head in zip(self.audio_embeddings, self.audio_lm_heads, strict=True):
            head.weight = emb.weight

    # ------------------------------------------------------------------ pieces used by the runner
    def embed_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [...,1+n_vq] int64 -> [...,H]: text embedding + sum of code embeddings; pad codes add 0."""
        x = self.transformer.embed_tokens(rows[..., 0])
        pad = self.config.audio_pad_token_id
        for index, table in enumerate(self.audio_embeddings):
            ids = rows[..., index + 1]
            valid = ids.ne(pad)
            # Same order of operations as upstream: lookup a safe id, then multiply by the mask.
            x = x + table(ids.masked_fill(~valid, 0)) * valid.unsqueeze(-1)
        return x

    def stop_logits(self, z0: torch.Tensor) -> torch.Tensor:
        """[B,2] fp32 logits: class 0 = continue (assistant slot), class 1 = stop (audio end)."""
        if self.local_text_lm_head is not None:
            return self.local_text_lm_head(z0).float()
        weight = self.text_lm_head.weight
        # Integer indexing (views), not a list index: no host-to-device copy inside CUDA graphs.
        rows = torch.stack([weight[self.config.audio_assistant_slot_token_id], weight[self.config.audio_end_token_id]])
        return F.linear(z0, rows).float()

    def audio_logits(self, z: torch.Tensor, codebook: int) -> torch.Tensor:
        return self.audio_lm_heads[codebook](z).float()

    @torch.inference_mode()
    def teacher_forced_local(self, hidden: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Local logits for known frames: hidden [F,H] (backbone output before each frame), codes [F,n_vq].

        Returns (stop logits [F,2], audio logits [F,n_vq,V]) through the same incremental
        local path the runner samples from. For parity tests and diagnostics.
        """
        from moss_rt.model.layers import rope_tables_interleaved

        cfg = self.config
        local = cfg.local
        cos, sin = rope_tables_interleaved(cfg.n_vq, local.head_dim, local.rope_base, hidden.device, hidden.dtype)
        buffers = self.local_transformer.new_buffers(hidden.shape[0], cfg.n_vq, hidden.device, hidden.dtype)
        z = self.local_transformer.step(hidden, cos[0], sin[0], buffers, 0)
        stop = self.stop_logits(z)
        audio = []
        for k in range(cfg.n_vq):
            audio.append(self.audio_logits(z, k))
            if k + 1 < cfg.n_vq:
                emb = self.audio_embeddings[k](codes[:, k]).to(hidden.dtype)
                z = self.local_transformer.step(emb, cos[k + 1], sin[k + 1], buffers, k + 1)
        return stop, torch.stack(audio, dim=1)


def build_model(config: MossTTSConfig, device: torch.device, dtype: torch.dtype) -> MossTTSLocalModel:
    """The network with its parameters allocated once, uninitialised, directly on the target device (the loader
    then fills them from a checkpoint, the tiny model from its random generator). At full size on this 2-core CPU:
    11.6 s with a copy of every fused projection's uninitialised values, 0.65 s without, 0.15 s as one allocation."""
    with torch.device("meta"):
        model = MossTTSLocalModel(config).to(dtype)  # dtype change on meta costs nothing
    # Every parameter a view into one allocation, the ties kept (fused_weights.materialize).
    materialize(model, device)
    # q/k/v and gate/up weights as views into one tensor each (fused_weights.py): one GEMM each on the fused
    # path, same memory and names. Before loading, so the loader writes straight through the views; materialize laid
    # them out one after another, so nothing is allocated or copied.
    fuse_projections(model)
    return model.eval().requires_grad_(False)
