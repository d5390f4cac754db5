"""Where the graphed frame step's time goes (issue 12): step time with the fused sampler and with the torch one,
CUDA kernels per step by phase, device time per phase, and the cost of one frame's 13 draws alone.

    python bench/step_profile.py [--batches 1,16,64] [--context 960] [--steps 30] [--model DIR] [--out FILE]

Full-size random weights built in memory (``tiny.build_full_size_random_model``: the weights
``write_full_size_random_checkpoint`` writes, without 9 GB of disk traffic) unless ``--model`` names a checkpoint;
bf16; every slot holds a ``--context``-row prompt; sampling defaults (1.7 / top-k 25 / top-p 0.8) with penalty 1.1.
Sections, each printed as one JSON line when done (the last line holds everything; a failing section records its
error and the rest still run):

- ``step``: per batch and sampler (``fused``; ``torch`` = MOSS_RT_FUSED_SAMPLER=0), ``ModelRunner.step`` wall ms
  (host included) and the graph replay's device ms (CUDA events around each replay), mean of ``--steps`` steps
  after 5 untimed ones that capture the graph (and compile the kernels);
- ``kernels``: per batch and sampler, CUDA kernels (and memcpy/memset nodes) of one graph replay, counted by
  torch.profiler, with their summed device time and the kernels taking the most of it (by name); and the same
  split by phase over one eager ``frame_step`` (a spin kernel launched at each phase boundary splits the in-order
  kernel stream) with each phase's summed kernel time (eager: launch gaps excluded);
- ``phases``: per batch and sampler, device ms per phase (backbone, local transformer, sampling, bookkeeping)
  inside a graph of the step captured with timing events at the phase boundaries (external event-record nodes),
  and that graph's total (the events themselves add a little);
- ``fused_backbone``: whether the backbone ran fused (fused_layers.py); ``MOSS_RT_FUSED_BACKBONE=0`` for the torch
  one. Compare the two in two runs with ``--samplers fused`` (one sampler: no graph-table clearing);
- ``fused_local``: whether the local transformer ran fused (fused_local.py); ``MOSS_RT_FUSED_LOCAL=0`` for the
  torch one, compared the same way;
- ``prefill`` (not run by default): one batched prefill pass of 1 / 4 / 16 / 20 fresh ``--prefill-rows`` prompts,
  with SDPA chunk attention and ``MOSS_RT_CHUNK_SDPA=0``, ms and backbone TFLOP/s, one prompt through its prefill
  graph, the prompt's rows past its first ``--prefill-prefix`` (160) as one lone piece after that prefix (a line after
  its cached opening) through its after-a-prefix graph and eagerly, and the pass's top kernels;
- ``retake_prefill`` (not run by default): a burst of retakes with a new instruction, 1 / 2 / 4 / 8 slots each
  prefilling ``--retake-rows`` (253) rows after a ``--retake-prefix`` (147) row opening in one pass, through its
  batched prefill graph and eagerly, with the masked attention and with the pieces packed
  (``MOSS_RT_PACKED_PREFILL=1``): ms, us a row, TFLOP/s, at the most pieces what the pass wrote against the masked
  pass's (graphed where a graph holds it; max abs difference), and the graphed pass's top kernels both ways;
- ``draws``: one frame's 13 draws alone (stop head + 12 codebooks, penalty on), graphed, µs: the fused kernel
  (with 1/2/4/8 warps) vs the torch path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moss_rt.generation import SamplingParams  # noqa: E402
from moss_rt.model import ModelRunner, fused_layers, fused_local, fused_sampling, load_model  # noqa: E402
from moss_rt.model import step as step_mod  # noqa: E402
from moss_rt.model.runner import PrefillRequest  # noqa: E402
from moss_rt.model.sampling import apply_repetition_penalty, sample, token_keys, uniforms  # noqa: E402
from moss_rt.model.tiny import build_full_size_random_model  # noqa: E402

SAMPLERS = {"fused": "1", "torch": "0"}  # MOSS_RT_FUSED_SAMPLER
PHASES = ("local_ms", "sampling_ms", "backbone_ms", "bookkeeping_ms")


_RETIRED_GRAPHS: list[Any] = []


def use_sampler(runner: ModelRunner, name: str) -> None:
    """Switch the sampler: frame_step reads the switch when it runs, so the captured graphs must go from the runner's
    table. They are kept alive here, not deleted: the runner captures into one private memory pool, and once every
    graph holding it is gone the pool is released, after which a capture into its handle fails PyTorch's allocator
    assertion (``use_count > 0``) — what ended this section before (session 10)."""
    os.environ["MOSS_RT_FUSED_SAMPLER"] = SAMPLERS[name]
    torch.cuda.synchronize()
    _RETIRED_GRAPHS.extend(runner._graphs.values())  # bench-only reach into the runner
    runner._graphs.clear()  # the next step captures with the new sampler


def restart(runner: ModelRunner, slots: list[int], context: int) -> None:
    for s in slots:
        runner.truncate(s, context)
    runner.apply_staged()  # the sections below also run frame_step themselves, which applies nothing staged


class TimedGraph:
    """Stands in for a captured graph in the runner's table: CUDA events around each replay."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph = graph
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def replay(self) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        self.pairs.append((start, end))

    def mean_ms(self) -> float:
        torch.cuda.synchronize()
        return float(np.mean([a.elapsed_time(b) for a, b in self.pairs]))


