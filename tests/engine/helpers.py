"""Small helpers for engine tests: codes of a take as the server recorded them, metrics parsing, bench scripts."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import aiohttp
import numpy as np

from tests.helpers import RunningServer

# Greedy stop head: the tiny model is biased to continue, so takes run to max_new_tokens.
LONG = {"text_temperature": 0.0}


def take_codes(server: RunningServer, take_id: str) -> np.ndarray:
    take = server.state.takes.get(take_id)
    assert take is not None, f"take {take_id} is not in the store"
    return take.codes.copy()


async def metrics(server: RunningServer) -> dict[str, float]:
    """``/metrics`` as {sample name with labels: value}."""
    async with aiohttp.ClientSession() as http, http.get(server.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@contextmanager
def bench_module(filename: str) -> Iterator[ModuleType]:
    """A script of ``bench/`` imported by path (bench/ is not a package), registered while in use (its dataclasses
    look their module up) and with ``sys.path`` as it was (a bench puts its own folders first)."""
    path = Path(__file__).resolve().parents[2] / "bench" / filename
    name = f"{path.stem}_under_test"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    try:
        yield module
    finally:
        sys.modules.pop(name, None)
