"""``--aligner``: which aligner the service runs (``auto``, ``pocketsphinx``, ``ctc:<hub id or folder>``, ``none``).

``auto`` picks the CTC model (:data:`~moss_rt.align.ctc.DEFAULT_CTC_MODEL`) on a CUDA device when it is already in
the local hub cache (it is never downloaded unasked), else PocketSphinx (offline, English), else none. A named
aligner that cannot load is reported at start (``/readyz``), like the model.
"""

from __future__ import annotations

import importlib.util
import logging
import os

from moss_rt.align.base import Aligner

log = logging.getLogger(__name__)


class AlignerChoiceError(ValueError):
    """An ``--aligner`` value that names no aligner."""


def _cuda(device: str) -> bool:
    if device.startswith("cpu"):
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def aligner_device(device: str) -> str:
    """The aligner's device for the engine's ``--device`` (auto: CUDA when there is one)."""
    if device == "auto":
        return "cuda" if _cuda("cuda") else "cpu"
    return device


def cpu_workers(setting: int = 0) -> int:
    """Worker processes for a CPU aligner: the setting, or (0) half the cores this process may use, 2 to 8 (the other
    half serve the engine's threads, the event loop and the codec's; past 8 a script render is no longer waiting)."""
    if setting > 0:
        return setting
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 2
    return max(2, min(8, cores // 2))


def build_aligner(spec: str, *, device: str = "auto", workers: int = 0) -> Aligner | None:
    """The aligner ``spec`` names, not yet loaded (None for ``none``); ``workers``: a CPU aligner's processes (0:
    cpu_workers' choice)."""
    spec = spec.strip()
    if spec == "none":
        return None
    if spec == "pocketsphinx":
        from moss_rt.align.sphinx import PocketsphinxAligner

        # Decoding holds the GIL: off the server's process.
        return PocketsphinxAligner(workers=cpu_workers(workers), processes=True)
    if spec.startswith("ctc:") and len(spec) > 4:
        from moss_rt.align.ctc import CtcAligner

        return CtcAligner(spec[4:], device=aligner_device(device))
    if spec == "auto":
        if _cuda(aligner_device(device)):
            from moss_rt.align.ctc import DEFAULT_CTC_MODEL, AlignerSourceError, resolve_ctc_source

            try:
                resolve_ctc_source(DEFAULT_CTC_MODEL, local_only=True)
                return build_aligner(f"ctc:{DEFAULT_CTC_MODEL}", device=device, workers=workers)
            except AlignerSourceError:
                log.info("--aligner auto: %s is not in the hub cache; using pocketsphinx (CPU, English). "
                         "--aligner ctc:%s downloads it", DEFAULT_CTC_MODEL, DEFAULT_CTC_MODEL)  # fmt: skip
        if importlib.util.find_spec("pocketsphinx") is not None:
            return build_aligner("pocketsphinx", workers=workers)
        log.warning("--aligner auto: pocketsphinx is not installed and no CTC model is cached: no word timing")
        return None
    raise AlignerChoiceError(f"unknown aligner {spec!r}: auto, pocketsphinx, ctc:<hub id or folder>, or none")
