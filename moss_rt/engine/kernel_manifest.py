"""The Triton kernels a start met, written down so the next start can compile them all at once.

Why: on a machine whose Triton cache is cold, the start waits for its compiles (issue 24). The compile workers
(compile_workers.py) run several at once, but only as the chains' eager passes meet the kernels, and a pass meets its
kernels one after another: on an H200, 42 kernels of ~0.8 s each took 15.9 s on 8 workers, the step's pass and the
codec's being one dependent run of compiles each (bench/RESULTS.md, session 13). A kernel's compile needs nothing
but its specialization (Triton's JSON of its argument types, constants, alignment and options) and the GPU's target,
which is what a compile worker is handed; known ahead, every kernel can be handed over at once.

So a start that compiled kernels in workers writes the jobs it met to ``kernel-manifest.json`` in the data dir, and
a start that compiles ahead hands every job of the manifests it finds (the data dir's, and those shipped in
``moss_rt/engine/kernel_manifests/`` for known GPUs) to the workers before its chains run; a chain then finds its
kernels compiled or compiling. A job whose kernel changed since (another signature) fails in its worker and the
kernel compiles as before, when met; a job no pass meets any more costs a worker's time and nothing else. Only jobs
for this Triton version and this GPU target are handed over.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from moss_rt.atomic_files import atomic_write
from moss_rt.engine.compile_workers import KernelJob

log = logging.getLogger(__name__)

MANIFEST_NAME = "kernel-manifest.json"
SHIPPED = Path(__file__).resolve().parent / "kernel_manifests"  # recorded on the GPUs the project measures on
# 2: the codec's fused kernels and the paged-attention kernels moved to torch-free modules of their own
# (codec/fused_kernels.py, model/paged_attention_kernels.py): a manifest of format 1 names them where they were.
FORMAT = 2


def manifest_paths(data_dir: Path) -> list[Path]:
    """The manifests a start reads: the ones shipped with moss_rt, then the data dir's (this machine's own)."""
    shipped = sorted(SHIPPED.glob("*.json")) if SHIPPED.is_dir() else []
    return [*shipped, data_dir / MANIFEST_NAME]


def _read(path: Path, triton_version: str) -> list[KernelJob]:
    """Every job of one manifest written for this Triton version (none for another, or for no file); raises what a
    malformed one raises."""
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT or data.get("triton") != triton_version:
        return []
    return [
        KernelJob(str(e["module"]), str(e["qualname"]), str(e["specialization"]),
                  tuple(e["target"]) if e.get("target") is not None else None)
        for e in data["jobs"]
    ]


def load_jobs(paths: Iterable[Path], triton_version: str, target: tuple[Any, ...] | None) -> list[KernelJob]:
    """The jobs of these manifests for this Triton version and GPU target, each once, in the order written. A missing
    file is no manifest; an unreadable one is logged and skipped."""
    jobs: dict[tuple[Any, str], KernelJob] = {}
    for path in paths:
        try:
            found = _read(path, triton_version)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("kernel manifest %s cannot be read (%s: %s); its kernels compile when met", path,
                        type(exc).__name__, exc)
            continue
        for job in found:
            if job.target == target:
                jobs.setdefault(job.key, job)
    return list(jobs.values())


def save_jobs(path: Path, jobs: Sequence[KernelJob], triton_version: str) -> int:
    """Add ``jobs`` to the manifest at ``path``, whatever their targets (a data dir may move between GPUs; those of
    another Triton version are dropped: they would never be used again); the number of jobs it holds now. Written
    whole to a temporary file, then renamed over the old one."""
    try:
        existing = _read(path, triton_version)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("kernel manifest %s cannot be read (%s: %s); writing a new one", path, type(exc).__name__, exc)
        existing = []
    kept: dict[tuple[Any, str], KernelJob] = {}
    for job in (*existing, *jobs):
        kept.setdefault(job.key, job)
    entries = [
        {"module": j.module, "qualname": j.qualname, "specialization": j.specialization,
         "target": list(j.target) if j.target is not None else None}
        for j in kept.values()
    ]
    text = json.dumps({"format": FORMAT, "triton": triton_version, "jobs": entries}, indent=1) + "\n"
    atomic_write(path, text.encode())
    return len(entries)
