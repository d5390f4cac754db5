"""How many torch operations admitting takes costs the engine's thread (CPU, tiny model: counts, not times).

    python bench/admit_ops.py [--takes 1,8,32] [--out admit_ops.json]

Each torch call from Python is a dispatch that releases the interpreter lock and takes it back; with the codec
worker and the web threads running, taking it back can wait for them, so on the GPU host every call of an admission
costs far more than its kernel or copy (moss_rt_admit_part_seconds: ~4.6 ms an admission, issue 26). This script
loads the real engine on the tiny model (CPU), then admits rounds of N takes and counts, during the scheduler's
``_admit`` alone (one round, everything it does for those takes):

- ``calls``: torch calls from Python (a TorchFunctionMode: functions, methods, indexing), by what made them
  (the runner's slot operations, the apply of the round's staged writes, the codec's stream opened, other);
- ``aten``: the aten operations they dispatched (a TorchDispatchMode: kernels and copies on a GPU).

Two kinds of rounds: fresh takes (distinct lines, distinct sampling) and retakes (each of a different finished take,
from frame 4, a new seed: shared KV blocks, repetition history). Works at any commit (before the batched admission
there is no ``apply_staged``), so the same command gives the before and after figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moss_rt.config import Settings  # noqa: E402
from moss_rt.engine.base import TakeEvent, TakeFinished, TakeSpec  # noqa: E402
from moss_rt.engine.moss import MossEngine  # noqa: E402
from moss_rt.engine.prompts import prompt_rows  # noqa: E402
from moss_rt.engine.slots import Take  # noqa: E402
from moss_rt.generation import SamplingParams  # noqa: E402

log = logging.getLogger("admit_ops")

RUNNER_PARTS = ("alloc_slot", "attach", "share_prefix", "reserve", "set_sampling", "free_slot", "detach")


class Channel:
    """A take's channel nobody cancels; remembers the codes it was sent."""

    cancel_reason = None
    paused = False

    def __init__(self) -> None:
        self.codes: list[np.ndarray] = []
        self.done = threading.Event()

    def push(self, event: TakeEvent) -> None:
        codes = getattr(event, "codes", None)
        if codes is not None:
            self.codes.append(codes)
        if isinstance(event, TakeFinished):
            self.done.set()


class Count:
    """Attributes every torch call and aten op to the part running (set by ``within``)."""

    def __init__(self) -> None:
        self.part = "other"
        self.calls: Counter[str] = Counter()
        self.aten: Counter[str] = Counter()

    @contextmanager
    def within(self, part: str) -> Iterator[None]:
        outer, self.part = self.part, part
        try:
            yield
        finally:
            self.part = outer


class CallMode(TorchFunctionMode):
    def __init__(self, count: Count) -> None:
        super().__init__()
        self.count = count

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count.calls[self.count.part] += 1
        return func(*args, **(kwargs or {}))


class AtenMode(TorchDispatchMode):
    def __init__(self, count: Count) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count.aten[self.count.part] += 1
        return func(*args, **(kwargs or {}))


