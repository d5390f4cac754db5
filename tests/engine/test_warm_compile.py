"""The engine's start (issue 24) on the CPU: kernels compiled ahead on threads (engine/warm_compile.py) change no take,
and every phase of the start is timed in the log and in /metrics (engine/startup.py), which bench/engine_bench.py
prints. On the CPU nothing compiles, but with ``compile_threads`` set the same chains of eager passes run, on threads,
beside the weights' read: what a CUDA start runs, minus Triton."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from moss_rt.config import Settings
from moss_rt.engine import moss as moss_module
from moss_rt.engine.moss import IDLE_CAPTURE_QUIET_S, lone_take_keys
from moss_rt.engine.resolve import Placement
from moss_rt.engine.warm_compile import AheadCompiles, TritonCompileLog
from tests.engine.harness import drive, engine_settings, loaded_engine, spec
from tests.engine.helpers import metrics
from tests.helpers import run

CHAINS = (
    "compile: codec, chunks of 1 frame(s)", "compile: codec, chunks of 8 frame(s)", "compile: codec, odd chunk lengths",
    "compile: step of one take", "compile: prefill from position 0", "compile: prefill after a prefix",
    "compile: steps over longer keys", "compile: batched prefill passes",
)
PHASES = (
    "model opened (source, config, tokenizer, memory)", "codec loaded", "memory plan", "model weights read",
    "model runner (slot state, KV pool)", "codec graphs captured", "prefill passes sized",
)


def test_compiling_ahead_on_threads_runs_every_chain_and_changes_no_take(tiny_data_dir: Path) -> None:
    specs = [spec("a", 1, 19, 8), spec("b", 2, 13, 5, text="Another line, said slowly.")]
    heard: dict[int, dict[str, tuple[np.ndarray, bytes]]] = {}
    phases: dict[int, dict[str, float]] = {}
    for threads in (1, 4):
        settings = engine_settings(tiny_data_dir, overlap=True, compile_threads=threads, max_seq_len=600)
        with loaded_engine(settings) as engine:
            phases[threads] = dict(engine.startup.phases)
            assert engine._compiles is None  # every compile thread ended before the captures
            driven = drive(engine, specs)
            heard[threads] = {k: (c.codes, c.pcm) for k, c in driven.channels.items()}
            for ch in driven.channels.values():
                assert not ch.problems, ch.problems
            sample = engine.metrics.registry.get_sample_value
            assert sample("moss_rt_startup_seconds", {"phase": "model weights read"}) is not None
    assert set(CHAINS) <= set(phases[4]), sorted(phases[4])
    assert not any(p.startswith("compile:") for p in phases[1])  # one thread: nothing ahead, as before
    for threads in (1, 4):
        assert set(PHASES) <= set(phases[threads])
    for take_id, (codes, pcm) in heard[1].items():
        np.testing.assert_array_equal(heard[4][take_id][0], codes)
        assert heard[4][take_id][1] == pcm


def test_a_failed_chain_is_reported_and_the_others_still_count() -> None:
    compiles = AheadCompiles(torch.device("cpu"), threads=2)
    done: list[str] = []

    def boom() -> None:
        raise RuntimeError("no compiler")

    compiles.add([("broken", [boom]), ("fine", [lambda: done.append("x")])])
    seconds = compiles.wait()
    compiles.close()
    assert set(seconds) == {"fine"} and done == ["x"]
    assert not AheadCompiles(torch.device("cpu"), threads=1).enabled


def test_the_compile_log_counts_through_tritons_hooks_and_gives_them_back() -> None:
    try:
        from triton import knobs
    except Exception:  # noqa: BLE001 - a Triton without knobs: the log counts nothing, and says so
        assert TritonCompileLog().install().summary() == "no Triton compile"
        return
    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    seen: list[str] = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append("pre")  # someone else's hook: still called
    try:
        tally = TritonCompileLog().install()
        fn = type("Info", (), {"name": "draw"})()
        assert not knobs.runtime.jit_cache_hook(key=1, fn=fn)  # falsy: Triton goes on compiling
        knobs.runtime.jit_post_compile_hook(key=1, fn=fn)
        mark = tally.mark()
        knobs.runtime.jit_cache_hook(key=2, fn=fn)
        knobs.runtime.jit_post_compile_hook(key=2, fn=fn)
        tally.remove()
        assert seen == ["pre", "pre"] and [n for n, _ in tally.compiles] == ["draw", "draw"]
        assert "2 Triton kernels" in tally.summary(mark) and "in the captures: 1" in tally.summary(mark)
        assert knobs.runtime.jit_post_compile_hook is before[1]
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before


def test_the_server_shows_its_start_in_metrics(moss_server) -> None:  # type: ignore[no-untyped-def]
    srv = moss_server(max_slots=2, max_queue=2)
    figures = run(metrics(srv))
    for phase in ("engine", "ready", "model weights read", "codec loaded"):
        assert figures[f'moss_rt_startup_seconds{{phase="{phase}"}}'] >= 0.0, phase
    assert figures['moss_rt_startup_seconds{phase="ready"}'] >= figures['moss_rt_startup_seconds{phase="engine"}']


def test_on_cuda_triton_keeps_its_kernels_in_the_data_dir_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = moss_module.MossEngine(Settings(data_dir=tmp_path / "data", device="cpu"))

    def on(device: str) -> Callable[[Settings], Placement]:
        return lambda settings: Placement(torch.device(device), torch.float32)

    monkeypatch.setenv("TRITON_CACHE_DIR", "recorded")  # so the teardown restores whatever was there before
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setattr(moss_module, "placement", on("cpu"))
    engine._use_kernel_cache()
    assert "TRITON_CACHE_DIR" not in os.environ  # nothing compiles on a CPU: the environment is left alone
    monkeypatch.setattr(moss_module, "placement", on("cuda"))
    engine._use_kernel_cache()
    folder = tmp_path / "data" / "triton-cache"
    assert os.environ["TRITON_CACHE_DIR"] == str(folder.resolve()) and folder.is_dir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    engine._use_kernel_cache()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")  # the user's choice wins


def test_the_ahead_marker_lives_in_the_kernel_cache_and_names_the_setup(tmp_path, monkeypatch) -> None:
    """A start that compiled every kernel ahead leaves a file in the Triton cache in use, named by its setup (versions,
    device, model, codec, plan): the same setup finds it (and skips the ahead compiles), another one or a cleared
    cache does not. None without CUDA: nothing compiles there."""
    import torch

    from moss_rt.engine.warm_compile import ahead_marker

    setup = {"device": "NVIDIA H200", "model": "cfg", "slots": 212, "seq_len": 1024}
    assert ahead_marker(setup) is None or torch.cuda.is_available()
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    marker = ahead_marker(setup)
    assert marker is not None and marker.parent == tmp_path / "cache" and marker.name.startswith("moss_rt-compiled-")
    assert ahead_marker(dict(setup)) == marker
    assert ahead_marker({**setup, "slots": 213}) != marker
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "other"))
    assert ahead_marker(setup) == tmp_path / "other" / marker.name


def test_compile_workers_wait_for_the_plan_where_an_earlier_start_compiled_into_the_cache(
    tiny_data_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A second start on a machine (a marker in the Triton cache) spawns no compile workers with its load: once its
    plan is made, its own marker says whether it needs them, and only then are they started. A first start spawns
    them at once, as before. (The CUDA parts stand in: the device, and workers that are threads.)"""
    from moss_rt.engine import warm_compile
    from moss_rt.engine.compile_workers import CompileWorkers

    pytest.importorskip("triton")  # the markers name its version
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(warm_compile.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(moss_module, "why_unsupported", lambda: None)
    started: list[CompileWorkers] = []

    def workers(n: int) -> CompileWorkers:
        from concurrent.futures import ThreadPoolExecutor

        started.append(CompileWorkers(n, pool=ThreadPoolExecutor, compile_fn=lambda job: 0.0))
        return started[-1]

    monkeypatch.setattr(moss_module, "CompileWorkers", workers)
    cuda = torch.device("cuda")
    engine = moss_module.MossEngine(engine_settings(tiny_data_dir, overlap=False, compile_threads=0))
    monkeypatch.setattr(moss_module, "compile_threads", lambda setting, device: 4)
    try:
        engine._start_compile_workers(cuda)  # a first start: no marker anywhere
        assert len(started) == 1 and not engine._workers_deferred
        engine._end_compiles()
        marker = warm_compile.ahead_marker({"slots": 8})
        assert marker is not None
        marker.parent.mkdir(parents=True)
        marker.touch()  # an earlier start compiled every kernel of its plan
        engine._start_compile_workers(cuda)
        assert len(started) == 1 and engine._workers_deferred and engine._compile_workers is None
        engine._start_compile_workers(cuda, after_plan=True)  # this plan's marker was not there: now
        assert len(started) == 2 and not engine._workers_deferred and engine._compile_workers is not None
    finally:
        engine._end_compiles()


def test_odd_chunk_lengths_compile_at_the_smallest_and_the_largest_call() -> None:
    """A burst's takes joining mid-cycle send odd-length chunks together in one large eager call, whose window attention
    runs other kernels (no key splits) than a small bucket's: both are compiled before ready."""
    from types import SimpleNamespace

    from moss_rt.engine.warm_compile import codec_chains

    compiled: list[tuple[int, int]] = []
    main = [(b, t) for b in (2, 4, 8, 16, 32, 48, 64, 66) for t in (1, 8)]
    odd = [(b, t) for b in (2, 4, 8, 16) for t in range(2, 8)]
    batcher = SimpleNamespace(
        ahead_shapes=lambda: (main, odd), max_batch=64, decoder=SimpleNamespace(max_streams=130),
        compile_shape=lambda b, t: compiled.append((b, t)),
    )
    chains = dict(codec_chains(batcher))  # type: ignore[arg-type]
    for job in chains["codec, odd chunk lengths"]:
        job()
    assert compiled == [(2, t) for t in range(2, 8)] + [(64, t) for t in range(2, 8)]
    compiled.clear()
    for job in chains["codec, chunks of 8 frame(s)"]:
        job()
    assert compiled == [(b, 8) for b in (2, 4, 8, 16, 32, 48, 64, 66)]
    # A decoder of few streams: its largest call is its smallest bucket's neighbour, never past its streams.
    compiled.clear()
    small = SimpleNamespace(ahead_shapes=lambda: ([], [(2, 3)]), max_batch=4, decoder=SimpleNamespace(max_streams=3),
                            compile_shape=lambda b, t: compiled.append((b, t)))
    for job in dict(codec_chains(small))["codec, odd chunk lengths"]:  # type: ignore[arg-type]
        job()
    assert compiled == [(2, 3), (3, 3)]


def test_the_warm_up_converts_first_chunks_to_pcm_as_takes_do(tiny_data_dir: Path, monkeypatch) -> None:
    """Before ready, the codec's first chunks go through the int16 PCM conversion the scheduler's calls end with, mono
    and stereo (on CUDA its kernels load on first launch: the first take after ready paid for them)."""
    from moss_rt.engine.codec_batch import CodecBatcher

    seen: list[tuple[int, list[int]]] = []
    real = CodecBatcher.decode_pcm

    def recording(self, states, chunks, channels):  # type: ignore[no-untyped-def]
        seen.append((int(chunks[0].shape[0]), list(channels)))
        return real(self, states, chunks, channels)

    monkeypatch.setattr(CodecBatcher, "decode_pcm", recording)
    with loaded_engine(engine_settings(tiny_data_dir, overlap=True)):
        assert seen == [(1, [1]), (8, [1, 2])]


def test_a_lone_takes_step_graphs_up_to_a_line_and_its_frames_are_captured_before_ready() -> None:
    assert lone_take_keys([256, 512, 1024, 2048, 4096]) == [256, 512, 1024]
    assert lone_take_keys([256, 512, 600]) == [256, 512, 600]  # a short max_seq_len's last bucket
    assert lone_take_keys([256, 2048]) == [256, 2048]


def test_the_first_idle_capture_waits_its_quiet_time_after_ready(moss_server) -> None:  # type: ignore[no-untyped-def]
    """A client that waited for ready and starts at once must not meet a graph capture in progress."""
    import time

    before = time.monotonic()
    engine = moss_server().engine
    assert before <= engine._busy_at <= time.monotonic()  # the warm-up counted as work, up to ready
    assert not engine._idle_capture_due(False, True, engine._busy_at + IDLE_CAPTURE_QUIET_S / 2)
    assert engine._idle_capture_due(False, True, engine._busy_at + IDLE_CAPTURE_QUIET_S)
