"""The engine's start on the device (issue 24): weights read through pinned buffers and a copy stream
(moss_rt/safetensors_read.py) equal safe_open's bit for bit, and kernels compiled ahead on threads
(engine/warm_compile.py: real Triton compiles, several at once) change no take. The ``cpu`` variants run the same
bodies (the CPU suite also runs the engine scenario: tests/engine/test_warm_compile.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open

from moss_rt.codec import load_codec
from moss_rt.model import load_model
from moss_rt.model.network import build_model
from moss_rt.safetensors_read import read_into
from tests.codec.conftest import TINY_DIR as TINY_CODEC
from tests.engine.harness import drive, engine_settings, loaded_engine, spec
from tests.gpu.conftest import DEVICES
from tests.model.conftest import TINY


def _safe_open(path: str, device: str) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt", device=device) as fh:
        return {name: fh.get_tensor(name) for name in fh.keys()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_model_weights_equal_safe_opens_bit_for_bit(device: str, dtype: torch.dtype) -> None:
    loaded = load_model(TINY, device=device, dtype=dtype)
    reference = _safe_open(str(TINY / "model.safetensors"), device)
    for name, tensor in loaded.model.state_dict().items():
        assert tensor.device.type == device
        assert torch.equal(tensor, reference[name].to(dtype)), name
    # Pieces far smaller than the tensors, on several threads: tensors spanning pieces, conversions on the device.
    model = build_model(loaded.config, torch.device(device), dtype)
    params = dict(model.state_dict(keep_vars=True))
    tied = model.tied_keys()
    read_into(TINY / "model.safetensors", [(k, p) for k, p in params.items() if k not in tied],
              chunk_bytes=4099, workers=3)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference[name].to(dtype)), name


@pytest.mark.parametrize("device", DEVICES)
def test_codec_weights_equal_the_cpu_loads(device: str) -> None:
    on_device = load_codec(TINY_CODEC, device=device)
    on_cpu = load_codec(TINY_CODEC, device="cpu")  # safe_open's values, read and folded on the host (codec tests)
    for (name, a), (_, b) in zip(on_device.state_dict().items(), on_cpu.state_dict().items(), strict=True):
        assert torch.equal(a.cpu(), b), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_compiled_ahead_on_threads_change_no_take(tiny_data_dir) -> None:  # type: ignore[no-untyped-def]
    specs = [spec("a", 1, 19, 8), spec("b", 2, 13, 5, text="Another line, said slowly.")]
    heard = {}
    for threads in (1, 6):
        settings = engine_settings(tiny_data_dir, overlap=True, device="cuda", compile_threads=threads,
                                   max_seq_len=600)
        with loaded_engine(settings) as engine:
            assert engine._runner is not None and engine._runner.use_cuda_graphs
            phases = engine.startup.phases
            assert ("compile: step of one take" in phases) == (threads > 1), sorted(phases)
            assert list(phases)[0] == "CUDA context"  # timed on its own, before anything else touches the device
            driven = drive(engine, specs)
            heard[threads] = {k: (c.codes, c.pcm) for k, c in driven.channels.items()}
    for take_id, (codes, pcm) in heard[1].items():
        np.testing.assert_array_equal(heard[6][take_id][0], codes)
        assert heard[6][take_id][1] == pcm, take_id


# A fresh interpreter (no kernel compiled in memory yet) with a cold Triton cache starts the tiny engine on CUDA, takes
# two lines and prints what its compile workers did and a digest of the takes' codes and PCM. The manifests shipped
# with moss_rt (full-size kernels, handed to the workers too) are left out: the test compares the kernels the tiny
# engine meets, and whether a start handed over its data dir's manifest.
COLD_START = """
import hashlib, json, logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO)
from tests.engine.harness import drive, engine_settings, loaded_engine, spec
import moss_rt.engine.kernel_manifest as kernel_manifest
kernel_manifest.SHIPPED = Path(sys.argv[2]) / "no-shipped-manifests"  # full-size kernels: not this test's
processes = sys.argv[1] != "off"
threads = 0 if sys.argv[1] == "warm" else 4  # "warm": the server's default, which skips compiling ahead
settings = engine_settings(Path(sys.argv[2]), overlap=True, device="cuda", compile_threads=threads,
                           compile_processes=processes, max_seq_len=600)
