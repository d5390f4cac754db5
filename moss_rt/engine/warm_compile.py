"""The Triton kernels of the graphs captured before ready, compiled ahead of the captures, several at once.

Why: on a machine whose Triton cache is cold, most of a start was compiling, one kernel after the other inside the
captures (an H200, issue 24: the first prefill graph 2.5 s, the first step graph 7.9 s, the codec's graphs 8.2 s, of
a 33 s start). Triton compiles mostly outside the GIL (its MLIR passes, LLVM and ptxas), so kernels compile in
parallel on threads; and a kernel is compiled on the first call of its shape, so each thread runs eager passes of
a few shapes, a *chain*: the codec's first and full chunks (from the memory plan on, while the model's weights are
read), its odd chunk lengths, lone prompts' prefill passes (from position 0, after a prefix), batched ones, the step
of one take and its longer key windows. Every pass writes only scratch rows (the codec's scratch stream, the KV
cache's scratch position, inactive step rows): nothing a take reads changes. The captures then find their kernels
compiled and take about their warm-cache time; the idle-time captures after ready find theirs too.

Nothing depends on it for correctness: a chain that fails is logged and its kernels compile in the captures, as
before; with one thread (``compile_threads=1``, the CPU's default) nothing runs ahead. Every chain must have ended
before the first capture: a capture forbids other threads' device work.

``TritonCompileLog`` counts the compiles (and loads from Triton's cache) of the start and their seconds, so the log
says what the start spent compiling and on which kernels.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from moss_rt.engine.codec_batch import CodecBatcher
    from moss_rt.model.prefill_graphs import GraphShape
    from moss_rt.model.runner import ModelRunner

log = logging.getLogger(__name__)

MAX_THREADS = 8  # chains at once: about as many as there are (the step's is the longest)

Chain = tuple[str, list[Callable[[], None]]]


def ahead_marker(setup: dict[str, Any]) -> Path | None:
    """The file saying an earlier start with this ``setup`` (versions, device, model, codec, plan) compiled every kernel
    ahead into the Triton cache in use: it lies in that cache, so it goes with it (a cleared cache has none). With it,
    a start skips the ahead compiles: the captures load their kernels from the cache (measured on an H200: the
    chains' passes cost a warm start 3-4 s for kernels that were all there). None on the CPU (nothing compiles)."""
    if not torch.cuda.is_available():
        return None
    try:
        import triton

        triton_version = str(triton.__version__)
    except ImportError:
        return None
    cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    key = json.dumps({**setup, "torch": torch.__version__, "triton": triton_version}, sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache / f"moss_rt-compiled-{digest}"


def earlier_ahead_compiles() -> bool:
    """Whether the Triton cache in use holds any start's marker (ahead_marker): a start on this machine compiled its
    kernels before, so this one likely needs no compiles (its own plan's marker says for sure, once planned)."""
    marker = ahead_marker({})
    return marker is not None and any(marker.parent.glob("moss_rt-compiled-*"))


def compile_threads(setting: int, device: torch.device) -> int:
    """Threads for the ahead compiles: the setting, or (0) one per CPU core up to MAX_THREADS on CUDA and 1 (none
    ahead) on the CPU, where nothing compiles."""
    if setting > 0:
        return setting
    return min(MAX_THREADS, os.cpu_count() or 1) if device.type == "cuda" else 1


class AheadCompiles:
    """Chains of eager passes run on a thread pool (see the module docstring); ``wait`` before capturing."""

    def __init__(self, device: torch.device, threads: int) -> None:
        self.device = device
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="moss-rt-compile") if threads > 1 else None
        self._chains: list[tuple[str, Future[float]]] = []
        self.started: float | None = None

    @property
    def enabled(self) -> bool:
        return self._pool is not None

    def add(self, chains: Sequence[Chain]) -> None:
        """Start these chains (each one's passes in order, the chains side by side); no-op when disabled."""
        if self._pool is None:
            return
        if self.started is None:
            self.started = time.perf_counter()
        for name, steps in chains:
            if steps:
                self._chains.append((name, self._pool.submit(self._run, name, steps)))

    def _run(self, name: str, steps: list[Callable[[], None]]) -> float:
        t0 = time.perf_counter()
        device = self.device if self.device.type == "cuda" else None
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
            for step in steps:
                step()
            if device is not None:
                torch.cuda.current_stream(device).synchronize()  # its passes ran: a device error shows here
        return time.perf_counter() - t0

    def wait(self) -> dict[str, float]:
        """Wait for every chain started; the seconds each took (failed ones are logged and left out)."""
        out: dict[str, float] = {}
        for name, future in self._chains:
            try:
                out[name] = future.result()
            except Exception:  # the captures compile what it did not: slower, the same graphs
                log.warning("compiling ahead (%s) failed; its kernels compile in the captures", name, exc_info=True)
        self._chains = []
        return out

    def close(self) -> None:
        """Wait for the chains still running (eager passes: seconds at most) and end the threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def codec_chains(batcher: CodecBatcher) -> list[Chain]:
    """The codec's shapes, by chunk length: first chunks (T=1) and full chunks (T=8) of every bucket (captured before
    ready), and the odd chunk lengths of the smallest bucket (captured while idle: a lone take's last chunk) and of
    the largest call.

    Why the largest too: the takes of a burst that join mid-cycle send one odd-length chunk each to get in phase
    (slots.Take.chunk_due), together, as one eager call of many streams. Its window attention runs without key
    splits, other Triton kernels than the small buckets' (which split their keys): on a freshly started H200 the
    first 64-take burst after ready waited ~780 ms for them (session 17), what issue 24 says a start must not skip.
    """
    main, odd = batcher.ahead_shapes()
    chains: list[Chain] = [
        (f"codec, chunks of {t} frame(s)", [partial(batcher.compile_shape, b, tt) for b, tt in main if tt == t])
        for t in sorted({t for _, t in main})
    ]
    if odd:
        smallest = min(b for b, _ in odd)
        largest = min(batcher.max_batch, batcher.decoder.max_streams)
        lengths = sorted({t for _, t in odd})
        calls = [(smallest, t) for t in lengths] + [(largest, t) for t in lengths if largest > smallest]
        chains.append(("codec, odd chunk lengths", [partial(batcher.compile_shape, b, t) for b, t in calls]))
    return chains


def model_chains(runner: ModelRunner) -> list[Chain]:
    """The model's shapes: the step of one take over the first key window (captured before ready) and over the longer
    ones (while idle), lone prompts' prefill passes from position 0 and after a prefix in the first key window."""
    graphs = runner.prefill_graphs
    prefill = graphs.common_shapes()
    keys = runner.key_buckets()
    # Batched passes (captured while idle, the first ones right after ready): the narrowest of each piece bucket,
    # from position 0 and in the first key window (the wider ones share their kernels).
    first = graphs.key_buckets[0] if graphs.key_buckets else 0
    batched: dict[tuple[int, int], GraphShape] = {}
    for shape in graphs.shapes():
        if shape.pieces > 1 and shape.keys in (0, first):
            batched.setdefault((shape.pieces, shape.keys), shape)
    return [
        ("step of one take", [partial(runner.compile_step, 1, keys[0])]),
        ("prefill from position 0", [partial(runner.compile_prefill, s) for s in prefill if s.from_zero]),
        ("prefill after a prefix", [partial(runner.compile_prefill, s) for s in prefill if not s.from_zero]),
        ("steps over longer keys", [partial(runner.compile_step, 1, k) for k in keys[1:]]),
        ("batched prefill passes", [partial(runner.compile_prefill, s) for s in batched.values()]),
    ]


class TritonCompileLog:
    """While installed, every Triton compile of this process (a load from its on-disk cache included) is timed.

    Through Triton's ``knobs.runtime`` hooks (called on the compiling thread before and after each compile); where
    this Triton has none, nothing is counted. Hooks set by others are kept and called first."""

    def __init__(self) -> None:
        self.compiles: list[tuple[str, float]] = []  # (kernel, seconds)
        self._local = threading.local()
        self._runtime: Any = None
        self._previous: tuple[Any, Any] = (None, None)

    def install(self) -> TritonCompileLog:
        try:
            from triton import knobs
        except Exception:  # noqa: BLE001 - no Triton, or one without knobs: nothing to count
            return self
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
            return self
        self._runtime = runtime
        self._previous = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook = self._before
        runtime.jit_post_compile_hook = self._after
        return self

    def remove(self) -> None:
        if self._runtime is not None:
            self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook = self._previous
            self._runtime = None

    def _before(self, **kwargs: Any) -> Any:
        previous = self._previous[0]
        skip = previous(**kwargs) if previous is not None else None
        if not skip:
            self._local.started = time.perf_counter()
        return skip

    def _after(self, **kwargs: Any) -> Any:
        started = getattr(self._local, "started", None)
        if started is not None:
            fn = kwargs.get("fn")
            self.compiles.append((str(getattr(fn, "name", "?")), time.perf_counter() - started))
            self._local.started = None
        previous = self._previous[1]
        return previous(**kwargs) if previous is not None else None

    def mark(self) -> int:
        """The number of compiles so far (``summary`` says how many came after it)."""
        return len(self.compiles)

    def summary(self, mark: int | None = None) -> str:
        if not self.compiles:
            return "no Triton compile"
        total = sum(s for _, s in self.compiles)
        by_kernel: dict[str, float] = {}
        for name, seconds in self.compiles:
            by_kernel[name] = by_kernel.get(name, 0.0) + seconds
        top = ", ".join(f"{n} {s:.1f} s" for n, s in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:6])
        cached = sum(1 for _, s in self.compiles if s < 0.05)
        out = (f"{len(self.compiles)} Triton kernels compiled or loaded ({cached} in under 50 ms: from the cache), "
               f"{total:.1f} s of compile time over all threads; most: {top}")
        if mark is not None:
            late = self.compiles[mark:]
            out += (f"; after the ahead compiles, in the captures: {len(late)} "
                    f"({sum(s for _, s in late):.1f} s{': ' if late else ''}"
                    f"{', '.join(sorted({n for n, _ in late}))})")
        return out
