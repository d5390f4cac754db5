"""Sampling with the upstream semantics, per row parameters and counter-based randomness.

Upstream order (MossTTSLocalModel.generate): repetition penalty on the raw fp32 logits
-> divide by temperature -> top-k (ties at the threshold survive) -> top-p (keep the
smallest sorted prefix whose mass reaches p, the crossing token included) -> softmax ->
draw. Temperature <= 0 means greedy argmax of the penalised logits.

The draw is Gumbel-max: argmax(filtered_scores + g) with g = -log(-log(u)) is an exact
sample from softmax(filtered_scores). The uniform u for (seed, counter, token) comes from
an integer hash, so a row's draw depends only on its own seed and counter: takes are
independent of whatever else shares the batch, and no generator state lives on the
host (CUDA-graph friendly). All hash arithmetic stays below 2^63 in int64.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_TWO_POW_24 = float(1 << 24)


def _mul32(x: torch.Tensor, const: int) -> torch.Tensor:
    """(x * const) mod 2^32 for x in [0, 2^32), without exceeding int64 (split the constant)."""
    lo, hi = const & 0xFFFF, const >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def split_seed(seed: int) -> tuple[int, int]:
    """A non-negative 63-bit seed as two 32-bit halves (the hash's key)."""
    if not 0 <= int(seed) < (1 << 63):
        raise ValueError(f"seed must be in [0, 2^63), got {seed}")
    return int(seed) & _M32, (int(seed) >> 32) & _M32


def token_keys(vocab: int, device: torch.device) -> torch.Tensor:
    """Per-token hash keys, precomputable once per vocab size."""
    return fmix32((torch.arange(vocab, dtype=torch.int64, device=device) * 0x9E3779B1 + 0x7F4A7C15) & _M32)


def uniforms(seed_lo: torch.Tensor, seed_hi: torch.Tensor, counter: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """u [B,V] in (0,1), float32, a pure function of (seed, counter, token)."""
    h = fmix32(seed_lo ^ fmix32(seed_hi ^ 0x5BD1E995))
    h = fmix32(h ^ fmix32((counter & _M32) ^ 0x27D4EB2F))
    bits = fmix32(h[:, None] ^ keys[None, :]) >> 8  # top 24 bits: exact in float32
    return (bits.to(torch.float32) + 0.5) / _TWO_POW_24


def gumbel(u: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(u))


def apply_repetition_penalty(logits: torch.Tensor, presence: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """logits [B,V] fp32; presence [B,V] bool (codes generated earlier in the take); penalty [B].

    Negative logits are multiplied, positive ones divided; penalty 1.0 leaves values bit-identical.
    """
    pen = penalty[:, None]
    scaled = torch.where(logits < 0, logits * pen, logits / pen)
    return torch.where(presence, scaled, logits)


def filter_top_k_top_p(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k then top-p remove, per row. scores [B,V] are temperature-scaled.

    top_k <= 0 or >= V disables top-k; top_p outside (0,1) disables top-p (upstream rules).
    """
    vocab = scores.shape[-1]
    neg_inf = scores.new_full((), float("-inf"))  # a fill, not a host copy: CUDA-graph safe
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    k_on = (top_k > 0) & (top_k < vocab)
    k_eff = torch.where(k_on, top_k, torch.full_like(top_k, vocab))
    kth = sorted_scores.gather(1, (k_eff - 1)[:, None])
    # Sorting is monotone, so filtering the sorted copy equals re-sorting the filtered scores.
    sorted_scores = torch.where(sorted_scores < kth, neg_inf, sorted_scores)
    scores = torch.where(scores < kth, neg_inf, scores)
    p_on = (top_p > 0) & (top_p < 1)
    p_eff = torch.where(p_on, top_p, torch.full_like(top_p, float("inf")))
    cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative > p_eff[:, None]
    # Shift right: a token is dropped only if the mass *before* it already exceeds p.
    drop_sorted = torch.cat([torch.zeros_like(drop_sorted[:, :1]), drop_sorted[:, :-1]], dim=-1)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return torch.where(drop, neg_inf, scores)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """One draw per row from already penalised fp32 logits [B,V] with uniforms u [B,V]."""
    greedy = torch.argmax(logits, dim=-1)
    hot = temperature > 0
    safe_t = torch.where(hot, temperature, torch.ones_like(temperature))
    scores = filter_top_k_top_p(logits / safe_t[:, None], top_k, top_p)
    drawn = torch.argmax(scores + gumbel(u), dim=-1)
    return torch.where(hot, drawn, greedy)


def filtered_distribution(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    presence: torch.Tensor | None = None,
    penalty: float = 1.0,
) -> torch.Tensor:
    """The probabilities a draw follows (for tests and diagnostics), per upstream rules."""
    batch = logits.shape[0]
    scores = logits.float()
    if presence is not None:
        scores = apply_repetition_penalty(scores, presence, torch.full((batch,), penalty))
    if temperature <= 0:
        return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1]).float()
    scores = filter_top_k_top_p(
        scores / temperature, torch.full((batch,), top_k, dtype=torch.int64), torch.full((batch,), top_p)
    )
    return torch.softmax(scores, dim=-1)
