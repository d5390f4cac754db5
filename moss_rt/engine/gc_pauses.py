"""The garbage collector's pauses: timed, and kept short by taking the start's objects out of its way.

Why: CPython's cyclic collector stops whichever thread triggered it, for as long as it walks every tracked object of
the generations it collects. A full (oldest generation) collection walks everything the start made too: the model's
modules and parameters, the tokenizer, the web app. If one lands on the engine's thread, every take waits: a
scheduling round, an admission or a step simply takes longer, and nothing in the round's own figures says why (a
burst of 64 retakes on an H200 spent 218 ms of the engine thread's CPU time in an admission part that costs 40 µs a
take on the CPU, bench/RESULTS.md session 14: a suspect, not a finding). So:

- every collection is timed, by generation (``moss_rt_gc_pause_seconds{generation}``), whichever thread ran it;
- once the engine is ready, what the start made is moved out of the collector's reach (``gc.freeze``: collections
  then walk only what serving makes), and given back to it when the engine closes (``gc.unfreeze``), so that a
  closed engine's cycles are collected like any others (tests and restarts open several engines in one process).
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

from prometheus_client import Histogram


class GcPauses:
    """Times the collector's runs into ``histogram`` (labelled by generation) while installed."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram
        self._started = threading.local()
        self._installed = False
        self.total_s = 0.0  # every collection's time while installed (a round trace's gc_ms)

    def install(self) -> GcPauses:
        if not self._installed:
            gc.callbacks.append(self._on_collect)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            # A collection running now on another thread may still call it once: harmless.
            try:
                gc.callbacks.remove(self._on_collect)
            except ValueError:  # pragma: no cover - removed by someone else
                pass
            self._installed = False

    def _on_collect(self, phase: str, info: dict[str, Any]) -> None:
        # Called by the interpreter on the collecting thread (collections never nest, so the histogram's own locks are
        # only ever taken here); it must not raise (at interpreter exit the modules it uses may be gone).
        try:
            if phase == "start":
                self._started.t0 = time.perf_counter()
                return
            t0 = getattr(self._started, "t0", None)
            if t0 is not None:
                self._started.t0 = None
                seconds = time.perf_counter() - t0
                self.total_s += seconds
                self.histogram.labels(str(info.get("generation", "?"))).observe(seconds)
        except Exception:  # noqa: BLE001, S110 - a lost sample, never a failing collection
            pass


def freeze_start_objects() -> int:
    """Collect what the start left behind, then move every object alive now out of the collector's reach; returns
    how many were moved (logged by the caller)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze() -> None:
    """Give the frozen objects back to the collector (the oldest generation), so a closed engine's are collected."""
    gc.unfreeze()