def graph_of(runner: ModelRunner, batch: int) -> tuple[tuple[int, int], Any]:
    keys = [k for k in runner._graphs if k[0] == batch]
    assert len(keys) == 1, f"expected one graph at batch {batch}, have {list(runner._graphs)}"
    return keys[0], runner._graphs[keys[0]]


def bench_step(runner: ModelRunner, slots: list[int], batch: int, context: int, steps: int) -> dict[str, float]:
    active = slots[:batch]
    restart(runner, active, context)
    for _ in range(5):  # captures this batch's graph (and compiles whatever it launches)
        runner.step(active)
    restart(runner, active, context)
    key, graph = graph_of(runner, batch)
    timed = TimedGraph(graph)
    runner._graphs[key] = timed  # type: ignore[assignment]
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.step(active)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps * 1000.0
        return {"step_ms": round(wall, 3), "replay_ms": round(timed.mean_ms(), 3)}
    finally:
        runner._graphs[key] = graph


def timed_ms(run: Callable[[], None], reps: int) -> float:
    """Mean ms of ``run`` over ``reps`` calls after 2 untimed ones (first-use costs), the device waited for."""
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1000.0


def after_prefix_bench(runner: ModelRunner, slot: int, prompt: np.ndarray, prefix: int, reps: int) -> dict[str, Any]:
    """A line after its cached opening (issue 24's ``--prompts lines``): the prompt's rows past its first ``prefix``
    prefilled as one lone piece from there (the slot keeps the prefix), ms (mean of ``reps`` after 2 untimed), through
    its after-a-prefix prefill graph and eagerly (graphs off for the pass)."""
    runner.prefill_batch([PrefillRequest(slot, prompt[:prefix])])  # from position 0: replaces what the slot held
    piece = prompt[prefix:]
    shape = runner.prefill_graphs.shape_for(len(piece), prefix)
    if shape is not None:
        runner.prefill_graphs.capture(shape)  # the engine's warm-up or idle time has it; here it may be new

    def one_pass() -> None:
        runner.truncate(slot, prefix)
        runner.prefill_batch([PrefillRequest(slot, piece, prefix)])

    out: dict[str, Any] = {}
    for name, graphs in (("after_prefix_graph", True), ("after_prefix_eager", False)):
        runner.use_cuda_graphs = graphs  # bench-only: the switch the runner reads for each pass
        replays = runner.prefill_graphs.replays
        try:
            ms = timed_ms(one_pass, reps)
        finally:
            runner.use_cuda_graphs = True
        out[name] = {"ms": round(ms, 2), "prefix": prefix,
                     "rows": len(piece), "graphed": runner.prefill_graphs.replays - replays == reps + 2,
                     "shape": list(shape) if shape is not None else None}
    return out


