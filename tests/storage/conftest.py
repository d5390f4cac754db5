"""The session-store suite runs on both backends: SQLite in a folder, and PostgreSQL (a fresh database on the test
server of tests/postgres.py) with the takes' files in a folder. ``store_backend.open()`` is one more front end on
the same store: same database, same files folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from moss_rt.scripts.store import ScriptStore
from moss_rt.session_store import SessionStore, open_session_store


class StoreBackend:
    def __init__(self, name: str, setting: str, files: Path) -> None:
        self.name = name
        self.setting = setting  # the --session-store value
        self.files = files
        self._open: list[SessionStore | ScriptStore] = []

    def open(self, **kwargs: Any) -> SessionStore:
        """A store on this backend, as one more front end would open it (closed after the test)."""
        store = open_session_store(self.setting, self.files, **kwargs)
        self._open.append(store)
        return store

    def scripts(self, store: SessionStore) -> ScriptStore:
        scripts = ScriptStore(store.db)
        self._open.append(scripts)
        return scripts

    def close_all(self) -> None:
        for item in reversed(self._open):
            try:
                item.close()
            except Exception:  # closed by the test already
                pass


@pytest.fixture(params=["sqlite", "postgresql"])
def store_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreBackend]:
    setting = request.getfixturevalue("postgres_url") if request.param == "postgresql" else ""
    backend = StoreBackend(request.param, setting, tmp_path / "files")
    yield backend
    backend.close_all()
