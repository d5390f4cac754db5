"""A real server on 127.0.0.1 with the tiny model, shared by a test module (starting one costs seconds)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from moss_rt.config import Settings
from moss_rt.engine.moss import MossEngine
from tests.helpers import RunningServer, ServerThread, free_port

# Greedy stop head: the tiny model is biased to continue, so a take runs to max_new_tokens and its
# length is known exactly (frames x 3840 samples at 48 kHz).
EXACT = {"text_temperature": 0.0}


@pytest.fixture(scope="session")
def eco_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data dir for the session, so the tiny checkpoints are written once."""
    return tmp_path_factory.mktemp("eco-data")


@pytest.fixture(scope="module")
def tiny_server_factory(eco_data_dir: Path) -> Iterator[Callable[..., RunningServer]]:
    """Factory of tiny-model servers that live until the end of the module."""
    threads: list[ServerThread] = []

    def _make(**overrides: Any) -> RunningServer:
        settings = Settings(
            host="127.0.0.1",
            port=free_port(),
            engine="moss",
            model="tiny",
            codec="tiny",
            device="cpu",
            data_dir=eco_data_dir,
            voices_dir=eco_data_dir / "builtin-voices",
            max_slots=8,
            max_queue=8,
            max_seq_len=1024,
            max_lead_sec=0.0,
        ).replace(**overrides)
        thread = ServerThread(settings, MossEngine(settings))
        threads.append(thread)
        return thread.start(ready_timeout=180)

    yield _make
    for thread in reversed(threads):
        thread.stop()
