"""The codec's window-attention kernel on full-size stage shapes (CUDA): its tiles swept, against dense SDPA.

    python bench/window_attention_bench.py [s5 s5full s4 s0 stages cudnn fa4]

One decoder layer's attention at 64 streams, 5 s into a take (10 s windows; s5full: 10 s, the window full), with
random bf16 keys in blocks scattered over the pool as the paged layout leaves them. For each tile shape: ms a call
and the largest difference from the default tiles' output; "dense SDPA" is flash attention over as many contiguous
keys, the speed a window kernel can aim for. ``stages`` sweeps a few tiles around the default on every decoder
stage of the full-size codec, chunks of 1 and 8 frames, 16 and 64 streams (best of 3 x 30 calls each), each with
the register cap (``window_attention.MAX_REGISTERS``) and without, and prints one line a case (cells: key tile /
stages / registers). ``cudnn`` runs the engine's large-call shapes (128 streams; 8 frames at the 400, 200 and 100 Hz
stages, 1 frame at 400 Hz; 6 and 11 s old) through cuDNN's flash attention instead (its SDPA with paged K/V and a
bottom-right band of ``context`` keys, the kernel's semantics), beside the shipped kernel: it needs the cuDNN
frontend, not a dependency of moss_rt (``pip install nvidia-cudnn-frontend==1.16.0``; 1.14-1.16 require nothing
else). ``fa4`` runs the same shapes through FlashAttention 4's CuTe-DSL forward for Hopper (``flash_attn.cute``, a
warp-specialized kernel with asynchronous warp-group MMAs and TMA loads: ``pip install flash-attn-4``, which pulls the
CUTLASS DSL, ~110 MB; not a dependency of moss_rt) over the pool as it is (pages of ``block`` keys through a page
table, read without TMA where a page is not the kernel's 128-key tile) and over a token-major copy of it cut into
128-key pages (what a pool laid out for it would give). Results: bench/RESULTS.md (sessions 10, 28, 29, 34, 35, 37).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moss_rt.codec import window_attention as wa  # noqa: E402


def cdiv(a, b):
    return -(-a // b)

def timeit(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters

def case(name, B, H, Tq, context, tpf, block_frames, age_frames, configs):
    D = 64
    block = block_frames * tpf
    ring = cdiv(context + Tq - 1, block)
    N = B * ring + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    kp = torch.randn(N, H, block, D, device="cuda", generator=g).bfloat16()
    vp = torch.randn(N, H, block, D, device="cuda", generator=g).bfloat16()
    perm = torch.randperm(B * ring, generator=torch.Generator().manual_seed(1)) + 1
    table = perm.view(B, ring).to(torch.int32).cuda()
    q = torch.randn(B, H, Tq, D, device="cuda", generator=g).bfloat16()
    slots = torch.arange(B, device="cuda")
    offs = torch.full((B,), age_frames, device="cuda", dtype=torch.int64)
    scale = D ** -0.5
    keys = min(context, age_frames * tpf + Tq)
    flops = 4 * B * H * Tq * keys * D
    def run(t):
        return wa.window_attention(q, kp, vp, table, slots, offs, tokens_per_frame=tpf, context=context,
                                   block=block, ring_blocks=ring, scale=scale, tiles=t)

    ref = run(None).float()
    base = timeit(lambda: run(None))
    print(f"{name}: B{B} H{H} Tq{Tq} ctx{context} keys~{keys}: default {base:.3f} ms "
          f"({flops / base / 1e9:.0f} TFLOPS)", flush=True)
    k = torch.randn(B, H, keys, D, device="cuda").bfloat16()
    v = torch.randn_like(k)
    d = timeit(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    print(f"   dense SDPA same sizes: {d:.3f} ms ({flops/d/1e9:.0f} TFLOPS)", flush=True)
    res = []
    for t in configs:
        try:
            out = run(t).float()
            err = (out - ref).abs().max().item()
            ms = timeit(lambda t=t: run(t))
            res.append((ms, t, err))
            print(f"   {t}: {ms:.3f} ms err {err:.2e}", flush=True)
        except Exception as exc:
            print(f"   {t}: FAILED {type(exc).__name__}: {str(exc)[:100]}", flush=True)
    res.sort(key=lambda r: r[0])
    print(f"   best: {res[0][1]} {res[0][0]:.3f} ms vs default {base:.3f}", flush=True)

T = wa.Tiles
BIG = [T(bm, bn, w, s) for bm, bn, w, s in [
    (64, 32, 4, 2), (64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 128, 4, 2), (64, 128, 4, 3),
    (64, 64, 8, 3), (128, 32, 4, 3), (128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3),
    (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 1), (128, 64, 8, 4)]]
CASES = {
    "s5": ("stage5 400Hz age5s", 64, 12, 256, 4000, 32, 8, 62, BIG),
    "s5full": ("stage5 400Hz age10s", 64, 12, 256, 4000, 32, 8, 125, BIG[:8]),
    "s4": ("stage4 200Hz age5s", 64, 12, 128, 2000, 16, 8, 62, BIG),
    "s0": ("stage0 12.5Hz age5s", 64, 20, 8, 125, 1, 8, 62,
           [T(16, bn, w, s) for bn, w, s in [(32, 2, 2), (64, 2, 2), (32, 4, 2), (64, 4, 3), (128, 4, 2)]]),
}



def best_of(fn, rounds=3, iters=30):
    return min(timeit(fn, iters) for _ in range(rounds))


def stage_sweep(streams=(16, 64), chunks=(1, 8), age_s=5.0):
    """Every decoder stage of the full-size codec at its real block geometry: the default tiles against 32-, 64-
    and 128-key tiles and 2-4 pipeline stages (the queries per program stay the default's)."""
    from moss_rt.codec import config as codec_config
    from moss_rt.codec import paged_state
    from moss_rt.codec.tiny import full_size_config

    cfg = codec_config._parse(full_size_config())
    for spec in cfg.decoder:
        if not isinstance(spec, codec_config.TransformerSpec):
            continue
        g = paged_state.stage_geometry(spec, cfg.frame_rate, max(chunks), torch.bfloat16)
        for frames in chunks:
            for B in streams:
                stage_case(spec, g, frames, B, int(age_s * cfg.frame_rate))


def stage_case(spec, g, frames, B, age):
    tq = frames * g.tokens_per_frame
    default = wa.tiles_for(tq, g.block)
    tiles = {default}
    for bn in (32, 64, 128):
        if g.block % bn == 0 or bn == wa.BLOCK_N:  # an unaligned tile other than the fallback's is never chosen
            for stages in (2, 3, 4):  # each with the register cap and with the compiler's choice
                tiles.update(T(default.block_m, bn, 4, stages, regs) for regs in (wa.MAX_REGISTERS, None))
    D, H, ring = spec.head_dim, spec.num_heads, g.ring_blocks
    gen = torch.Generator(device="cuda").manual_seed(0)
    kp = torch.randn(B * ring + 1, H, g.block, D, device="cuda", generator=gen).bfloat16()
    vp = torch.randn_like(kp)
    perm = torch.randperm(B * ring, generator=torch.Generator().manual_seed(1)) + 1
    table = perm.view(B, ring).to(torch.int32).cuda()
    q = torch.randn(B, H, tq, D, device="cuda", generator=gen).bfloat16()
    slots = torch.arange(B, device="cuda")
    offs = torch.full((B,), age, device="cuda", dtype=torch.int64)

    def run(t):
        return wa.window_attention(q, kp, vp, table, slots, offs, tokens_per_frame=g.tokens_per_frame,
                                   context=g.context, block=g.block, ring_blocks=ring, scale=D ** -0.5, tiles=t)

    ref = run(default).float()
    timed = []
    for t in sorted(tiles, key=lambda t: (t.block_n, t.num_stages, t.max_registers or 0)):
        err = (run(t).float() - ref).abs().max().item()
        timed.append((best_of(lambda t=t: run(t)), t, err))
    base = next(ms for ms, t, _ in timed if t == default)
    cells = "  ".join(f"{_label(t)}:{ms:.3f}{'*' if t == default else ''}" for ms, t, _ in timed)
    best = min(timed, key=lambda r: r[0])
    print(f"{spec.rate_hz:g} Hz block {g.block} chunk {frames} (Tq {tq}, M {default.block_m}) B{B}: {cells}  "
          f"best {_label(best[1])} {best[0]:.3f} vs {base:.3f}  "
          f"max|d| {max(e for _, _, e in timed):.1e}", flush=True)


def _label(t) -> str:
    """key tile / pipeline stages / registers a thread (r- : the compiler's choice)."""
    return f"{t.block_n}/{t.num_stages}/r{t.max_registers or '-'}"


CUDNN_ROWS = [  # name, streams, heads, queries a stream, context, tokens a frame, block, age in frames
    ("400 Hz, 8 frames, 6 s", 128, 12, 256, 4000, 32, 256, 75),
    ("400 Hz, 8 frames, 11 s", 128, 12, 256, 4000, 32, 256, 137),
    ("400 Hz, 1 frame, 6 s", 128, 12, 32, 4000, 32, 256, 75),
    ("200 Hz, 8 frames, 11 s", 128, 12, 128, 2000, 16, 128, 137),
    ("100 Hz, 8 frames, 11 s", 128, 12, 64, 1000, 8, 64, 137),
]


def cudnn_cases() -> None:
    """The shipped kernel against cuDNN's SDPA on the same pool, table and ages (see the module docstring).

    cuDNN reads a stream's keys in logical order 0..seq_len_kv through a page table; the pool holds each stream's
    keys in a ring of blocks (position k in ring entry (k // block) % ring_blocks). So each call builds, once per
    stage (every layer reuses it), a page table that starts the ring at the block holding the first key any query
    of the chunk sees, rounded down to a block: logical key j is position base + j, seq_len_kv = last position + 1 -
    base, and the band (bottom-right aligned, ``context`` keys including the query's own) masks what lies before
    each query's window. One more page than the ring covers the rounding."""
    import cudnn

    handle = cudnn.create_handle()
    print(f"cuDNN {cudnn.backend_version()}", flush=True)
    for row in CUDNN_ROWS:
        cudnn_case(cudnn, handle, *row)


def paged_layer(B: int, H: int, Tq: int, context: int, tpf: int, block: int, age: int):
    """One layer's attention inputs as the codec's pool holds them (random bf16 keys in blocks scattered over the
    pool, a ring of them a stream, the streams a frame or two apart) and the shipped kernel's output on them:
    (q, kp, vp, table, slots, offs, ring, kw, ref), ``kw`` the kernel's other arguments."""
    D = 64
    ring = cdiv(context + 8 * tpf - 1, block)
    gen = torch.Generator(device="cuda").manual_seed(0)
    kp = torch.randn(B * ring + 1, H, block, D, device="cuda", generator=gen).bfloat16()
    vp = torch.randn_like(kp)
    table = (torch.randperm(B * ring, generator=torch.Generator().manual_seed(1)) + 1).view(B, ring)
    table = table.to(torch.int32).cuda()
    q = torch.randn(B, H, Tq, D, device="cuda", generator=gen).bfloat16()
    slots = torch.arange(B, device="cuda")
    offs = (age - torch.arange(B) % 3).cuda()  # a little apart, as the engine's streams are
    kw = dict(tokens_per_frame=tpf, context=context, block=block, ring_blocks=ring, scale=D ** -0.5)
    return q, kp, vp, table, slots, offs, ring, kw, wa.window_attention(q, kp, vp, table, slots, offs, **kw)


def cudnn_case(cudnn, handle, name: str, B: int, H: int, Tq: int, context: int, tpf: int, block: int,
               age: int) -> None:
    """One row of ``cudnn_cases``: one layer's attention both ways, ms a call and the largest difference."""
    import time

    D = 64
    q, kp, vp, table, slots, offs, ring, kw, ref = paged_layer(B, H, Tq, context, tpf, block, age)
    shipped = best_of(lambda: wa.window_attention(q, kp, vp, table, slots, offs, **kw))

    pages = ring + 1
    cols = torch.arange(pages, device="cuda")
    page_table = torch.zeros(B, 1, pages, 1, dtype=torch.int32, device="cuda")
    seq_q = torch.full((B, 1, 1, 1), Tq, dtype=torch.int32, device="cuda")
    seq_kv = torch.zeros(B, 1, 1, 1, dtype=torch.int32, device="cuda")

    def prepare() -> None:
        start = offs * tpf
        base = (start - context + 1).clamp(min=0) // block  # the ring entry of the first key any query sees
        page_table.copy_(table[slots[:, None], (base[:, None] + cols[None, :]) % ring].view(B, 1, pages, 1))
        seq_kv.copy_((start + Tq - base * block).view(B, 1, 1, 1))

    out = torch.empty(B, Tq, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    t_q, t_k, t_v = graph.tensor_like(q), graph.tensor_like(kp), graph.tensor_like(vp)
    t_pk, t_pv = graph.tensor_like(page_table), graph.tensor_like(page_table)
    t_sq, t_skv = graph.tensor_like(seq_q), graph.tensor_like(seq_kv)
    o, _ = graph.sdpa(name="window", q=t_q, k=t_k, v=t_v, is_inference=True, attn_scale=D ** -0.5,
                      use_padding_mask=True, seq_len_q=t_sq, seq_len_kv=t_skv,
                      diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_left_bound=context,
                      diagonal_band_right_bound=0, paged_attention_k_table=t_pk, paged_attention_v_table=t_pv,
                      paged_attention_max_seq_len_kv=pages * block)
    o.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride()))
    t0 = time.perf_counter()
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    built = time.perf_counter() - t0
    workspace = torch.empty(max(1, graph.get_workspace_size()), device="cuda", dtype=torch.uint8)
    pack = {t_q: q, t_k: kp, t_v: vp, t_pk: page_table, t_pv: page_table, t_sq: seq_q, t_skv: seq_kv, o: out}

    def run() -> None:
        graph.execute(pack, workspace, handle=handle)

    prepare()
    run()
    err = (out.float() - ref.float()).abs().max().item()
    attend = best_of(run)
    with_table = best_of(lambda: (prepare(), run()))
    print(f"{name}: shipped {shipped:.3f} ms, cuDNN {attend:.3f} ms a layer ({shipped / attend:.2f}x; "
          f"{with_table:.3f} with the page table, made once a stage), max |d| {err:.1e}, built in {built:.2f} s",
          flush=True)


