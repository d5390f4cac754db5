"""The one rule behind every Triton kernel's switch, and the lazy import of kernel modules.

Each kernel (paged decode attention, fused sampler, fused backbone and local transformer, the codec's window
attention) has an environment switch ``MOSS_RT_<NAME>``: ``0`` keeps the plain PyTorch path (for diagnosis: same
results, slower); ``interpret`` together with ``TRITON_INTERPRET=1`` runs the kernel on CPU tensors through Triton's
interpreter (tests); anything else runs it on CUDA tensors. The switch is read at each call, so a test can flip it;
inside a CUDA graph only the capture reads it.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType


def kernel_wanted(switch: str, on_cuda: bool) -> bool:
    """Whether the kernel behind ``switch`` should run for tensors that are (``on_cuda``) or are not on CUDA."""
    mode = os.environ.get(switch, "1")
    if mode == "0":
        return False
    return on_cuda or (mode == "interpret" and os.environ.get("TRITON_INTERPRET") == "1")


def loaded_kernels(module: str) -> ModuleType:
    """The kernel module, for callers whose ``available()`` already said yes (Triton imports)."""
    kernels = import_kernels(module)
    assert kernels is not None, "check available() first"
    return kernels


@functools.cache
def import_kernels(module: str) -> ModuleType | None:
    """The kernel module, imported on first use (so TRITON_INTERPRET is read then); None without Triton (the CPU
    wheels), where callers keep the PyTorch path."""
    try:
        return importlib.import_module(module)
    except Exception:  # noqa: BLE001 - no Triton, or Triton without a backend here
        return None
