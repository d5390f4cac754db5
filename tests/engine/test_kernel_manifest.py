"""The kernels a start met, written down for the next start (engine/kernel_manifest.py, issue 24): a start whose
compile workers compiled kernels records them in the data dir; a start that compiles ahead hands every recorded
kernel for its Triton and GPU to the workers at once, and a pass meeting one then waits for that job instead of
asking again. Stand-ins for Triton and the worker processes, as in test_compile_workers.py."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from moss_rt.engine import kernel_manifest
from moss_rt.engine import moss as moss_module
from moss_rt.engine.compile_workers import CompileWorkers, KernelJob
from moss_rt.engine.kernel_manifest import MANIFEST_NAME, load_jobs, manifest_paths, save_jobs
from moss_rt.engine.moss import MossEngine
from tests.engine.harness import engine_settings

H200 = ("cuda", 90, 32)
A10 = ("cuda", 86, 32)


def _job(name: str, block: int = 128, target: tuple[str, int, int] | None = H200) -> KernelJob:
    return KernelJob("moss_rt.model.kernels", name, json.dumps({"name": name, "constants": {"BLOCK": block}}), target)


def _threads(n: int) -> Executor:
    return ThreadPoolExecutor(n, thread_name_prefix="stand-in-worker")


def test_a_manifest_keeps_each_job_once_and_gives_back_those_of_this_triton_and_gpu(tmp_path: Path) -> None:
    path = tmp_path / MANIFEST_NAME
    assert save_jobs(path, [_job("norm"), _job("attend"), _job("norm", target=A10)], "3.6.0") == 3
    assert save_jobs(path, [_job("attend"), _job("rope")], "3.6.0") == 4  # added to, each job once, in order
    assert [j.name for j in load_jobs([path], "3.6.0", H200)] == ["norm", "attend", "rope"]
    assert [j.name for j in load_jobs([path], "3.6.0", A10)] == ["norm"]  # another GPU: its own kernels only
    assert load_jobs([path], "3.9.0", H200) == []  # another Triton: another specialization format
    assert load_jobs([tmp_path / "none.json"], "3.6.0", H200) == []  # no manifest yet
    assert save_jobs(path, [_job("sample")], "3.9.0") == 1  # a new Triton starts a new manifest
    assert [j.name for j in load_jobs([path], "3.9.0", H200)] == ["sample"]


def test_a_manifest_of_an_older_format_is_not_used_and_is_written_anew(tmp_path: Path) -> None:
    """Format 1 named the codec's fused kernels and the paged-attention kernels in the modules they left (built by
    factories there): its jobs would fail in a worker, so a start hands none over, and the next write replaces it."""
    path = tmp_path / MANIFEST_NAME
    old = {"module": "moss_rt.model.paged_attention", "qualname": "_kernel.<locals>._combine",
           "specialization": "{}", "target": list(H200)}
    path.write_text(json.dumps({"format": 1, "triton": "3.6.0", "jobs": [old]}))
    assert load_jobs([path], "3.6.0", H200) == []
    assert save_jobs(path, [_job("norm")], "3.6.0") == 1
    assert [j.name for j in load_jobs([path], "3.6.0", H200)] == ["norm"]


def test_an_unreadable_manifest_is_said_and_skipped_then_written_anew(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    broken, good = tmp_path / "broken.json", tmp_path / "good.json"
    broken.write_text(json.dumps({"format": kernel_manifest.FORMAT, "triton": "3.6.0", "jobs": [{"module": "m"}]}))
    save_jobs(good, [_job("norm")], "3.6.0")
    with caplog.at_level(logging.WARNING, logger="moss_rt.engine.kernel_manifest"):
        assert [j.name for j in load_jobs([broken, good], "3.6.0", H200)] == ["norm"]
    assert "broken.json cannot be read" in caplog.text
    assert save_jobs(broken, [_job("rope")], "3.6.0") == 1
    assert [j.name for j in load_jobs([broken], "3.6.0", H200)] == ["rope"]


def test_jobs_handed_over_ahead_are_waited_for_not_asked_again_and_only_met_ones_are_recorded() -> None:
    asked: list[KernelJob] = []
    release = threading.Event()

    def compile_fn(job: KernelJob) -> float:
        asked.append(job)
        release.wait(10)
        return 0.5

    workers = CompileWorkers(2, pool=_threads, compile_fn=compile_fn).start()
    ahead = [_job("norm"), _job("attend"), _job("stale")]
    assert workers.prefetch(ahead) == 3
    assert workers.prefetch(ahead[:1]) == 0  # asked for already
    met: list[bool] = []
    caller = threading.Thread(target=lambda: met.append(workers.compile(_job("norm"))))
    caller.start()
    caller.join(0.2)
    assert caller.is_alive()  # the pass waits for the job handed over ahead
    release.set()
    caller.join(10)
    assert met == [True]
    assert workers.compile(_job("rope"))  # one no manifest named: asked for when met
    assert sorted(j.name for j in asked) == ["attend", "norm", "rope", "stale"]  # "norm" compiled once
    assert [j.name for j in workers.met()] == ["norm", "rope"]  # what this start's passes met, not "stale"
    workers.close()
    assert workers.prefetch([_job("late")]) == 0


def test_a_start_hands_the_manifests_kernels_over_and_records_what_it_met(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The engine's two ends of it on the CPU: Triton's version and the GPU's target are stand-ins."""
    monkeypatch.setitem(sys.modules, "triton", SimpleNamespace(__version__="3.6.0"))
    monkeypatch.setattr(moss_module, "current_target", lambda: H200)
    shipped = tmp_path / "shipped"
    monkeypatch.setattr(kernel_manifest, "SHIPPED", shipped)
    save_jobs(shipped / "h200.json", [_job("step"), _job("norm")], "3.6.0")
    data = tmp_path / "data"
    save_jobs(data / MANIFEST_NAME, [_job("norm"), _job("attend", target=A10)], "3.6.0")
    assert manifest_paths(data) == [shipped / "h200.json", data / MANIFEST_NAME]
    asked: list[str] = []
    engine = MossEngine(engine_settings(data, overlap=False))
    engine._compile_workers = CompileWorkers(2, pool=_threads, compile_fn=lambda j: asked.append(j.name) or 0.1)
    engine._compile_workers.start()
    engine._prefetch_kernels()
    assert engine._compile_workers.compile(_job("norm"))  # met: it was handed over at the start
    assert engine._compile_workers.compile(_job("rope"))  # met: new on this start
    engine._end_compiles()
    # This GPU's jobs from the manifests (the shipped one's and the data dir's), each once; the A10's not at all.
    assert sorted(asked) == ["norm", "rope", "step"]
    assert [j.name for j in load_jobs([data / MANIFEST_NAME], "3.6.0", H200)] == ["norm", "rope"]
    assert [j.name for j in load_jobs([data / MANIFEST_NAME], "3.6.0", A10)] == ["attend"]  # kept for that GPU


