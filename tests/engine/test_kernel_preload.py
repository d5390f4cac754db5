"""An earlier start's kernels loaded from Triton's cache on a thread beside the load (engine/kernel_preload.py,
issue 24): only where this Triton cache holds a start's marker, only this machine's manifest (the data dir's), joined
before the first capture and at the engine's end. Stand-ins for Triton's preload, then, marked slow, Triton's own:
a kernel preloaded from the cache is the one a pass's first call finds in memory (no compile, no load when met)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moss_rt.engine import kernel_manifest
from moss_rt.engine import moss as moss_module
from moss_rt.engine.compile_workers import KernelJob
from moss_rt.engine.kernel_manifest import MANIFEST_NAME, save_jobs
from moss_rt.engine.kernel_preload import KernelPreload, PreloadCounts
from moss_rt.engine.moss import MossEngine
from tests.engine.harness import engine_settings

H200 = ("cuda", 90, 32)
A10 = ("cuda", 86, 32)


def _job(name: str, target: tuple[str, int, int] | None = H200) -> KernelJob:
    return KernelJob("moss_rt.model.kernels", name, json.dumps({"name": name}), target)


def test_the_jobs_are_preloaded_in_order_on_a_thread_of_their_own_and_a_failure_is_counted_not_raised() -> None:
    seen: list[tuple[str, str]] = []
    caller = threading.current_thread().name

    def preload(job: KernelJob) -> None:
        seen.append((job.name, threading.current_thread().name))
        if job.name == "gone":
            raise LookupError("no kernel gone")

    preload_run = KernelPreload([_job("norm"), _job("gone"), _job("attend")], torch.device("cpu"), preload=preload)
    assert preload_run.wait() == PreloadCounts(0, 0, 0.0)  # not started: nothing to wait for
    counts = preload_run.start().wait()
    assert [name for name, _ in seen] == ["norm", "gone", "attend"]
    assert {thread for _, thread in seen} == {"moss-rt-kernel-preload"} and caller != "moss-rt-kernel-preload"
    assert (counts.loaded, counts.failed) == (2, 1) and counts.seconds >= 0.0
    assert preload_run.wait() == counts  # waited for again: the same counts


class _RecordingPreload:
    """Stands in for KernelPreload in the engine: records what it was given; its thread is the caller's."""

    made: list[_RecordingPreload] = []

    def __init__(self, jobs: list[KernelJob], device: torch.device) -> None:
        self.jobs, self.device, self.waited = jobs, device, 0
        _RecordingPreload.made.append(self)

    def start(self) -> _RecordingPreload:
        return self

    def wait(self) -> PreloadCounts:
        self.waited += 1
        return PreloadCounts(len(self.jobs), 0, 0.25)


