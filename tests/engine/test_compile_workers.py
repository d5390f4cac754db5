"""Kernels compiled in worker processes (engine/compile_workers.py, issue 24): Triton's pre-compile hook hands each
kernel the engine's threads meet to a worker and waits; Triton then loads it from its cache. Here the orchestration
runs with stand-ins (threads for processes, a recording compile function for Triton's), and, marked slow, one real
round trip: a spawned worker compiles a moss_rt kernel for an H200 and this process finds it in the cache."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from moss_rt.engine.compile_workers import (
    GIVE_UP_AFTER,
    CompileWorkers,
    KernelJob,
    resolve_kernel,
    why_unsupported,
)


def _threads(n: int) -> Executor:
    return ThreadPoolExecutor(n, thread_name_prefix="stand-in-worker")


def _announce(workers: CompileWorkers, module: str, qualname: str, spec: dict[str, Any]) -> Any:
    """What Triton does before compiling a kernel: call its hook with the kernel and its specialization."""
    return workers.hook(fn=SimpleNamespace(module=module, name=qualname, jit_function=None),
                        compile={"specialization_data": json.dumps(spec)}, key=repr(spec))


@pytest.fixture
def recorded() -> Iterator[tuple[list[KernelJob], threading.Event]]:
    jobs: list[KernelJob] = []
    release = threading.Event()
    release.set()
    yield jobs, release
    release.set()


def _recording(jobs: list[KernelJob], release: threading.Event, fail: bool = False) -> Callable[[KernelJob], float]:
    def compile_fn(job: KernelJob) -> float:
        jobs.append(job)
        release.wait(10)
        if fail:
            raise RuntimeError("no ptxas here")
        return 0.5

    return compile_fn


def test_each_kernel_announced_is_compiled_once_by_a_worker_while_its_callers_wait(recorded) -> None:  # type: ignore[no-untyped-def]
    jobs, release = recorded
    workers = CompileWorkers(2, pool=_threads, compile_fn=_recording(jobs, release)).start()
    release.clear()
    spec = {"name": "silu_mul", "constants": {"BLOCK": 128}}
    answers: list[Any] = []
    callers = [threading.Thread(target=lambda: answers.append(_announce(workers, "m", "silu_mul", spec)))
               for _ in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(0.2)
    assert all(t.is_alive() for t in callers)  # both wait for the one compile of that specialization
    release.set()
    for t in callers:
        t.join(10)
    assert answers == [None, None]  # falsy: Triton goes on, and loads the kernel from its cache
    _announce(workers, "m", "silu_mul", {**spec, "constants": {"BLOCK": 256}})
    assert [json.loads(j.specialization)["constants"]["BLOCK"] for j in jobs] == [128, 256]
    assert jobs[0].module == "m" and jobs[0].name == "silu_mul"
    assert workers.summary().startswith("2 Triton kernels compiled in 2 worker processes (1.0 s")
    workers.close()
    _announce(workers, "m", "silu_mul", {**spec, "constants": {"BLOCK": 512}})  # closed: Triton compiles it itself
    assert len(jobs) == 2


def test_a_kernel_a_worker_cannot_compile_compiles_here_and_repeated_failures_stop_asking(recorded, caplog) -> None:  # type: ignore[no-untyped-def]
    jobs, release = recorded
    workers = CompileWorkers(2, pool=_threads, compile_fn=_recording(jobs, release, fail=True)).start()
    assert workers.compile(KernelJob("m", "k", '{"n": 0}')) is False
    for n in range(1, GIVE_UP_AFTER + 2):
        assert _announce(workers, "m", "k", {"n": n}) is None  # Triton compiles it here: the start goes on
    assert len(jobs) == GIVE_UP_AFTER  # after that many failures and no success, the workers are no longer asked
    assert not workers.active
    said = [r for r in caplog.records if "could not be compiled in a worker" in r.message]
    assert len(said) == 1  # said once a kernel, with why: the exception's text, and the worker's traceback
    assert "RuntimeError: no ptxas here" in said[0].getMessage() and said[0].exc_info is not None
    assert sum("cannot be compiled in worker processes here" in r.message for r in caplog.records) == 1
    workers.close()


def test_each_job_names_the_gpu_target_of_the_thread_that_met_the_kernel(recorded) -> None:  # type: ignore[no-untyped-def]
    """Triton 3.6's specialization data names no target (3.9's does): the worker must still compile for the GPU the
    engine's thread compiles for, so the hook asks the active driver there."""
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from moss_rt.engine.compile_workers import TargetOnlyDriver

    jobs, release = recorded
    workers = CompileWorkers(1, pool=_threads, compile_fn=_recording(jobs, release)).start()
    saved = driver._active
    driver.set_active(TargetOnlyDriver(GPUTarget("cuda", 90, 32)))
    try:
        _announce(workers, "m", "k", {"name": "m.k"})  # as Triton 3.6 writes it
        _announce(workers, "m", "k", {"name": "m.k", "target": {"backend": "cuda", "arch": 100, "warp_size": 32}})
    finally:
        driver._active = saved
        workers.close()
    assert [job.target for job in jobs] == [("cuda", 90, 32), ("cuda", 100, 32)]


