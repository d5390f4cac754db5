"""``--aligner``: which aligner the service runs (``auto``, ``pocketsphinx``, ``ctc:<hub id or folder>``, ``none``).

``auto`` picks the CTC model (:data:`~moss_rt.align.ctc.DEFAULT_CTC_MODEL`) on a CUDA device when it is already in
the local hub cache (it is never downloaded unasked), else PocketSphinx (offline, English), else none. A named
aligner that cannot load is reported at start (``/readyz``), like the model.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from pathlib import Path

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


def _ctc_model_cached() -> bool:
    """Whether the default CTC model is in the local hub cache (never downloads); says so once when it is not."""
    from moss_rt.align.ctc import DEFAULT_CTC_MODEL, AlignerSourceError, resolve_ctc_source

    try:
        resolve_ctc_source(DEFAULT_CTC_MODEL, local_only=True)
    except AlignerSourceError:
        log.info("--aligner auto: %s is not in the hub cache, so no CTC aligner (on a GPU, --aligner ctc:%s "
                 "downloads it)", DEFAULT_CTC_MODEL, DEFAULT_CTC_MODEL)  # fmt: skip
        return False
    return True


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


def build_aligner(
    spec: str, *, device: str = "auto", workers: int = 0, graph_memory_bytes: int | None = None
) -> Aligner | None:
    """The aligner ``spec`` names, not yet loaded (None for ``none``); ``workers``: a CPU aligner's processes (0:
    cpu_workers' choice); ``graph_memory_bytes``: a CTC aligner's graph budget (moss_rt.align.memory)."""
    spec = spec.strip()
    if spec == "none":
        return None
    if spec == "pocketsphinx":
        from moss_rt.align.sphinx import PocketsphinxAligner

        # Decoding holds the GIL: off the server's process.
        return PocketsphinxAligner(workers=cpu_workers(workers), processes=True)
    if spec.startswith("ctc:") and len(spec) > 4:
        from moss_rt.align.ctc import CtcAligner

        if graph_memory_bytes is None:
            return CtcAligner(spec[4:], device=aligner_device(device))
        return CtcAligner(spec[4:], device=aligner_device(device), graph_memory_bytes=graph_memory_bytes)
    if spec == "auto":
        # The hub cache before CUDA: asking for CUDA imports torch (~1-2 s), which a service without the CTC model
        # (the scripted engine, a CPU start) then never does.
        if _ctc_model_cached() and _cuda(aligner_device(device)):
            from moss_rt.align.ctc import DEFAULT_CTC_MODEL

            return build_aligner(
                f"ctc:{DEFAULT_CTC_MODEL}", device=device, workers=workers, graph_memory_bytes=graph_memory_bytes
            )
        if importlib.util.find_spec("pocketsphinx") is not None:
            return build_aligner("pocketsphinx", workers=workers)
        log.warning("--aligner auto: pocketsphinx is not installed and no CTC model is cached: no word timing")
        return None
    raise AlignerChoiceError(f"unknown aligner {spec!r}: auto, pocketsphinx, ctc:<hub id or folder>, or none")


def planned_ctc_source(spec: str, device: str = "auto") -> str | None:
    """The CTC checkpoint ``--aligner spec`` will run on a CUDA device (None: no CTC model on a GPU), decided as
    :func:`build_aligner` does, without loading or downloading anything."""
    spec = spec.strip()
    if not _cuda(aligner_device(device)):
        return None
    if spec.startswith("ctc:") and len(spec) > 4:
        return spec[4:]
    if spec == "auto":
        from moss_rt.align.ctc import DEFAULT_CTC_MODEL, AlignerSourceError, resolve_ctc_source

        try:
            resolve_ctc_source(DEFAULT_CTC_MODEL, local_only=True)
        except AlignerSourceError:
            return None
        return DEFAULT_CTC_MODEL
    return None


def planned_reserve_bytes(
    spec: str, *, device: str, engine_index: int, graph_memory_bytes: int, aligner_index: int | None = None
) -> int:
    """What the engine's memory plan reserves for the word aligner on CUDA device ``engine_index``: a CTC aligner
    there (``aligner_index``: its device's index, by default the device ``aligner_device(device)`` names) holds at
    most its weights, buffers and twice ``graph_memory_bytes`` (moss_rt.align.memory.reserve_bytes), less what the
    aligners of this process hold there already (the plan measures that as in use). Read that before measuring the
    free memory: an aligner loading in between is then counted twice, never not at all."""
    source = planned_ctc_source(spec, device)
    if source is None:
        return 0
    if aligner_index is None:
        name = aligner_device(device)
        aligner_index = int(name.split(":", 1)[1]) if ":" in name else _current_cuda_index()
    if aligner_index != engine_index:
        return 0
    from moss_rt.align.ctc import held_device_bytes
    from moss_rt.align.memory import reserve_bytes

    weights, io = checkpoint_device_bytes(source)
    return max(0, reserve_bytes(weights, io, graph_memory_bytes) - held_device_bytes(engine_index))


def checkpoint_device_bytes(source: str, *, max_rows: int = 64, itemsize: int = 2) -> tuple[int, int]:
    """(weights, buffers) bytes of the CTC checkpoint ``source`` on a GPU (fp16), read from its local files only;
    a checkpoint not on disk yet (it downloads when the aligner loads) is counted as an MMS-300m one."""
    from moss_rt.align.ctc import AlignerSourceError, ctc_config, resolve_ctc_source
    from moss_rt.align.ctc_graphs import GRAPH_MAX_SEC
    from moss_rt.align.memory import MMS_300M_PARAMS, NetDims, io_bytes, weights_bytes

    config: dict[str, object] = ctc_config("mms-300m")
    params = MMS_300M_PARAMS
    try:
        folder = resolve_ctc_source(source, local_only=True)
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        params = safetensors_params(folder) or params
    except (AlignerSourceError, OSError, ValueError) as exc:
        log.info("aligner %s is not on disk yet (%s): its memory is planned as an MMS-300m aligner's", source, exc)
    dims = NetDims.from_config(config)
    return weights_bytes(params, itemsize), io_bytes(dims, max_rows, int(GRAPH_MAX_SEC * 16000))


def safetensors_params(folder: Path) -> int:
    """Parameters in a checkpoint folder's safetensors files, from their headers (no tensor is read)."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size < 1 << 28:
                raise ValueError(f"{path} has no safetensors header")
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                total += math.prod(int(d) for d in entry.get("shape", ()))
    return total


def _current_cuda_index() -> int:
    import torch

    return int(torch.cuda.current_device())
