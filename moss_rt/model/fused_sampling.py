"""One Triton kernel per draw: penalty -> temperature -> top-k -> top-p -> Gumbel-max -> greedy, one program per row.

Why: the torch path (sampling.py) costs about 40 small kernels and a segmented sort per draw, 13 draws a frame; on
an H200 that is most of a graphed batch-1 step. This kernel does one draw for every row in one launch and can also
set the drawn code's presence bit (the repetition-penalty history), so the step's bookkeeping needs no scatter.

Semantics are sampling.py's, row by row (the torch path stays the reference and the CPU path):

- penalty: where the presence bit is set, negative logits are multiplied by it, others divided (IEEE division);
- temperature: scores = penalised / t (t > 0; t <= 0 means greedy: argmax of the penalised logits, first index);
- top-k (0 < k < V): keep scores >= the k-th largest, so ties at the threshold survive;
- top-p (0 < p < 1): over the scores sorted descending, ties by ascending token index (torch's stable sort), keep
  sorted position j unless the softmax mass of positions before j exceeds p: the smallest prefix reaching p,
  crossing token included;
- draw: argmax of kept scores + Gumbel noise -log(-log(u)), first index on ties (torch.argmax's rule), with u
  computed here by the same integer hash as ``sampling.uniforms``: the same (seed, counter, token) gives the same
  u bit for bit.

How: the row's scores are packed with their token index into int64 keys (an order-preserving integer image of the
float, -0.0 folded into +0.0, then the complemented index so that ties come out by ascending index) and sorted
descending in registers (a bitonic sort, fused_sampling_kernels.py); top-k, the softmax, the cumulative mass and
the draw all happen in sorted order, and the uniforms are hashed from the unpacked token index, so nothing is
scattered back. The same kernel draws the stop head (vocab 2, no penalty) and the 12 codebooks.

Exactness against the torch path: every elementwise step is the same IEEE float32 operation (division with
``div_rn``; on CUDA ``log`` / ``exp`` are libdevice's ``logf`` / ``expf``, what torch's CUDA kernels call), so
penalised and scaled scores, top-k sets, the noise and the draw are identical. The one difference is the order in
which the top-p softmax denominator and cumulative sums are added (torch: its softmax and cumsum kernels; here a
tree reduction and a scan): they agree to about 1e-6, so a row can keep one token more or fewer than the torch
path only when the mass before some sorted position lies within that rounding of p. The decision itself uses the
first sorted position whose cumulative mass exceeds p (equivalent to torch's shifted mask for a non-decreasing
cumulative sum, which exact arithmetic guarantees). Through Triton's interpreter (CPU tests) log and exp are
numpy's, which may differ from torch's CPU ones in the last bit.

Used by ``step.frame_step`` on CUDA when Triton imports and ``MOSS_RT_FUSED_SAMPLER`` is not ``0``; the CPU and that
switch keep the torch path. ``MOSS_RT_FUSED_SAMPLER=interpret`` with ``TRITON_INTERPRET=1`` runs it on CPU tensors
through Triton's interpreter (tests only; slow).
"""

from __future__ import annotations

import functools

import torch

from moss_rt.kernel_switch import import_kernels, kernel_wanted

__all__ = ["available", "fused_draw", "fused_uniforms"]

MAX_VOCAB = 1 << 16  # the token index is packed into the low 16 bits of the sort key
NUM_WARPS = 4  # per row of a large vocab (1024: 8 keys a thread); a tiny vocab (the stop head) runs one warp


@functools.cache
def _kernels():  # type: ignore[no-untyped-def]
    """(draw, uniforms) jitted kernels, built on first use (so TRITON_INTERPRET is read then); None without Triton."""
    k = import_kernels("moss_rt.model.fused_sampling_kernels")
    return None if k is None else (k.draw, k.uniforms)


def available(t: torch.Tensor) -> bool:
    """Whether the kernel runs for tensors like ``t``: CUDA (or the interpreter in tests), Triton, not turned off."""
    return kernel_wanted("MOSS_RT_FUSED_SAMPLER", t.is_cuda) and _kernels() is not None


def _block(vocab: int) -> int:
    if not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(f"vocab must be in [1, {MAX_VOCAB}], got {vocab}")
    return max(2, 1 << (vocab - 1).bit_length())