def test_a_triton_without_the_features_used_is_told_before_any_process_starts(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    assert why_unsupported() is None  # the Triton installed here (3.9 in the dev venv; 3.6 on the GPU host) has them
    monkeypatch.delattr(JITFunction, "preload")
    assert why_unsupported() == "this Triton lacks JITFunction.preload"


def test_the_hook_keeps_others_hooks_and_gives_tritons_back() -> None:
    knobs = pytest.importorskip("triton").knobs
    before = knobs.runtime.jit_cache_hook
    seen: list[str] = []
    jobs: list[KernelJob] = []
    try:
        knobs.runtime.jit_cache_hook = lambda **kw: seen.append("theirs")  # someone else's hook: still called first
        theirs = knobs.runtime.jit_cache_hook
        workers = CompileWorkers(1, pool=_threads, compile_fn=lambda job: jobs.append(job) or 0.1).start().install()
        assert knobs.runtime.jit_cache_hook == workers.hook
        assert not knobs.runtime.jit_cache_hook(fn=SimpleNamespace(module="m", name="k"),
                                                compile={"specialization_data": "{}"})
        assert seen == ["theirs"] and len(jobs) == 1
        workers.close()
        assert knobs.runtime.jit_cache_hook is theirs
        # Another hook put above ours (the start's compile log): closing leaves ours in place, passing through.
        workers = CompileWorkers(1, pool=_threads, compile_fn=lambda job: jobs.append(job) or 0.1).start().install()
        mine = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = lambda **kw: mine(**kw)
        workers.close()
        knobs.runtime.jit_cache_hook(fn=SimpleNamespace(module="m", name="k"), compile={"specialization_data": "[]"})
        assert seen == ["theirs", "theirs"] and len(jobs) == 1
    finally:
        knobs.runtime.jit_cache_hook = before


def test_a_worker_finds_each_kernel_by_its_module_and_name() -> None:
    pytest.importorskip("triton")
    from moss_rt.model import fused_layers_kernels, paged_attention

    assert resolve_kernel("moss_rt.model.fused_layers_kernels", "silu_mul") is fused_layers_kernels.silu_mul
    decode, combine = paged_attention._kernel()  # the wrapper's kernels are the kernels module's
    assert resolve_kernel(decode.fn.__module__, decode.fn.__qualname__) is decode
    assert resolve_kernel(combine.fn.__module__, combine.fn.__qualname__) is combine
    with pytest.raises(LookupError):
        resolve_kernel("moss_rt.model.paged_attention_kernels", "_missing")


WORKER_START = """
import json, signal, sys, time
t0 = time.perf_counter()
from moss_rt.engine.compile_workers import KERNEL_MODULES, _worker_started, resolve_kernel
from moss_rt.engine.kernel_manifest import manifest_paths
_worker_started(KERNEL_MODULES)
names = []
for path in manifest_paths(__import__("pathlib").Path("no-data-dir"))[:-1]:
    for job in json.loads(path.read_text())["jobs"]:
        kernel = resolve_kernel(job["module"], job["qualname"])
        names.append((json.loads(job["specialization"])["name"], f"{kernel.fn.__module__}.{kernel.fn.__qualname__}"))
print(json.dumps({"torch": "torch" in sys.modules, "names": names, "seconds": time.perf_counter() - t0,
                  "ctrl_c_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN}))
"""


def test_a_compile_worker_starts_without_torch_and_finds_every_shipped_kernel() -> None:
    """What a worker imports as it starts (its kernels' modules) and to compile a shipped manifest's jobs holds no
    torch: on an H200 host a worker that imported torch started in ~5 s, a third of a fresh start's compile wait.
    Each job's kernel is found under the name its specialization carries (Triton's preload checks it). A Ctrl-C in the
    server's terminal is left to the server (which ends its workers), not met by each worker with a traceback."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", WORKER_START], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["torch"] is False and result["ctrl_c_ignored"] is True
    assert len(result["names"]) >= 40
    for wanted, found in result["names"]:
        assert wanted == found


@pytest.mark.slow
def test_a_kernel_compiled_in_a_spawned_worker_is_loaded_from_the_cache_here(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """No GPU needed: the worker compiles for an H200 (sm_90) with Triton's own compiler and ptxas, and this process,
    asking Triton for the same kernel with the same stand-in target, finds it in the cache instead of compiling."""
    pytest.importorskip("triton")
    torch = pytest.importorskip("torch")
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from moss_rt.engine.compile_workers import TargetOnlyDriver
    from moss_rt.model.fused_layers_kernels import silu_mul

    cache = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))  # the workers inherit it, as the engine's do

    def kernel_dirs() -> set[str]:
        return {p.parent.name for p in cache.glob("*/silu_mul.json")}

    saved = driver._active
    driver.set_active(TargetOnlyDriver(GPUTarget("cuda", 90, 32)))
    workers = CompileWorkers(1)
    try:
        workers.start().install()
        compiled = silu_mul.warmup(torch.bfloat16, torch.bfloat16, 8, 8, 64, BLOCK=64, ACCURATE=True, grid=(1,))
        assert compiled is not None and workers.summary().startswith("1 Triton kernels compiled"), workers.summary()
        # One kernel in the cache: had this process's key differed from the worker's, it would have compiled a
        # second one beside it.
        assert len(kernel_dirs()) == 1, kernel_dirs()
    finally:
        workers.close()
        driver._active = saved
