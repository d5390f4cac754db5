"""Triton kernels compiled in worker processes, then loaded by the engine from Triton's on-disk cache.

Why: compiling ahead on threads (warm_compile.py) ran 51.8 s of compiles in 19.7 s on 8 threads of an H200 host
(issue 24): a Triton compile is mostly Python (the kernel's AST to its first IR, the pass pipelines' drivers) between
its native steps, so threads of one process wait for each other's GIL. Processes do not.

How: while installed (``install``), Triton asks this object before it compiles a kernel in this process (its
``knobs.runtime.jit_cache_hook``, called on the thread about to compile, with the kernel's specialization as JSON:
argument types, constants, alignment, options, target). The hook hands that to a worker process, which imports the
kernel's module, compiles the same specialization into the same cache folder (``TRITON_CACHE_DIR``, inherited), and
answers; the hook then lets Triton go on, and Triton finds the kernel in its cache (the same key: the same source and
specialization) and only loads it. The calling thread waits without the GIL, so the engine's compile threads become
mere drivers of the eager passes that meet each kernel (the chains), and every compile runs in a process of its own.

The workers never touch the GPU: they compile for the target the engine's process names (the GPU's architecture) with
a stand-in Triton driver that only answers "this target" (no CUDA context in a worker, no device memory taken while
the engine plans its memory). Nothing depends on them for correctness: a kernel a worker could not compile (another
Triton's specialization format, a kernel it cannot find) is compiled by the engine's process as before, and said once
in the log.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# The modules holding the engine's Triton kernels: each worker imports them as it starts, before any kernel is asked
# for. Each holds kernels only and imports Triton, not torch: a worker that imported torch (and the codec package's
# loader) started in ~5 s on an H200 host, about a third of a fresh start's compile wait; these import in ~0.3 s.
KERNEL_MODULES = (
    "moss_rt.model.fused_layers_kernels",
    "moss_rt.model.fused_local_kernels",
    "moss_rt.model.fused_sampling_kernels",
    "moss_rt.model.paged_attention_kernels",
    "moss_rt.codec.window_attention_kernels",
    "moss_rt.codec.fused_kernels",
)


GIVE_UP_AFTER = 3  # the first this many jobs failed, none done: the workers cannot compile here; stop asking them


@dataclass(frozen=True)
class KernelJob:
    """One kernel specialization to compile: where the kernel is defined and Triton's JSON of the specialization."""

    module: str  # the kernel's module (``fn.__module__``)
    qualname: str  # its qualified name in that module
    specialization: str  # Triton's serialized specialization data (what ``JITFunction.preload`` reads)
    # The GPU to compile for (``GPUTarget``'s backend, arch, warp size): the one of the thread that met the kernel.
    # Triton 3.9 also writes it into the specialization data; Triton 3.6 does not (its ``preload`` takes the target
    # from the active driver), so the hook carries it here for both.
    target: tuple[str, int | str, int] | None = None

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]

    @property
    def key(self) -> tuple[Any, str]:
        return self.target, self.specialization


# --------------------------------------------------------------------------- in the worker processes


class TargetOnlyDriver:
    """A stand-in for Triton's active driver in a worker: the current device is 0 and the target is the engine's GPU.
    Enough to compile (and write the cache); nothing here can load or launch a kernel."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def resolve_kernel(module_name: str, qualname: str) -> Any:
    """The Triton kernel (``JITFunction``) ``qualname`` of ``module_name``: every kernel of moss_rt is a module-level
    function of a kernels-only module (KERNEL_MODULES)."""
    found: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise LookupError(f"{module_name} has no kernel {qualname}") from None
    return found


def _worker_started(modules: Sequence[str]) -> None:
    """Each worker, once: import Triton's compiler and the kernels' modules (about a second, while the engine reads
    its weights), so the first job only compiles. A Ctrl-C in the server's terminal reaches the whole process group:
    a worker leaves it to the server, which ends its workers as it stops (each printed a KeyboardInterrupt traceback
    of its idle wait before)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import triton.compiler  # noqa: F401 - the import is the point

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module that cannot load here: its kernels compile in the engine
            log.debug("compile worker: cannot import %s", name, exc_info=True)


def _ready() -> bool:
    return True


