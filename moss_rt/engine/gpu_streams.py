"""CUDA stream priorities: on a shared GPU the model's work and directors' first chunks start before steady codec calls.

Why: with the codec overlapped (``codec_overlap``), the engine's thread (model steps, prefill passes) and the codec's
worker (decode calls) put work on the GPU at once, and with equal stream priorities the GPU shares its SMs between
them as it finds blocks to run: a burst of directors' retakes waited for its prefill passes and steps beside the
running streams' codec calls. The steady calls have slack (a running stream's client holds seconds of audio, and the
codec's bounded lanes hold the model back when it falls behind: engine/codec_flow), so the engine's thread and the
codec's priority lane (the chunks a director is waiting to hear, interactive retakes' rebuilds) run on the device's
highest-priority stream and steady and batch codec calls on a normal one: the GPU's block scheduler starts a waiting
block of the higher-priority stream first whenever SMs free up (no running block is preempted).

Measured on two H200s, 64 directors retaking in a burst (bench/directing_bench.py, same machine with and without):
a retake with a new instruction 462 → 359 and 463 → 392 ms at p95, the running streams' slowest 1.50 → 1.68× and
1.26 → 1.31×; 16 directors unchanged; 128 takes on their own lines 366 → 356× (one run each, within run-to-run noise).

Nothing changes in what is computed: the same kernels on the same inputs (streams order work, they do not change
it), so a take's codes and PCM are the same with priorities on or off (GPU tier).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# torch maps a priority past the device's range to the nearest one it has: this is the highest.
HIGHEST = -(1 << 10)
NORMAL = 0


def usable(device: Any) -> bool:
    return device is not None and getattr(device, "type", None) == "cuda"


@contextlib.contextmanager
def high_priority(device: Any, enabled: bool = True) -> Iterator[None]:
    """Run the block on a stream of the device's highest priority (the engine's thread, for everything it serves).
    Everything queued on the device so far is finished first: what was loaded and captured on the thread's former
    stream is complete before the new one reads it."""
    if not enabled or not usable(device):
        yield
        return
    import torch

    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device=device, priority=HIGHEST)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        stream.synchronize()


class LaneStreams:
    """The codec worker's two streams: its priority lane's at the highest priority, the bulk lane's (and every
    ``call``'s) at the normal one. Calls run one at a time on the worker's thread; a call on the other lane's stream
    first waits for everything the previous call queued (an event, no host sync), so on the device too every call
    runs after the one before it, as on one stream (graphs of one memory pool are never replayed at once)."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self.high = torch.cuda.Stream(device=device, priority=HIGHEST)
        self.normal = torch.cuda.Stream(device=device, priority=NORMAL)
        self._last: Any = None

    @contextlib.contextmanager
    def lane(self, priority: bool) -> Iterator[None]:
        stream = self.high if priority else self.normal
        if self._last is not None and self._last is not stream:
            stream.wait_stream(self._last)
        self._last = stream
        with self._torch.cuda.stream(stream):
            yield

    def synchronize(self) -> None:
        self.high.synchronize()
        self.normal.synchronize()