@pytest.fixture
def recording(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Triton 3.6 on an H200 (stand-ins), a shipped manifest and the data dir's, and KernelPreload recorded."""
    monkeypatch.setitem(sys.modules, "triton", SimpleNamespace(__version__="3.6.0"))
    monkeypatch.setattr(moss_module, "current_target", lambda: H200)
    monkeypatch.setattr(moss_module, "KernelPreload", _RecordingPreload)
    monkeypatch.setattr(_RecordingPreload, "made", [])
    shipped = tmp_path / "shipped"
    monkeypatch.setattr(kernel_manifest, "SHIPPED", shipped)
    save_jobs(shipped / "h200.json", [_job("shipped-only"), _job("norm")], "3.6.0")
    data = tmp_path / "data"
    save_jobs(data / MANIFEST_NAME, [_job("norm"), _job("attend", target=A10), _job("step")], "3.6.0")
    return data


def test_a_start_on_a_cache_an_earlier_start_compiled_into_preloads_this_machines_kernels(  # type: ignore[no-untyped-def]
    recording: Path, monkeypatch
) -> None:
    """The data dir's manifest, this GPU's jobs, in the order met; the shipped manifest's are not (they may never have
    been compiled into this cache: a preload would compile them on the engine's time). The engine's end joins it."""
    monkeypatch.setattr(moss_module, "earlier_ahead_compiles", lambda: True)
    engine = MossEngine(engine_settings(recording, overlap=False))
    engine._start_kernel_preload(torch.device("cuda", 0))
    (made,) = _RecordingPreload.made
    assert [j.name for j in made.jobs] == ["norm", "step"] and made.device == torch.device("cuda", 0)
    engine._end_compiles()  # a start that failed, or the engine's shutdown: the thread is waited for
    assert made.waited == 1 and engine._kernel_preload is None
    assert engine.kernel_preload_counts == PreloadCounts(2, 0, 0.25)
    engine._end_compiles()
    assert made.waited == 1  # once


def test_no_preload_without_a_marker_on_the_cpu_or_without_a_manifest(recording: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A fresh cache (no start compiled into it: the workers compile, the manifest goes to them), a CPU engine
    (nothing compiles), or no manifest yet: no thread."""
    marker = {"there": False}
    monkeypatch.setattr(moss_module, "earlier_ahead_compiles", lambda: marker["there"])
    engine = MossEngine(engine_settings(recording, overlap=False))
    engine._start_kernel_preload(torch.device("cuda", 0))
    marker["there"] = True
    engine._start_kernel_preload(torch.device("cpu"))
    (recording / MANIFEST_NAME).unlink()
    engine._start_kernel_preload(torch.device("cuda", 0))
    assert _RecordingPreload.made == [] and engine._kernel_preload is None
    engine._end_compiles()
    assert engine.kernel_preload_counts is None


@pytest.mark.slow
def test_a_kernel_preloaded_from_the_cache_is_the_one_a_pass_finds_in_memory(  # type: ignore[no-untyped-def]
    tmp_path: Path, monkeypatch
) -> None:
    """With Triton's own compiler (no GPU: a stand-in driver names an H200): a pass compiles a moss_rt kernel into the
    cache and its job is recorded; in a "new process" (the kernel's in-memory cache emptied) the preload loads it
    from the disk cache without compiling, and a pass then meets no compile or load at all: the preload put the kernel
    under the key the pass looks up."""
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from moss_rt.engine.compile_workers import TargetOnlyDriver, _job_of
    from moss_rt.engine.warm_compile import TritonCompileLog
    from moss_rt.model.fused_layers_kernels import silu_mul

    knobs = pytest.importorskip("triton.knobs")
    cache = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    saved, saved_hook = driver._active, knobs.runtime.jit_cache_hook
    driver.set_active(TargetOnlyDriver(GPUTarget("cuda", 90, 32)))
    jobs: list[KernelJob] = []

    def record(**kwargs: object) -> bool:  # Triton's hook before a compile: what a compile worker would be handed
        job = _job_of(kwargs)
        assert job is not None
        jobs.append(job)
        return False  # then Triton compiles it here, into the cache

    def a_pass() -> None:
        silu_mul.warmup(torch.bfloat16, torch.bfloat16, 8, 8, 64, BLOCK=32, ACCURATE=True, grid=(1,))

    try:
        silu_mul.device_caches.clear()
        knobs.runtime.jit_cache_hook = record
        a_pass()
        knobs.runtime.jit_cache_hook = saved_hook
        assert [j.name for j in jobs] == ["silu_mul"] and len(list(cache.glob("*/silu_mul.json"))) == 1
        binaries = {p: p.stat().st_mtime_ns for p in cache.glob("*/*.cubin")}
        silu_mul.device_caches.clear()  # a new process: nothing in memory
        log = TritonCompileLog().install()
        try:
            counts = KernelPreload(jobs, torch.device("cpu")).start().wait()
            assert (counts.loaded, counts.failed) == (1, 0)
            assert len(log.compiles) == 1  # the preload's load from the cache...
            assert {p: p.stat().st_mtime_ns for p in cache.glob("*/*.cubin")} == binaries  # ...not a new compile
            a_pass()
            assert len(log.compiles) == 1  # the pass found the kernel in memory: nothing compiled or loaded
        finally:
            log.remove()
    finally:
        driver._active = saved
        knobs.runtime.jit_cache_hook = saved_hook
        silu_mul.device_caches.clear()  # other tests meet the kernel as a new process would