with loaded_engine(settings) as engine:
    counts = engine.compile_workers_counts
    preloaded = engine.kernel_preload_counts
    preloaded = None if preloaded is None else [preloaded.loaded, preloaded.failed]
    met = engine.kernels_met_in_warm_up
    sizing = [engine._scheduler.stream_rows, engine.prefill_cost_measured]
    driven = drive(engine, [spec("a", 1, 19, 8), spec("b", 2, 13, 5, text="Another line, said slowly.")])
    digest = hashlib.sha256()
    for take_id in sorted(driven.channels):
        digest.update(driven.channels[take_id].codes.tobytes() + driven.channels[take_id].pcm)
print("RESULT " + json.dumps({"counts": counts, "takes": digest.hexdigest(), "preloaded": preloaded, "met": met,
                             "sizing": sizing}))
"""


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_compiled_in_worker_processes_on_a_cold_cache_change_no_take(tiny_data_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A cold Triton cache (a freshly started machine): the kernels met before ready compile in worker processes
    (engine/compile_workers.py), none is left to the engine's process, and the takes equal those of an engine whose
    kernels compiled on threads of its own (--no-compile-processes)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    data = tmp_path / "data"  # a data dir of its own: no kernel manifest from another test
    data.mkdir()
    if (tiny_data_dir / "tiny").is_dir():  # the tiny checkpoints, not written again
        (data / "tiny").symlink_to(tiny_data_dir / "tiny")
    results = {}
    # "again": another machine's cold Triton cache, with the data dir the "on" start wrote its kernel manifest to;
    # "warm": a second start on the "on" start's cache (its marker there), with the server's default settings.
    for mode in ("on", "off", "again", "warm"):
        cache = tmp_path / f"triton-{'on' if mode == 'warm' else mode}"
        env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": str(root)}
        done = subprocess.run([sys.executable, "-c", COLD_START, mode, str(data)], cwd=root, env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
        results[mode] = json.loads(line[len("RESULT "):])
        results[mode]["handed"] = "handed over ahead from the kernel manifests" in done.stderr
        results[mode]["log"] = done.stderr[-6000:]  # the engine's warnings: why a worker could not compile
    compiled, failed, _ = results["on"]["counts"]
    assert compiled > 0 and failed == 0, results["on"]
    assert results["off"]["counts"] is None
    assert results["on"]["takes"] == results["off"]["takes"]
    # The workers compiled under the keys this process looks up: the same kernels in both caches (a worker's kernel
    # under another key would sit beside the one the engine then compiled itself).
    kernels = {mode: {p.relative_to(tmp_path / f"triton-{mode}").as_posix()
                      for p in (tmp_path / f"triton-{mode}").glob("*/*.cubin")} for mode in ("on", "off")}
    assert kernels["on"] == kernels["off"], (sorted(kernels["on"] - kernels["off"]),
                                             sorted(kernels["off"] - kernels["on"]))
    # The next start on a cold cache handed the recorded kernels over at once: the same kernels, the same takes.
    assert not results["on"]["handed"] and results["again"]["handed"], results["again"]["log"]
    assert results["again"]["takes"] == results["on"]["takes"]
    assert results["again"]["counts"][1] == 0, results["again"]
    again = {p.relative_to(tmp_path / "triton-again").as_posix() for p in (tmp_path / "triton-again").glob("*/*.cubin")}
    assert kernels["on"] <= again, sorted(kernels["on"] - again)
    # The second start loaded the kernels its manifest names beside the load (engine/kernel_preload.py): the captures
    # before ready met none of them, nothing new was compiled into the cache, and the takes are the same.
    warm = results["warm"]
    assert warm["counts"] is None and warm["preloaded"] is not None, warm["log"]
    assert warm["preloaded"][0] > 0 and warm["preloaded"][1] == 0, warm
    assert warm["met"] == [], warm
    assert warm["takes"] == results["on"]["takes"]
    after = {p.relative_to(tmp_path / "triton-on").as_posix() for p in (tmp_path / "triton-on").glob("*/*.cubin")}
    assert after == kernels["on"], sorted(after - kernels["on"])
    # The first start timed its prefill passes and recorded the cost in the data dir; the later ones sized theirs
    # from that record, to the same rows (engine/prefill_cost_record.py).
    assert results["on"]["sizing"][1] is True
    assert [results[m]["sizing"] for m in ("off", "again", "warm")] == [[results["on"]["sizing"][0], False]] * 3