def _wrap(count: Count, obj: Any, name: str, part: str) -> None:
    original: Callable[..., Any] = getattr(obj, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with count.within(part):
            return original(*args, **kwargs)

    setattr(obj, name, wrapped)


def _run_until_done(engine: MossEngine, channels: list[Channel], timeout_s: float = 120.0) -> None:
    sched = engine._scheduler
    assert sched is not None
    deadline = time.monotonic() + timeout_s
    while not all(c.done.is_set() for c in channels):
        if time.monotonic() > deadline:
            raise RuntimeError("takes did not end in time")
        engine._wake.clear()
        if not sched.iterate():
            engine._wake.wait(0.05)


def _admit_counted(engine: MossEngine, specs: list[TakeSpec]) -> tuple[Count, list[Channel]]:
    sched, runner = engine._scheduler, engine._runner
    assert sched is not None and runner is not None
    channels = [Channel() for _ in specs]
    for s, ch in zip(specs, channels, strict=True):
        sched.add(Take(s, ch, prompt=prompt_rows(runner, s)))  # type: ignore[arg-type]
    count = Count()
    for name in RUNNER_PARTS:
        _wrap(count, runner, name, name)
    if hasattr(runner, "apply_staged"):
        _wrap(count, runner, "apply_staged", "apply_staged")
    _wrap(count, sched, "_open_codec_state", "codec")
    try:
        with CallMode(count), AtenMode(count):
            sched._admit()
    finally:
        for name in (*RUNNER_PARTS, "apply_staged", "_open_codec_state"):
            vars(runner).pop(name, None)
            vars(sched).pop(name, None)
    admitted = sum(1 for t in sched.preparing if t.spec.take_id in {s.take_id for s in specs})
    if admitted != len(specs):
        raise RuntimeError(f"only {admitted} of {len(specs)} takes were admitted in one round")
    return count, channels


def _summary(count: Count, takes: int) -> dict[str, Any]:
    calls, aten = sum(count.calls.values()), sum(count.aten.values())
    return {"takes": takes, "calls": calls, "calls_per_take": round(calls / takes, 2), "aten": aten,
            "aten_per_take": round(aten / takes, 2), "calls_by_part": dict(count.calls),
            "aten_by_part": dict(count.aten)}


def sampling(i: int) -> SamplingParams:
    return SamplingParams(audio_temperature=0.6 + 0.05 * (i % 5), audio_top_k=20 + i, audio_top_p=0.8 + 0.01 * (i % 9),
                          audio_repetition_penalty=1.0 + 0.05 * (i % 4), text_temperature=0.0)


def measure(n_takes: list[int], data_dir: Path) -> list[dict[str, Any]]:
    most = max(n_takes)
    settings = Settings(engine="moss", model="tiny", codec="tiny", device="cpu", data_dir=data_dir,
                        max_slots=2 * most, max_queue=2 * most, max_seq_len=256, max_lead_sec=0.0)
    engine = MossEngine(settings)
    rows: list[dict[str, Any]] = []
    try:
        engine._load()
        engine._warm_up()
        for n in n_takes:
            fresh = [TakeSpec(f"f{n}-{i}", text=f"Line {i} of {n}: the rain had stopped an hour ago, almost.",
                              seed=1000 + i, sampling=sampling(i), max_frames=12, chunk_frames=4) for i in range(n)]
            count, channels = _admit_counted(engine, fresh)
            rows.append({"round": "fresh", **_summary(count, n)})
            _run_until_done(engine, channels)
            retakes = []
            for s, ch in zip(fresh, channels, strict=True):
                codes = np.concatenate(ch.codes)[:4]
                retakes.append(TakeSpec(f"{s.take_id}.r", text=s.text, seed=s.seed + 7, sampling=s.sampling,
                                        max_frames=6, chunk_frames=2, prefix_codes=codes, parent_take=s.take_id))
            count, channels = _admit_counted(engine, retakes)
            rows.append({"round": "retake", **_summary(count, n)})
            _run_until_done(engine, channels)
    finally:
        engine._shutdown()
        engine._release_device_memory()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--takes", default="1,8,32", help="takes admitted in one round (comma-separated)")
    parser.add_argument("--data-dir", type=Path, default=None, help="where the tiny checkpoints go (default: temp)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    n_takes = sorted({int(x) for x in args.takes.split(",")})
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(n_takes, args.data_dir or Path(tmp))
    for r in rows:
        print(f"{r['round']:7s} takes={r['takes']:3d}  torch calls {r['calls']:5d} ({r['calls_per_take']:6.2f}/take)"
              f"  aten ops {r['aten']:5d} ({r['aten_per_take']:6.2f}/take)  by part {r['calls_by_part']}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