def _ready_engine(tmp_path: Path, monkeypatch, asked: list[str]) -> MossEngine:  # type: ignore[no-untyped-def]
    """An engine at ready whose stand-in workers compiled the warm-up's one kernel ("step")."""
    monkeypatch.setitem(sys.modules, "triton", SimpleNamespace(__version__="3.6.0"))
    monkeypatch.setattr(kernel_manifest, "SHIPPED", tmp_path / "no-shipped")
    engine = MossEngine(engine_settings(tmp_path / "data", overlap=False))
    engine._compile_workers = CompileWorkers(2, pool=_threads, compile_fn=lambda j: asked.append(j.name) or 0.1)
    engine._compile_workers.start()
    assert engine._compile_workers.compile(_job("step"))
    return engine


def _recorded(tmp_path: Path) -> list[str]:
    return [j.name for j in load_jobs([tmp_path / "data" / MANIFEST_NAME], "3.6.0", H200)]


def test_the_workers_stay_after_ready_for_the_idle_captures_whose_kernels_are_recorded_too(
    tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """At ready the kernels met so far are written down, and the workers stay: a kernel an idle-time capture meets
    after ready (on a fresh H200, a step capture at a new batch size: 953 ms compiling in the engine's process) is
    compiled in them, and written down once every graph is captured, so the next fresh start compiles it ahead."""
    asked: list[str] = []
    engine = _ready_engine(tmp_path, monkeypatch, asked)
    engine._end_compiles(keep_workers=True)  # the warm-up's end
    workers = engine._compile_workers
    assert workers is not None and workers.active
    assert _recorded(tmp_path) == ["step"]
    assert engine._workers_retire_at is not None
    assert engine._workers_retire_at - time.monotonic() > moss_module.COMPILE_WORKERS_AFTER_READY_S - 60
    assert workers.compile(_job("step", block=64))  # an idle capture's new specialization, in the workers
    engine._graphs_done, engine._codec_worker = False, SimpleNamespace(drain=lambda: None)
    engine._runner = SimpleNamespace(capture_next=lambda: False, pending_graphs=list, pending_prefill_graphs=list)
    engine._batcher = None
    assert not engine._capture_idle()  # nothing left to capture: every graph is done
    assert engine._compile_workers is None and not workers.active and engine._workers_retire_at is None
    assert _recorded(tmp_path) == ["step", "step"]  # both specializations, each once
    assert asked == ["step", "step"]


def test_workers_kept_after_ready_end_by_their_deadline_or_with_the_engine(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Idle captures that never finish (a server busy from ready on) do not keep the workers for ever: they end at
    their deadline, recording what they compiled; an engine shutting down ends them the same way."""
    asked: list[str] = []
    engine = _ready_engine(tmp_path, monkeypatch, asked)
    engine._end_compiles(keep_workers=True)
    assert engine._compile_workers is not None
    engine._compile_workers.compile(_job("late"))
    engine._workers_retire_at = time.monotonic() - 1.0  # its time is up: the serving loop's next round ends it
    engine._graphs_done, engine._codec_worker = True, SimpleNamespace(drain=lambda: None)  # (not the captures' end)
    # One round of the serving loop (the round stops the loop once it ran).
    engine._scheduler = SimpleNamespace(idle=True, iterate=lambda: engine._stop.set(), running=[], has_paused=False,
                                        add=None, preparing=[])
    engine._serve()
    assert engine._compile_workers is None and _recorded(tmp_path) == ["step", "late"]

    engine = _ready_engine(tmp_path, monkeypatch, asked)
    engine._end_compiles(keep_workers=True)
    assert engine._compile_workers is not None
    engine._compile_workers.compile(_job("at-shutdown"))
    engine._end_compiles()  # the engine's shutdown
    assert engine._compile_workers is None and _recorded(tmp_path) == ["step", "late", "at-shutdown"]


def test_the_shipped_manifest_names_the_h200s_kernels_for_its_triton() -> None:
    """The manifest recorded on an H200 (bench/RESULTS.md, session 14) ships with the package and is read as the
    start reads it: jobs of moss_rt's own kernels for that GPU and Triton version, none for another GPU."""
    shipped = manifest_paths(Path("no-data-dir"))[:-1]
    assert [p.name for p in shipped] == ["h200-triton3.6.json"]
    jobs = load_jobs(shipped, "3.6.0", H200)
    assert len(jobs) >= 40 and all(j.module.startswith("moss_rt.") for j in jobs)
    assert load_jobs(shipped, "3.6.0", A10) == [] and load_jobs(shipped, "3.7.0", H200) == []


def test_no_compile_workers_no_manifest(tmp_path: Path) -> None:
    engine = MossEngine(engine_settings(tmp_path / "data", overlap=False))
    assert engine._compile_workers is None
    engine._prefetch_kernels()  # a CPU start, or one with nothing to compile: nothing to hand over
    engine._end_compiles()
    assert not (tmp_path / "data" / MANIFEST_NAME).exists()


@pytest.mark.slow
def test_a_recorded_kernel_is_compiled_by_the_next_start_before_any_pass_meets_it(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With Triton's own compiler (no GPU: a stand-in driver names an H200): a start's worker compiles a moss_rt kernel
    a pass met and the start writes it down; the next start, its Triton cache emptied, hands it over from the manifest
    at once, and its pass then meets a kernel that is compiled already (no second job)."""
    triton = pytest.importorskip("triton")
    torch = pytest.importorskip("torch")
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from moss_rt.engine.compile_workers import TargetOnlyDriver, current_target
    from moss_rt.model.fused_layers_kernels import silu_mul

    cache, manifest = tmp_path / "triton-cache", tmp_path / "data" / MANIFEST_NAME
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))  # the workers inherit it, as the engine's do
    saved = driver._active
    driver.set_active(TargetOnlyDriver(GPUTarget("cuda", 90, 32)))

    def a_pass() -> None:  # a pass meeting the kernel, as a chain's would
        silu_mul.warmup(torch.bfloat16, torch.bfloat16, 8, 8, 64, BLOCK=32, ACCURATE=True, grid=(1,))

    try:
        first = CompileWorkers(1).start().install()
        try:
            a_pass()
            save_jobs(manifest, first.met(), triton.__version__)
        finally:
            first.close()
        assert len(list(cache.glob("*/silu_mul.json"))) == 1
        for kernel in cache.iterdir():  # a new machine's cache
            for f in kernel.iterdir():
                f.unlink()
            kernel.rmdir()
        silu_mul.device_caches.clear()  # and a new process's: nothing compiled in memory either
        second = CompileWorkers(1).start().install()
        try:
            jobs = load_jobs([manifest], triton.__version__, current_target())
            assert [j.name for j in jobs] == ["silu_mul"]
            assert second.prefetch(jobs) == 1
            for future in list(second._jobs.values()):
                future.result(timeout=120)
            assert len(list(cache.glob("*/silu_mul.json"))) == 1  # compiled before any pass met it
            a_pass()
            assert [j.name for j in second.met()] == ["silu_mul"]  # the pass met it (an empty in-memory cache)...
            assert second.counts()[0] == 1  # ...and waited for the job handed over: the same key, no second job
        finally:
            second.close()
    finally:
        driver._active = saved
        silu_mul.device_caches.clear()  # other tests meet the kernel as a new process would


def test_the_shipped_window_attention_jobs_carry_the_launch_options_it_uses_now() -> None:
    """A kernel's specialization holds its launch options, so a change of them (registers, pipeline stages) leaves
    the shipped jobs naming kernels no start meets: they compile when met instead of ahead (session 35: 4 s more on
    a fresh H200 start). The window kernel's 16-bit jobs must carry the register cap and the stages tiles_for gives
    (every tile it chooses has the same), fp8 and fp32 ones the compiler's registers."""
    from moss_rt.codec import window_attention as wa

    stages = {wa.tiles_for(tq, block).num_stages for tq in (1, 8, 16, 32, 64, 128, 256) for block in (8, 64, 256)}
    assert len(stages) == 1
    jobs = [j for j in load_jobs(manifest_paths(Path("no-data-dir"))[:-1], "3.6.0", H200) if j.name == "_attend"]
    assert jobs
    for job in jobs:
        spec = json.loads(job.specialization)
        cap = wa.MAX_REGISTERS if spec["signature"]["K"] in ("*bf16", "*fp16") else None
        assert spec["options"].get("maxnreg") == cap, spec["options"]
        n = spec["options"]["num_stages"]
        assert n in stages and f"'num_stages': {n}" in spec["key"]
        assert (f"'maxnreg': {cap}" in spec["key"]) == (cap is not None)
