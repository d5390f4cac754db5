"""Small helpers for engine tests: codes of a take as the server recorded them, metrics parsing."""

from __future__ import annotations

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
