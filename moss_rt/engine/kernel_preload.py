"""The Triton kernels an earlier start met, loaded from Triton's on-disk cache on a thread while the weights load.

Why: on a second start every kernel is in the cache, yet the captures before ready still spent most of their time
loading them, one after the other, on the engine's thread (an H200, 128 slots, issue 24: model graphs 1.6 s and
codec graphs 2.1 s of an 11-14 s start; 0.5-0.7 s for the model graphs with the kernels already in memory). A load is
Triton finding the kernel's cache entry (hashing its source and its dependencies' once per kernel, Triton's own
files once per process), reading the binary and building the kernel object; nothing of it needs the kernel's
arguments, only its specialization, which the data dir's kernel manifest (kernel_manifest.py) holds for every kernel
this machine's compile workers compiled. ``JITFunction.preload`` puts each into the kernel's in-memory cache under the
key its first call looks up, so that call launches at once.

It runs beside the model's opening, the codec's load and the weights' read (mostly waiting on the disk and on copies,
the GIL let go), and is joined before the first capture. It does no device work: a kernel's module is loaded into
the CUDA context on its first launch, in the warm-up run before its capture, as before. Nothing depends on it for
correctness: a job that fails is counted and its kernel loads (or compiles) when met, as before.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moss_rt.engine.compile_workers import KernelJob, resolve_kernel

log = logging.getLogger(__name__)


def preload_job(job: KernelJob) -> None:
    """Load (or, where the cache lacks it, compile) ``job``'s kernel into this process's in-memory kernel cache."""
    resolve_kernel(job.module, job.qualname).preload(job.specialization)


@dataclass(frozen=True)
class PreloadCounts:
    loaded: int  # kernels now in memory
    failed: int  # jobs that failed (another signature since, a kernel gone): they load when met, as before
    seconds: float  # the thread's time, start to end


class KernelPreload:
    """``jobs`` preloaded in order on a thread of its own (see the module docstring); ``wait`` for the counts."""

    def __init__(
        self,
        jobs: Sequence[KernelJob],
        device: torch.device,
        *,
        preload: Callable[[KernelJob], None] = preload_job,
    ) -> None:
        self.jobs = list(jobs)
        self.device = device
        self._preload = preload
        self._counts: PreloadCounts | None = None
        self._thread = threading.Thread(target=self._run, name="moss-rt-kernel-preload", daemon=True)

    def start(self) -> KernelPreload:
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        loaded = failed = 0
        failures: dict[str, str] = {}
        try:
            # Triton asks the active driver for the current device: the engine's, not whatever this thread defaults to.
            with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                for job in self.jobs:
                    try:
                        self._preload(job)
                        loaded += 1
                    except Exception as exc:  # noqa: BLE001 - that kernel loads when met, as without the preload
                        failed += 1
                        failures.setdefault(job.name, f"{type(exc).__name__}: {exc}")
        finally:
            self._counts = PreloadCounts(loaded, failed, time.perf_counter() - t0)
        if failures:
            log.info("kernel preload: %d of %d jobs failed (they load when met): %s", failed, len(self.jobs),
                     "; ".join(f"{name}: {why}" for name, why in sorted(failures.items())[:4]))

    def wait(self) -> PreloadCounts:
        """Wait for the thread (started or not: a preload never started counts nothing)."""
        if self._thread.ident is not None:
            self._thread.join()
        return self._counts or PreloadCounts(0, 0, 0.0)

