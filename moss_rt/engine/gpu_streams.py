"""CUDA stream priorities: on a shared GPU directors' first chunks start first, then the model's work, then steady
codec calls.

Why: with the codec overlapped (``codec_overlap``), the engine's thread (model steps, prefill passes) and the codec's
worker (decode calls) put work on the GPU at once, and with equal stream priorities the GPU shares its SMs between
them as it finds blocks to run: a burst of directors' retakes waited for its prefill passes and steps beside the
running streams' codec calls. The steady calls have slack (a running stream's client holds seconds of audio, and the
codec's bounded lanes hold the model back when it falls behind: engine/codec_flow), so they run on a normal-priority
stream, and the GPU's block scheduler starts a waiting block of a higher-priority stream first whenever SMs free up
(no running block is preempted).

Three levels where the device has them (PyTorch offers up to four; an H200 has them): the codec's priority lane (the
chunks a director is waiting to hear, interactive retakes' rebuilds) at the highest, the engine's thread one below,
steady and batch codec calls at the normal one. A director's first chunk is a small call (a frame or a few, a few
streams) that was queued behind the prefill pass of the next directors' rows: in a burst of 16 retakes its decode
took 22 ms on the GPU where alone it takes 8, and during a render its p95 doubled (10 → 21 ms). Ahead of the
engine's work it takes a small share of the SMs for a few ms; the passes and steps it delays lose about that much.
Where the device has two levels only, the engine's thread and the priority lane share the highest, as before.

Measured on two H200s with the two-level split (bench/directing_bench.py, same machine with and without
priorities): 64 directors retaking with a new instruction in a burst, p95 462 → 359 and 463 → 392 ms, the running
streams' slowest 1.50 → 1.68× and 1.26 → 1.31×; 16 directors unchanged; 128 takes on their own lines 366 → 356× (one
run each, within run-to-run noise).

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


def below_highest(greatest: int, least: int = NORMAL) -> int:
    """The level one below ``greatest`` (lower numbers run first), where it is still above ``least``; ``greatest``
    itself on a device of two levels (the engine's thread then shares the highest with the codec's priority lane)."""
    return greatest + 1 if greatest + 1 < least else greatest


def engine_priority() -> int:
    """The engine thread's stream priority on this process's CUDA devices: one below the highest (below_highest)."""
    import torch

    least, greatest = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]  # a static method (stubs say not)
    return below_highest(int(greatest), int(least))


@contextlib.contextmanager
def engine_stream(device: Any, enabled: bool = True) -> Iterator[None]:
    """Run the block on a stream of the engine's priority (engine_priority: above steady codec calls, below the
    codec's priority lane where the device has the levels), the engine's thread for everything it serves. Everything
    queued on the device so far is finished first: what was loaded and captured on the thread's former stream is
    complete before the new one reads it."""
    if not enabled or not usable(device):
        yield
        return
    import torch

    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device=device, priority=engine_priority())
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
