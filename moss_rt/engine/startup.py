"""How long each phase of the engine's start took: logged at INFO as it ends, summed up once ready, and exposed as
``moss_rt_startup_seconds{phase}`` in ``/metrics`` (``bench/engine_bench.py`` prints them), so one start on a machine
says where its time went (issue 24: ready within 20 s of a fresh machine's start, 10 s on a second start).

Phases on the engine's thread follow one another; the ahead compiles (``compile: ...``) run on threads of their own
beside them, and their seconds overlap the rest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moss_rt.config import Settings

log = logging.getLogger(__name__)


def process_age() -> float | None:
    """Seconds since this process started (Linux: from /proc), None where that cannot be read."""
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5): start time, in ticks since boot
        with open("/proc/uptime", encoding="ascii") as fh:
            uptime = float(fh.read().split()[0])
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return max(0.0, uptime - started)


def warm_cuda(settings: Settings) -> threading.Thread | None:
    """Bring up the CUDA context of the engine's device on a thread of its own, now; None where it is not a CUDA device.

    Creating the context (the driver, the device's memory, the libraries loaded lazily) takes a second or more of an
    H200 host's start, and the model's first allocation would otherwise pay it after the engine's thread has imported
    the model's code: on this thread it overlaps those imports (the allocation below runs without the GIL). Nothing
    waits for it; an error here shows again, with its reason, where the engine first uses the device."""
    from moss_rt.engine.resolve import placement

    try:
        device = placement(settings).device
    except RuntimeError:  # a device or dtype that cannot be used: the engine's start says so
        return None
    if device.type != "cuda":
        return None

    def bring_up() -> None:
        import torch

        t0 = time.perf_counter()
        try:
            torch.cuda.init()
            torch.empty(1, device=device)  # the first allocation creates the context
        except Exception:  # noqa: BLE001 - reported by the engine's own first use of the device
            log.debug("CUDA context ahead of the engine's start failed", exc_info=True)
            return
        log.info("start-up: CUDA context of %s ready in %.2f s (beside the engine's imports)",
                 device, time.perf_counter() - t0)

    thread = threading.Thread(target=bring_up, name="moss-rt-cuda-init", daemon=True)
    thread.start()
    return thread


class StartupTimeline:
    """The phases of one engine start, in seconds (see the module docstring)."""

    def __init__(self, gauge: Any = None) -> None:
        self.gauge = gauge  # a prometheus Gauge labelled by phase, or None
        self.phases: dict[str, float] = {}

    def record(self, phase: str, seconds: float) -> None:
        self.phases[phase] = seconds
        if self.gauge is not None:
            self.gauge.labels(phase).set(round(seconds, 3))
        log.info("start-up: %s in %.2f s", phase, seconds)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, time.perf_counter() - t0)

    def summary(self) -> str:
        """One line: the phases in the order they were recorded."""
        return "; ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())
