"""A prefill pass's measured cost, kept in the data dir so the next start with the same setup does not time it again.

Why: a GPU start times batched prefill passes once (prefill_pace.measure_prefill_cost: 0.45 s of a second start's
~10 s on an H200, issue 24) to size the passes that run while takes stream. The cost depends on the device, the
model, the plan and the pass's shape, not on the start: kept under a digest of those (``setup``), a later start
reads it instead. It also keeps the passes' size (and so which chunks share a pass, and their float rounding) the
same from start to start on one machine, where timing it anew could move it by a few rows.

The file is small JSON (``prefill-cost.json``), written whole to a temporary file and renamed over; an unreadable
one is said once and written anew. At most ``MAX_ENTRIES`` setups are kept (the latest).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from moss_rt.atomic_files import atomic_write
from moss_rt.engine.prefill_pace import PrefillCost

log = logging.getLogger(__name__)

FILE_NAME = "prefill-cost.json"
FORMAT = 1
MAX_ENTRIES = 16


def setup_key(setup: dict[str, Any]) -> str:
    """The digest naming one setup (JSON of it, sorted keys; values that are not JSON by their ``str``)."""
    return hashlib.sha256(json.dumps(setup, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _entries(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            return {}
        entries = data["entries"]
        if not isinstance(entries, dict):
            raise TypeError("entries is not an object")
        return entries
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("prefill cost record %s cannot be read (%s: %s); passes are timed again", path,
                    type(exc).__name__, exc)
        return {}


def recorded_cost(path: Path, key: str) -> PrefillCost | None:
    """The cost recorded for ``key``, None where there is none (or it cannot be read)."""
    entry = _entries(path).get(key)
    try:
        cost = PrefillCost(float(entry["fixed_s"]), float(entry["per_row_s"])) if entry else None
    except (KeyError, TypeError, ValueError):
        return None
    if cost is not None and (cost.fixed_s < 0 or cost.per_row_s < 0):
        return None  # not a measurement
    return cost


def record_cost(path: Path, key: str, cost: PrefillCost, note: str = "") -> None:
    """Keep ``cost`` for ``key`` (``note``: what it was measured on, for a reader of the file). Never raises: a data
    dir that cannot be written only means the next start times the passes again."""
    try:
        entries = _entries(path)
        entries.pop(key, None)
        entries[key] = {"fixed_s": cost.fixed_s, "per_row_s": cost.per_row_s, "note": note}
        kept = dict(list(entries.items())[-MAX_ENTRIES:])
        atomic_write(path, (json.dumps({"format": FORMAT, "entries": kept}, indent=1) + "\n").encode())
    except OSError as exc:
        log.warning("cannot record the prefill cost in %s (%s); the next start times the passes again", path, exc)
