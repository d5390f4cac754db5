"""What a round's staged slot writes cost the engine's thread on a GPU, by how the host data reaches the device.

    python bench/staged_copy.py [--slots 16] [--rounds 60] [--out staged_copy.json]

The scheduler applies a round's admissions in one ``ModelRunner.apply_staged``: block-table rows, per-slot integers
and floats, and repetition-presence rows, each scattered into the device state. On an H200 during a script render
that call took 235 ms of wall time and 110 ms of the engine thread's CPU time over ~13 rounds (bench/RESULTS.md,
session 12): far more than its few hundred kilobytes need. This script times the same writes (the full-size shapes:
216 slots, 64 blocks a slot, 12 x 1024 presence) with the GPU kept busy by a stream of matmuls, as a model step keeps
it, and optionally a second Python thread spinning, as the codec worker and the event loop do:

- ``pin_each``: each payload pinned on its own (``Tensor.pin_memory``) and copied (what apply_staged did);
- ``ring``: one pinned buffer of a small ring, written through numpy, one copy (``moss_rt.model.staging``).

Per variant and background: wall and thread-CPU time per round (mean, p95), and for ``pin_each`` the share of its
pin_memory calls.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moss_rt.model.staging import PinnedStaging  # noqa: E402

SLOTS, MAX_BLOCKS, INT_FIELDS, FLOAT_FIELDS, N_VQ, VOCAB = 216, 64, 6, 5, 12, 1024


class Background:
    """Keeps the GPU busy (matmuls on the default stream, never synchronised but bounded by an event every 8) and,
    with ``python``, a thread running pure Python."""

    def __init__(self, device: torch.device, python: bool) -> None:
        self.device = device
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._gpu, daemon=True)]
        if python:
            self.threads.append(threading.Thread(target=self._python, daemon=True))

    def _gpu(self) -> None:
        a = torch.randn(4096, 4096, device=self.device, dtype=torch.bfloat16)
        n = 0
        while not self.stop.is_set():
            a = (a @ a).clamp_(-1, 1)
            n += 1
            if n % 8 == 0:
                torch.cuda.current_stream(self.device).synchronize()

    def _python(self) -> None:
        x = 0
        while not self.stop.is_set():
            for i in range(1000):
                x += i * i

    def __enter__(self) -> Background:
        for t in self.threads:
            t.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def payloads(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    slots = np.sort(rng.choice(SLOTS, size=n, replace=False)).astype(np.int64)
    return {
        "tables": np.concatenate([slots[:, None], rng.integers(0, 10_000, (n, MAX_BLOCKS))], axis=1),
        "ints": np.concatenate([slots[None], rng.integers(0, 1000, (INT_FIELDS, n))], axis=0),
        "floats": rng.random((FLOAT_FIELDS, n), dtype=np.float32),
        "presence_slots": slots,
        "presence": rng.random((n, N_VQ, VOCAB)) < 0.01,
    }


class State:
    def __init__(self, device: torch.device) -> None:
        self.block_table = torch.zeros((SLOTS, MAX_BLOCKS), dtype=torch.int64, device=device)
        self.slot_ints = torch.zeros((INT_FIELDS, SLOTS), dtype=torch.int64, device=device)
        self.slot_floats = torch.zeros((FLOAT_FIELDS, SLOTS), dtype=torch.float32, device=device)
        self.presence = torch.zeros((SLOTS, N_VQ, VOCAB), dtype=torch.bool, device=device)


def apply_pin_each(st: State, p: dict[str, np.ndarray], device: torch.device, pin_time: list[float]) -> None:
    def to_device(host: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        pinned = host.pin_memory()
        pin_time.append(time.perf_counter() - t0)
        return pinned.to(device, non_blocking=True)

    dev = to_device(torch.from_numpy(p["tables"]))
    st.block_table[dev[:, 0]] = dev[:, 1:]
    dev = to_device(torch.from_numpy(p["ints"]))
    st.slot_ints[:, dev[0]] = dev[1:]
    st.slot_floats[:, dev[0]] = to_device(torch.from_numpy(p["floats"]))
    index = to_device(torch.from_numpy(p["presence_slots"]))
    st.presence[index] = to_device(torch.from_numpy(p["presence"]))


def apply_ring(st: State, p: dict[str, np.ndarray], staging: PinnedStaging) -> None:
    tables, ints, floats, pslots, presence = staging.copy(
        [p["tables"], p["ints"], p["floats"], p["presence_slots"], p["presence"]]
    )
    st.block_table[tables[:, 0]] = tables[:, 1:]
    st.slot_ints[:, ints[0]] = ints[1:]
    st.slot_floats[:, ints[0]] = floats
    st.presence[pslots] = presence


def run(variant: str, background: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    st = State(device)
    staging = PinnedStaging(device)
    rounds = [payloads(rng, args.slots) for _ in range(args.rounds)]
    walls, cpus, pins = [], [], []
    busy = Background(device, python=background == "gpu+python") if background != "idle" else nullcontext()
    with busy:
        for p in rounds:
            t0, c0 = time.perf_counter(), time.thread_time()
            pin_time: list[float] = []
            if variant == "pin_each":
                apply_pin_each(st, p, device, pin_time)
            else:
                apply_ring(st, p, staging)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.thread_time() - c0)
            pins.append(sum(pin_time))
            time.sleep(0.002)  # a round's other work
    torch.cuda.synchronize(device)
    ok = bool(torch.equal(st.block_table[torch.from_numpy(rounds[-1]["tables"][:, 0]).to(device)].cpu(),
                          torch.from_numpy(rounds[-1]["tables"][:, 1:])))

    def ms(v: list[float], q: float | None = None) -> float:
        return round(1000.0 * (float(np.mean(v)) if q is None else float(np.percentile(v, q))), 3)

    warm = slice(10, None)  # the first rounds allocate the pinned blocks
    return {"variant": variant, "background": background, "slots": args.slots, "correct": ok,
            "wall_ms_mean": ms(walls[warm]), "wall_ms_p95": ms(walls[warm], 95),
            "cpu_ms_mean": ms(cpus[warm]), "cpu_ms_p95": ms(cpus[warm], 95),
            "pin_memory_ms_mean": ms(pins[warm])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=16, help="slots staged a round")
    p.add_argument("--rounds", type=int, default=60, help="rounds per variant and background (the spinning-thread "
                   "background makes each round take a few hundred ms)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    device = torch.device("cuda")
    results = []
    for background in ("idle", "gpu", "gpu+python"):
        for variant in ("pin_each", "ring"):
            results.append(run(variant, background, args, device))
            print(json.dumps(results[-1]), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