def prefill_bench(runner: ModelRunner, slots: list[int], rows: int, batches: list[int], reps: int,
                  prefix: int) -> dict[str, Any]:
    """One batched prefill pass of ``b`` fresh ``rows``-row prompts, ms (mean of ``reps`` after 2 untimed), with the
    SDPA chunk attention and with MOSS_RT_CHUNK_SDPA=0; achieved backbone TFLOP/s (2 x non-embedding parameters x
    rows); and the pass's top CUDA kernels by device time at the largest batch (SDPA)."""
    from torch.profiler import ProfilerActivity, profile

    cfg = runner.config.backbone
    layer_params = sum(p.numel() for p in runner.model.transformer.layers.parameters())
    rng = np.random.default_rng(1)
    prompt = np.full((rows, runner.config.n_channels), runner.config.audio_pad_token_id, dtype=np.int64)
    prompt[:, 0] = rng.integers(0, min(1000, cfg.vocab_size), rows)

    def one_pass(b: int) -> None:
        for s in slots[:b]:
            runner.truncate(s, 1)
        runner.prefill_batch([PrefillRequest(s, prompt) for s in slots[:b]])

    out: dict[str, Any] = {}
    for mode in ("1", "0"):
        os.environ["MOSS_RT_CHUNK_SDPA"] = mode
        for b in batches:
            ms = timed_ms(lambda b=b: one_pass(b), reps)
            tflops = 2.0 * layer_params * rows * b / (ms / 1000.0) / 1e12
            out[f"{'sdpa' if mode == '1' else 'plain'}_b{b}"] = {"ms": round(ms, 2), "tflops": round(tflops, 1)}
    os.environ["MOSS_RT_CHUNK_SDPA"] = "1"
    # A lone prompt through its prefill graph (the engine captures them at warm-up): padded to its row bucket.
    runner.prefill_graphs.capture_common()
    replays = runner.prefill_graphs.replays
    out["graph_b1"] = {"ms": round(timed_ms(lambda: one_pass(1), reps), 2),
                       "graphed": runner.prefill_graphs.replays - replays == reps + 2}
    out.update(after_prefix_bench(runner, slots[0], prompt, prefix, reps))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        one_pass(max(batches))
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in cuda_events(prof):
        totals[e.name[:90]] = totals.get(e.name[:90], 0.0) + e.device_time / 1000.0
    out["top_kernels_ms"] = {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:14]}
    out["kernel_ms_total"] = round(sum(totals.values()), 2)
    for s in slots:  # back to the profile's context for the other sections
        runner.truncate(s, 1)
    return out