def fused_draw(
    out: torch.Tensor,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed_lo: torch.Tensor,
    seed_hi: torch.Tensor,
    frame: torch.Tensor,
    counter_mul: int,
    counter_add: int,
    *,
    penalty: torch.Tensor | None = None,
    presence: torch.Tensor | None = None,
    active: torch.Tensor | None = None,
    stop: torch.Tensor | None = None,
    rows_per_program: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Draw one code per row of ``logits`` [B,V] (fp32) into ``out`` [B] (int64, may be a strided view).

    Per-row [B] inputs: ``temperature``/``top_p`` float32, ``top_k`` int64, ``seed_lo``/``seed_hi``/``frame`` int64;
    the uniforms' counter is ``frame * counter_mul + counter_add``. ``penalty`` [B] float32 with ``presence`` [B,V]
    bool applies the repetition penalty; with ``active`` [B] bool and ``stop`` [B] int64 (the stop draw's codes) as
    well, the drawn code's presence bit is set in rows that are active and did not stop. Returns ``out``.
    ``rows_per_program`` (a power of two): by default 1 on CUDA (every row its own program, on its own SM) and
    16 through the interpreter (where numpy then works on whole tiles: the same code, many times faster).
    ``num_warps`` overrides the launch's warps (benchmarks).
    """
    kernels = _kernels()
    assert kernels is not None, "check available() first"
    draw, _ = kernels
    batch, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("logits must be float32 with contiguous rows")
    if out.shape != (batch,) or out.dtype != torch.int64:
        raise ValueError("out must be an int64 [B] tensor")
    params = (temperature, top_k, top_p, seed_lo, seed_hi, frame)
    if any(t.shape != (batch,) or t.stride(0) != 1 for t in params):
        raise ValueError("per-row parameters must be contiguous [B] tensors")
    use_penalty = penalty is not None
    if use_penalty:
        assert penalty is not None and presence is not None, "penalty needs presence"
        if presence.shape != (batch, vocab) or presence.stride(1) != 1 or presence.dtype != torch.bool:
            raise ValueError("presence must be a bool [B,V] tensor with contiguous rows")
        pres = presence.view(torch.uint8)
    else:
        pres = logits  # unused
    mark = active is not None
    if mark:
        assert use_penalty and stop is not None, "marking presence needs presence and the stop codes"
        assert active is not None  # (mark)
        act = active.view(torch.uint8)
    else:
        act, stop = logits, out  # unused
    block = _block(vocab)
    rows = int(rows_per_program or (1 if logits.is_cuda else 16))
    if rows < 1 or rows & (rows - 1):
        raise ValueError("rows_per_program must be a power of two")
    draw[(-(-batch // rows),)](
        logits, logits.stride(0), temperature, top_k, top_p, penalty if use_penalty else temperature,
        pres, pres.stride(0), seed_lo, seed_hi, frame, int(counter_mul), int(counter_add), act, stop, out,
        out.stride(0), batch,
        V=vocab, BLOCK=block, LOG2_BLOCK=block.bit_length() - 1, ROWS=rows, PENALTY=use_penalty, MARK=mark,
        ACCURATE=logits.is_cuda,
        num_warps=num_warps or (NUM_WARPS if block >= 512 else 1),
        enable_fp_fusion=False,  # no a*b+c is contracted into an FMA: every float op rounds as torch's does
    )
    return out


def fused_uniforms(
    seed_lo: torch.Tensor,
    seed_hi: torch.Tensor,
    frame: torch.Tensor,
    counter_mul: int,
    counter_add: int,
    vocab: int,
    *,
    gumbel: bool = False,
) -> torch.Tensor:
    """The draw kernel's uniforms [B,vocab] (``gumbel``: its noise -log(-log(u)) instead), for tests: equal bit for
    bit to ``sampling.uniforms`` (and ``sampling.gumbel`` of them on CUDA)."""
    kernels = _kernels()
    assert kernels is not None, "check available() first"
    _, uniforms = kernels
    out = torch.empty((seed_lo.shape[0], vocab), dtype=torch.float32, device=seed_lo.device)
    uniforms[(seed_lo.shape[0],)](
        seed_lo, seed_hi, frame, int(counter_mul), int(counter_add), out,
        V=vocab, BLOCK=_block(vocab), GUMBEL=gumbel, ACCURATE=seed_lo.is_cuda,
    )
    return out