def fa4_cases() -> None:
    """The shipped kernel against FlashAttention 4 (CuTe DSL, SM90) on ``cudnn_cases``' shapes (module docstring)."""
    from flash_attn.cute.interface import flash_attn_varlen_func

    for row in CUDNN_ROWS:
        fa4_case(flash_attn_varlen_func, *row)


def fa4_case(attend, name: str, B: int, H: int, Tq: int, context: int, tpf: int, block: int, age: int) -> None:
    """One row of ``fa4_cases``: ms a layer both ways, the largest difference, and the first call's compile time.

    As in ``cudnn_case``, a page table per stage starts each stream's ring at the block holding the first key its
    chunk sees; ``seqused_k`` ends it at the chunk's last query, and a local window of ``context`` keys (the query's
    own included) bottom-right aligned masks the rest."""
    import time

    D = 64
    q, kp, vp, table, slots, offs, ring, kw, ref = paged_layer(B, H, Tq, context, tpf, block, age)
    shipped = best_of(lambda: wa.window_attention(q, kp, vp, table, slots, offs, **kw))
    keys = min(context, age * tpf + Tq)  # the window's keys a query sees at most
    flops = 4 * B * H * Tq * keys * D

    pages = ring + 1
    cols = torch.arange(pages, device="cuda")
    start = offs * tpf
    base = (start - context + 1).clamp(min=0) // block
    blocks = table[slots[:, None], (base[:, None] + cols[None, :]) % ring]  # (B, pages): the pool's blocks in order
    seqused = (start + Tq - base * block).to(torch.int32)
    qf = q.transpose(1, 2)  # (B, Tq, H, D)
    split = block // 128  # 128-key pages a block holds, token-major
    page_of_block = torch.arange(split, device="cuda", dtype=torch.int32)
    layouts = {
        f"pool as it is (pages of {block})": (kp.transpose(1, 2), vp.transpose(1, 2), blocks.contiguous()),
        "token-major, pages of 128": (
            kp.transpose(1, 2).contiguous().view(-1, 128, H, D), vp.transpose(1, 2).contiguous().view(-1, 128, H, D),
            (blocks[:, :, None] * split + page_of_block).flatten(1).contiguous(),
        ) if block % 128 == 0 and split > 1 else None,
    }
    cells = []
    for label, layout in layouts.items():
        if layout is None:
            continue
        k, v, page_table = layout

        def run(k=k, v=v, page_table=page_table):
            # FA's window counts the keys before the query: context - 1 of them and its own.
            out = attend(qf, k, v, seqused_k=seqused, page_table=page_table, softmax_scale=D ** -0.5,
                         window_size=(context - 1, 0))
            return out[0] if isinstance(out, tuple) else out

        try:
            t0 = time.perf_counter()
            out = run()
            torch.cuda.synchronize()
            built = time.perf_counter() - t0
            err = (out.transpose(1, 2).float() - ref.float()).abs().max().item()
        except Exception as exc:  # noqa: BLE001 - a layout the kernel refuses is a result too
            cells.append(f"{label}: FAILED {type(exc).__name__}: {str(exc)[:160]}")
            continue
        if err > 0.05:
            cells.append(f"{label}: max |d| {err:.1e}, not the shipped kernel's semantics")
            continue
        ms = best_of(run)
        cells.append(f"{label}: {ms:.3f} ms ({shipped / ms:.2f}x; {flops / ms / 1e9:.0f} TFLOP/s), max |d| {err:.1e}, "
                     f"first call {built:.1f} s")
    print(f"{name}: shipped {shipped:.3f} ms ({flops / shipped / 1e9:.0f} TFLOP/s)", flush=True)
    for cell in cells:
        print(f"   FA4 {cell}", flush=True)


if __name__ == "__main__":
    for which in sys.argv[1:] or ["s5", "s4", "s0"]:
        if which == "stages":
            stage_sweep()
        elif which == "cudnn":
            cudnn_cases()
        elif which == "fa4":
            fa4_cases()
        else:
            case(*CASES[which])