def retake_prefill_bench(runner: ModelRunner, slots: list[int], prefix: int, rows: int, pieces: list[int],
                         reps: int) -> dict[str, Any]:
    """A burst of directors' retakes with a new instruction (issue 22): ``p`` slots each holding a ``prefix``-row
    opening prefill their next ``rows`` rows (the instruction on) in one pass after that prefix, through its batched
    prefill graph (where one holds the pass) and eagerly: ms (mean of ``reps`` after 2 untimed), us a row, backbone
    TFLOP/s; and the top CUDA kernels of the graphed pass of the most pieces a graph holds."""
    from torch.profiler import ProfilerActivity, profile

    cfg = runner.config.backbone
    layer_params = sum(p.numel() for p in runner.model.transformer.layers.parameters())
    rng = np.random.default_rng(2)
    prompt = np.full((prefix + rows, runner.config.n_channels), runner.config.audio_pad_token_id, dtype=np.int64)
    prompt[:, 0] = rng.integers(0, min(1000, cfg.vocab_size), prefix + rows)
    piece = prompt[prefix:]
    runner.prefill_batch([PrefillRequest(s, prompt[:prefix]) for s in slots[: max(pieces)]])

    def one_pass(n: int) -> None:
        for s in slots[:n]:
            runner.truncate(s, prefix)
        runner.prefill_batch([PrefillRequest(s, piece, prefix) for s in slots[:n]])

    def cache() -> list[torch.Tensor]:
        return [t.float() for s in slots[: max(pieces)] for t in runner.slot_cache(s, prefix + rows)]

    out: dict[str, Any] = {}
    profiled = None
    reference: list[torch.Tensor] | None = None
    for packed in ("0", "1"):  # the masked pass, then the pieces packed (MOSS_RT_PACKED_PREFILL)
        os.environ["MOSS_RT_PACKED_PREFILL"] = packed
        suffix = "_packed" if packed == "1" else ""
        for n in pieces:
            shape = runner.prefill_graphs.shape_for_pass([rows] * n, [prefix] * n)
            if shape is not None:
                runner.prefill_graphs._graphs.pop(shape, None)  # bench-only: captured again under this switch
                runner.prefill_graphs.capture(shape)
                profiled = n
            for name, graphs in (("graph", True), ("eager", False)):
                if graphs and shape is None:
                    continue
                runner.use_cuda_graphs = graphs  # bench-only: the switch the runner reads for each pass
                replays = runner.prefill_graphs.replays
                try:
                    ms = timed_ms(lambda n=n: one_pass(n), reps)
                finally:
                    runner.use_cuda_graphs = True
                row = out[f"{name}{suffix}_p{n}"] = {
                    "ms": round(ms, 2), "us_a_row": round(ms * 1000.0 / (n * rows), 2),
                    "tflops": round(2.0 * layer_params * rows * n / (ms / 1000.0) / 1e12, 1),
                    "graphed": runner.prefill_graphs.replays - replays == reps + 2,
                    "shape": list(shape) if shape is not None else None,
                }
                if n == max(pieces):  # what the pass wrote (keys, values, hidden) against the first masked pass
                    written = cache()
                    if reference is None:
                        reference = written
                    row["max_abs_diff_vs_masked"] = round(max(float((a - b).abs().max())
                                                              for a, b in zip(written, reference, strict=True)), 5)
    os.environ["MOSS_RT_PACKED_PREFILL"] = "0"
    if profiled is not None:
        shape = runner.prefill_graphs.shape_for_pass([rows] * profiled, [prefix] * profiled)
        for packed in ("0", "1"):
            os.environ["MOSS_RT_PACKED_PREFILL"] = packed
            runner.prefill_graphs._graphs.pop(shape, None)  # bench-only: captured again under this switch
            runner.prefill_graphs.capture(shape)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                one_pass(profiled)
                torch.cuda.synchronize()
            totals: dict[str, float] = {}
            for e in cuda_events(prof):
                totals[e.name[:90]] = totals.get(e.name[:90], 0.0) + e.device_time / 1000.0
            name = f"graph{'_packed' if packed == '1' else ''}_p{profiled}"
            out[f"{name}_top_kernels_ms"] = {
                k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:16]
            }
            out[f"{name}_kernel_ms_total"] = round(sum(totals.values()), 2)
        os.environ["MOSS_RT_PACKED_PREFILL"] = "0"
    for s in slots:
        runner.truncate(s, 1)
    return out


def cuda_events(prof: Any) -> list[Any]:
    from torch.autograd import DeviceType

    return sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)


