"""The PocketSphinx worker processes end with the server that started them, even when it is killed with SIGKILL
(it never shuts its pool down then; orphaned workers would live on holding their memory)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pocketsphinx")

REPO = Path(__file__).resolve().parents[2]
CHILD = """
import os, signal, numpy as np
from moss_rt.align.base import AlignJob
from moss_rt.align.sphinx import PocketsphinxAligner
aligner = PocketsphinxAligner(workers=2, processes=True)
aligner.load()
aligner.align_batch([AlignJob(np.zeros(16000, np.float32), ("hello",))])
print(" ".join(str(pid) for pid in aligner._pool._processes), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for this purpose (reaped by init later).
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def test_workers_exit_when_their_server_is_killed() -> None:
    # Read the workers' ids, then only wait for the child itself: the workers hold its stdout open while they live.
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    workers = [int(pid) for pid in child.stdout.readline().split()]
    child.stdout.close()
    child.wait(60)
    assert len(workers) >= 1
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in workers), f"orphaned workers still running: {workers}"