def compile_kernel(job: KernelJob) -> float:
    """In a worker: compile ``job`` into Triton's cache for the target it names; the seconds it took."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    t0 = time.perf_counter()
    target = job.target or _target_in(job.specialization)
    if target is None:
        raise LookupError(f"no GPU target for {job.qualname}: neither the job nor Triton's specialization data names "
                          "one")
    driver.set_active(TargetOnlyDriver(GPUTarget(*target)))
    resolve_kernel(job.module, job.qualname).preload(job.specialization)
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- in the engine's process


def why_unsupported() -> str | None:
    """Why this Triton cannot have its kernels compiled in worker processes (None where it can): checked before any
    process is spawned, by the features the approach uses rather than by Triton's version (3.6 and 3.9 both have
    them; older Triton has no ``knobs``)."""
    try:
        from triton import knobs
        from triton.backends.compiler import GPUTarget  # noqa: F401 - the worker names its target with it
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction
    except Exception as exc:  # noqa: BLE001 - no Triton, or one laid out otherwise
        return f"Triton's compile hook, driver or JITFunction cannot be imported ({type(exc).__name__}: {exc})"
    missing = [name for name, present in (
        ("knobs.runtime.jit_cache_hook", hasattr(getattr(knobs, "runtime", None), "jit_cache_hook")),
        ("JITFunction.preload", hasattr(JITFunction, "preload")),
        ("driver.set_active", hasattr(driver, "set_active")),
    ) if not present]
    return f"this Triton lacks {', '.join(missing)}" if missing else None


def spawn_pool(workers: int, modules: Sequence[str] = KERNEL_MODULES) -> Executor:
    """``workers`` fresh processes (spawned: never a fork of a process that holds CUDA and threads)."""
    spawn = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(workers, mp_context=spawn, initializer=_worker_started, initargs=(tuple(modules),))


class CompileWorkers:
    """Kernels compiled in worker processes for the threads of this one (see the module docstring).

    ``pool`` makes the executor (tests pass threads and a stand-in ``compile_fn``); ``start`` starts every worker at
    once (they import while the engine loads), ``install`` puts the hook in Triton, ``close`` ends the workers and
    takes the hook out (or, where another hook was put above it, leaves it doing nothing)."""

    def __init__(
        self,
        workers: int,
        *,
        pool: Callable[[int], Executor] = spawn_pool,
        compile_fn: Callable[[KernelJob], float] = compile_kernel,
    ) -> None:
        self.workers = workers
        self._make_pool = pool
        self._compile_fn = compile_fn
        self._pool: Executor | None = None
        self._lock = threading.Lock()
        # by target and specialization: two threads meeting one kernel share a job
        self._jobs: dict[tuple[Any, str], Future[float]] = {}
        self._met: dict[tuple[Any, str], KernelJob] = {}  # jobs a pass of this process met, compiled (kernel_manifest)
        self._prefetched = 0  # jobs handed over ahead, from the kernel manifests
        self._failed: list[str] = []
        self._succeeded = 0
        self._runtime: Any = None
        self._previous: Any = None
        self._closed = False

    @property
    def active(self) -> bool:
        return self._pool is not None and not self._closed

    def start(self) -> CompileWorkers:
        """Start the worker processes now (each imports Triton and the kernels' modules; a second or two)."""
        if self._pool is None and not self._closed:
            self._pool = self._make_pool(self.workers)
            for _ in range(self.workers):  # one warm-up task each: the pool starts a process per pending task
                self._pool.submit(_ready)
        return self

    def install(self) -> CompileWorkers:
        """Ask Triton to call ``hook`` before each compile of this process; no-op without Triton's knobs."""
        try:
            from triton import knobs
        except Exception:  # noqa: BLE001 - no Triton, or one without knobs: the engine compiles as before
            return self
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook"):
            return self
        self._runtime = runtime
        self._previous = runtime.jit_cache_hook
        runtime.jit_cache_hook = self.hook
        return self

    def hook(self, **kwargs: Any) -> Any:
        """Triton's ``jit_cache_hook``: compile this kernel in a worker and wait for it, then let Triton go on (it
        loads the kernel from its cache). Whatever goes wrong, Triton compiles it here, as without workers."""
        previous = self._previous
        skip = previous(**kwargs) if previous is not None else None
        if skip or not self.active:
            return skip
        job = _job_of(kwargs)
        if job is not None:
            self.compile(job)
        return skip

    def prefetch(self, jobs: Sequence[KernelJob]) -> int:
        """Hand these jobs to the workers now, without waiting (a manifest's: kernel_manifest.py); a pass meeting one
        later waits for it like for another thread's. The number handed over (those already asked for are not)."""
        handed = 0
        with self._lock:
            pool = self._pool
            if pool is None or self._closed:
                return 0
            for job in jobs:
                if job.key in self._jobs:
                    continue
                try:
                    self._jobs[job.key] = pool.submit(self._compile_fn, job)
                except RuntimeError:  # the pool is shutting down: the passes compile what they meet
                    break
                handed += 1
            self._prefetched += handed
        return handed

    def met(self) -> list[KernelJob]:
        """The jobs this process's passes met and the workers compiled, in the order met (for the next start)."""
        with self._lock:
            return list(self._met.values())

    def compile(self, job: KernelJob) -> bool:
        """Compile ``job`` in a worker (or wait for the same job another thread asked for); False where it failed."""
        with self._lock:
            pool = self._pool
            if pool is None or self._closed:
                return False
            future = self._jobs.get(job.key)
            if future is None:
                try:
                    future = pool.submit(self._compile_fn, job)
                except RuntimeError:  # the pool is shutting down (close raced this call): compile here
                    return False
                self._jobs[job.key] = future
        try:
            future.result()
        except Exception as exc:  # noqa: BLE001 - any failure: the engine's process compiles it, as before
            with self._lock:
                if self._closed:
                    return False  # closed while it waited: nothing to report
                first = job.name not in self._failed
                self._failed.append(job.name)
                # The first jobs all failing says the workers cannot compile here at all (another Triton's format,
                # no compiler): stop asking them, once, rather than once a kernel.
                give_up = self._succeeded == 0 and len(self._failed) >= GIVE_UP_AFTER
                if give_up:
                    self._closed = True
            # The very first failure comes with the worker's traceback (the pool chains it to the exception): where
            # in Triton or in the job it failed, not only what.
            trace = exc if len(self._failed) == 1 else None
            if give_up:
                log.warning("Triton kernels cannot be compiled in worker processes here (%s: %s); they compile in "
                            "the engine's process", type(exc).__name__, exc, exc_info=trace)
            elif first:
                log.warning("kernel %s could not be compiled in a worker process (%s: %s); it compiles here",
                            job.name, type(exc).__name__, exc, exc_info=trace)
            return False
        with self._lock:
            self._succeeded += 1
            self._met.setdefault(job.key, job)
        return True

    def counts(self) -> tuple[int, int, float]:
        """Kernels compiled in the workers, kernels they could not compile (compiled here), the workers' seconds."""
        with self._lock:
            futures = list(self._jobs.values())
            failed = len(self._failed)
        done = [f.result() for f in futures if f.done() and not f.cancelled() and f.exception() is None]
        return len(done), failed, sum(done)

    def summary(self) -> str:
        done, failed, seconds = self.counts()
        ahead = f" ({self._prefetched} handed over ahead from the kernel manifests)" if self._prefetched else ""
        return (f"{done} Triton kernels compiled in {self.workers} worker processes{ahead} "
                f"({seconds:.1f} s of compile time over all workers), {failed} compiled here instead")

    def close(self) -> None:
        """End the workers (a compile running in one is abandoned; its thread here compiles the kernel itself) and
        take the hook out of Triton (or leave it passing through, where another hook was put above it)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if self._runtime is not None and self._runtime.jit_cache_hook == self.hook:
            self._runtime.jit_cache_hook = self._previous
            self._runtime = None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _job_of(kwargs: dict[str, Any]) -> KernelJob | None:
    """The job for the compile Triton announces in its hook's arguments; None where they lack what a worker needs."""
    fn = kwargs.get("fn")
    compile_args = kwargs.get("compile")
    module, qualname = getattr(fn, "module", None), getattr(fn, "name", None)
    data = compile_args.get("specialization_data") if isinstance(compile_args, dict) else None
    if not (isinstance(module, str) and isinstance(qualname, str) and isinstance(data, str)):
        return None
    return KernelJob(module, qualname, data, _target_in(data) or current_target())


def _target_in(specialization: str) -> tuple[str, int | str, int] | None:
    """The GPU target Triton wrote into a kernel's specialization data (Triton 3.9 does; 3.6 does not: None)."""
    try:
        target = json.loads(specialization).get("target")
        return (target["backend"], target["arch"], target["warp_size"]) if isinstance(target, dict) else None
    except (ValueError, AttributeError, KeyError, TypeError):
        return None


def current_target() -> tuple[str, int | str, int] | None:
    """The target Triton compiles for on this thread (its active driver's: the current device's architecture), which
    the worker must name to its stand-in driver to compile the same kernel; None where it cannot be asked."""
    try:
        from triton.runtime.driver import driver

        target = driver.active.get_current_target()
        return (target.backend, target.arch, target.warp_size)
    except Exception:  # noqa: BLE001 - no target: the job fails in the worker, saying so, and compiles here
        log.debug("compile workers: no current Triton target", exc_info=True)
        return None