def is_memop(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset", "memcpy", "memset"))


def count_replay_kernels(runner: ModelRunner, slots: list[int], batch: int, context: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    active = slots[:batch]
    restart(runner, active, context)
    runner.step(active)  # captures the graph if this sampler has none yet; leaves these rows active
    restart(runner, active, context)
    _, graph = graph_of(runner, batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    events = cuda_events(prof)
    return {
        "kernels": sum(not is_memop(e.name) for e in events),
        "memops": sum(is_memop(e.name) for e in events),
        "busy_ms": round(sum(e.time_range.end - e.time_range.start for e in events) / 1000.0, 3),
        "span_ms": round((events[-1].time_range.end - events[0].time_range.start) / 1000.0, 3) if events else 0.0,
        "top": top_kernels(events, 14),
    }


def top_kernels(events: list[Any], n: int) -> list[dict[str, Any]]:
    """The kernels taking the most device time, by name (launches and summed ms): what a step spends its time on."""
    by_name: dict[str, list[float]] = {}
    for e in events:
        row = by_name.setdefault(e.name[:90], [0, 0.0])
        row[0] += 1
        row[1] += (e.time_range.end - e.time_range.start) / 1000.0
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:n]
    return [{"kernel": name, "launches": int(c), "ms": round(ms, 3)} for name, (c, ms) in ranked]


class MarkerTimer:
    """frame_step's timer hooks: a spin kernel at each phase boundary (the stream keeps launch order)."""

    def __init__(self) -> None:
        self.laps: list[str] = []

    def start(self) -> None:
        torch.cuda._sleep(1)

    def lap(self, bucket: str) -> None:
        torch.cuda._sleep(1)
        self.laps.append(bucket)


@torch.inference_mode()
def eager_phase_kernels(runner: ModelRunner, slots: list[int], batch: int, context: int) -> dict[str, Any]:
    """One eager frame_step (rows [0,batch), the graphs' shape) under the profiler, kernels split by phase."""
    from torch.profiler import ProfilerActivity, profile

    st = runner.state
    restart(runner, slots[:batch], context)
    st.active.zero_()
    st.active[:batch] = True
    key_len = runner._key_bucket(context + 1)
    step_mod.frame_step(runner.model, st, runner.tables, 0, batch, key_len)  # warm (allocator, compiles)
    restart(runner, slots[:batch], context)
    st.active[:batch] = True
    torch.cuda.synchronize()
    marker = MarkerTimer()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step_mod.frame_step(runner.model, st, runner.tables, 0, batch, key_len, marker)  # type: ignore[arg-type]
        torch.cuda.synchronize()
    st.active.zero_()
    counts = {p: 0 for p in PHASES}
    busy_us = {p: 0.0 for p in PHASES}
    memops = {p: 0 for p in PHASES}
    segment = -1  # before the start marker
    for e in cuda_events(prof):
        if "spin" in e.name.lower():
            segment += 1
            continue
        if not 0 <= segment < len(marker.laps):
            continue
        phase = marker.laps[segment]
        if is_memop(e.name):
            memops[phase] += 1
        else:
            counts[phase] += 1
        busy_us[phase] += e.time_range.end - e.time_range.start
    return {
        "kernels": {p.removesuffix("_ms"): n for p, n in counts.items()},
        "memops": {p.removesuffix("_ms"): n for p, n in memops.items()},
        "kernel_busy_ms": {p.removesuffix("_ms"): round(us / 1000.0, 3) for p, us in busy_us.items()},
        "markers_seen": segment + 1,
        "phase_boundaries": len(marker.laps) + 1,
    }


class EventTimer:
    """frame_step's timer hooks: a timing event at each phase boundary, recorded inside the captured graph."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, torch.cuda.Event]] = []

    def _mark(self, label: str) -> None:
        event = torch.cuda.Event(enable_timing=True, external=True)
        event.record()
        self.marks.append((label, event))

    def start(self) -> None:
        self.marks.clear()
        self._mark("start")

    def lap(self, bucket: str) -> None:
        self._mark(bucket)


def capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


@torch.inference_mode()
def graph_phase_times(runner: ModelRunner, slots: list[int], batch: int, context: int, reps: int) -> dict[str, Any]:
    """Device ms per phase from timing events captured inside a graph of the step (rows [0,batch))."""
    st = runner.state
    key_len = runner._key_bucket(context + 1)
    timer = EventTimer()
    restart(runner, slots[:batch], context)
    st.active.zero_()  # capture with no row active (no effect), as the runner does
    graph = capture(lambda: step_mod.frame_step(runner.model, st, runner.tables, 0, batch, key_len, timer))
    marks = list(timer.marks)  # the captured graph's event nodes (the last capture's events)
    totals = {p: [] for p in PHASES}
    whole = []
    for _ in range(reps):
        restart(runner, slots[:batch], context)
        st.active[:batch] = True
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        whole.append(start.elapsed_time(end))
        step = {p: 0.0 for p in PHASES}
        for (_, a), (label, b) in zip(marks, marks[1:], strict=False):
            step[label] += a.elapsed_time(b)
        for p in PHASES:
            totals[p].append(step[p])
    st.active.zero_()
    restart(runner, slots[:batch], context)
    del graph
    return {
        "phase_ms": {p.removesuffix("_ms"): round(float(np.median(v)), 3) for p, v in totals.items()},
        "graph_with_events_ms": round(float(np.median(whole)), 3),
        "events": len(marks),
    }


@torch.inference_mode()
def draws_bench(batch: int, reps: int, warps: tuple[int, ...]) -> dict[str, float]:
    """One frame's draws alone (stop head + 12 codebooks, penalty 1.1), graphed: µs per frame."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(batch)
    n_vq, vocab = 12, 1024
    logits = [torch.randn(batch, vocab, device=dev, generator=gen) * 3 for _ in range(n_vq)]
    stop_logits = torch.randn(batch, 2, device=dev, generator=gen)
    presence = torch.rand(batch, n_vq, vocab, device=dev, generator=gen) < 0.1
    temp, top_k, top_p = (torch.full((batch,), v, device=dev) for v in (1.7, 25.0, 0.8))
    top_k = top_k.long()
    penalty = torch.full((batch,), 1.1, device=dev)
    text = (torch.ones(batch, device=dev), torch.full((batch,), 50, device=dev, dtype=torch.long),
            torch.ones(batch, device=dev))
    seed_lo = torch.arange(batch, device=dev)
    seed_hi = torch.zeros(batch, dtype=torch.long, device=dev)
    frame = torch.full((batch,), 123, dtype=torch.long, device=dev)
    codes = torch.empty((batch, n_vq), dtype=torch.long, device=dev)
    stop_code = torch.empty((batch,), dtype=torch.long, device=dev)
    keys, stop_keys = token_keys(vocab, dev), token_keys(2, dev)

    def fused(num_warps: int) -> Callable[[], None]:
        def fn() -> None:
            fused_sampling.fused_draw(stop_code, stop_logits, *text, seed_lo, seed_hi, frame, n_vq + 1, 0)
            for k in range(n_vq):
                fused_sampling.fused_draw(
                    codes[:, k], logits[k], temp, top_k, top_p, seed_lo, seed_hi, frame, n_vq + 1, k + 1,
                    penalty=penalty, presence=presence[:, k], num_warps=num_warps,
                )
        return fn

    def plain() -> None:
        base = frame * (n_vq + 1)
        sample(stop_logits, *text, uniforms(seed_lo, seed_hi, base, stop_keys))
        for k in range(n_vq):
            x = apply_repetition_penalty(logits[k], presence[:, k], penalty)
            codes[:, k] = sample(x, temp, top_k, top_p, uniforms(seed_lo, seed_hi, base + k + 1, keys))

    out = {}
    runs: list[tuple[str, Callable[[], None]]] = [("torch_us", plain)]
    runs += [(f"fused_w{w}_us", fused(w)) for w in warps]
    for name, fn in runs:
        graph = capture(fn)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        out[name] = round(start.elapsed_time(end) / reps * 1000.0, 1)
        del graph
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: full-size random weights in memory)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=960, help="prompt rows per slot (steps stay in the 1,024-key graph)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warps", default="1,2,4,8", help="warps per row tried by the draws section")
    ap.add_argument("--sections", default="step,kernels,phases,draws")
    ap.add_argument("--samplers", default="fused,torch",
                    help="samplers to compare; one only avoids clearing the runner's graphs (PyTorch allocator assert)")
    ap.add_argument("--prefill-rows", type=int, default=400, help="prompt rows per take in the prefill section")
    ap.add_argument("--prefill-prefix", type=int, default=160,
                    help="rows of the prompt a slot already holds in the prefill section's after-a-prefix pass")
    ap.add_argument("--retake-prefix", type=int, default=147,
                    help="rows a slot holds before a retake's changed rows in the retake_prefill section")
    ap.add_argument("--retake-rows", type=int, default=253, help="a retake's changed rows (its instruction on)")
    ap.add_argument("--prefill-graph-rows", type=int, default=0,
                    help="padded rows a batched prefill graph holds (the server's setting; 0: its default)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "a CUDA GPU is needed"
    batches = [int(b) for b in args.batches.split(",")]
    sections = set(args.sections.split(","))
    samplers = args.samplers.split(",")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "batches": batches, "context": args.context,
                               # MOSS_RT_FUSED_BACKBONE (fused_layers.py): run once with it =0 to compare
                               "fused_backbone": fused_layers.available(torch.zeros(1, device="cuda")),
                               # MOSS_RT_FUSED_LOCAL (fused_local.py), likewise
                               "fused_local": fused_local.available(torch.zeros(1, device="cuda"))}

    def emit() -> None:
        text = json.dumps(results)
        if args.out:
            args.out.write_text(text + "\n")
        print(text, flush=True)

    def section(name: str, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as exc:  # keep the other sections' numbers
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2500:]}
        results.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
        emit()

    t0 = time.perf_counter()
    if args.model:
        loaded = load_model(args.model, device="cuda", dtype=torch.bfloat16)
        model, config = loaded.model, loaded.config
    else:
        model, config = build_full_size_random_model(device="cuda", dtype=torch.bfloat16)
    runner = ModelRunner(model, None, config, max_slots=max(batches), max_seq_len=args.context + 128,
                         device="cuda", dtype=torch.bfloat16, prefill_graph_rows=args.prefill_graph_rows)
    slots = [runner.alloc_slot() for _ in range(max(batches))]
    rng = np.random.default_rng(0)
    requests = []
    for s in slots:
        rows = np.full((args.context, config.n_channels), config.audio_pad_token_id, dtype=np.int64)
        rows[:, 0] = rng.integers(0, 1000, args.context)
        requests.append(PrefillRequest(s, rows))
    runner.prefill_batch(requests)
    for s in slots:
        runner.set_sampling(s, SamplingParams(audio_repetition_penalty=1.1), seed=int(s))
    torch.cuda.synchronize()
    results["setup_s"] = round(time.perf_counter() - t0, 1)
    emit()

    def per_batch_and_sampler(fn: Callable[[int], Any]) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            out: dict[str, Any] = {}
            for name in samplers:
                if len(samplers) > 1:
                    use_sampler(runner, name)
                else:
                    os.environ["MOSS_RT_FUSED_SAMPLER"] = SAMPLERS[name]
                for b in batches:
                    out[f"{name}_b{b}"] = fn(b)
            return out
        return run

    if "prefill" in sections:  # first: the other sections refill the slots to --context themselves
        prefill_batches = [b for b in (1, 4, 16, 20) if b <= len(slots)]
        section("prefill", lambda: prefill_bench(runner, slots, args.prefill_rows, prefill_batches, 5,
                                                 min(args.prefill_prefix, args.prefill_rows - 1)))
        runner.prefill_batch(requests)
    if "retake_prefill" in sections:
        retake_pieces = [n for n in (1, 2, 4, 8) if n <= len(slots)]
        section("retake_prefill", lambda: retake_prefill_bench(runner, slots, args.retake_prefix, args.retake_rows,
                                                               retake_pieces, 5))
        runner.prefill_batch(requests)
    if "step" in sections:
        section("step", per_batch_and_sampler(lambda b: bench_step(runner, slots, b, args.context, args.steps)))
    if "kernels" in sections:
        def kernels(b: int) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for name, fn in (("graph_replay", count_replay_kernels), ("eager_by_phase", eager_phase_kernels)):
                try:
                    out[name] = fn(runner, slots, b, args.context)
                except Exception as exc:  # the other count may still work
                    out[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
            return out
        section("kernels", per_batch_and_sampler(kernels))
    if "phases" in sections:
        section("phases", per_batch_and_sampler(lambda b: graph_phase_times(runner, slots, b, args.context, 10)))
    if "draws" in sections:
        warps = tuple(int(w) for w in args.warps.split(","))
        section("draws", lambda: {f"b{b}": draws_bench(b, 50, warps) for b in batches})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
