"""Script render jobs on disk: two tables in the session store's SQLite database, with their own migrations.

A script belongs to a directing session (its lines' takes are that session's takes), so its rows live in the same
database file, ``ON DELETE CASCADE`` from the session: deleting the session deletes its scripts. The tables and
every query on them are here, not in ``session_store.py``; their schema version is kept in ``script_schema``
(``PRAGMA user_version`` belongs to whoever owns the database), and migrations are only ever added, each applied
once in its own transaction.

    scripts       one row per script: its session, client (the address that posted it: the key of the fair share
                  and of the per-client caps), the script as parsed (canonical JSON), a job-level failure
    script_lines  one row per spoken line: status (pending | done | failed), the accepted take and its seed and
                  length, attempts, the last error, and ``render``: the render in progress (its take id, request,
                  parent), written before the engine is asked, so a restart resumes it under the same take id

Blocking calls (SQLite): the service runs them on worker threads. One lock serialises this connection; SQLite's
busy timeout covers the session store's own connection writing at the same moment.

Who may reach a script is not recorded here: a script is its session's, so the web layer lets through whoever may
reach the session (its owner, or a share token's holder for reads; moss_rt/web/owners.py).
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moss_rt.protocol import ErrorCode, ProtocolError

SCRIPT_ID_PATTERN = r"sc_[A-Za-z0-9_-]{16,64}"

# Each entry is applied once, in order, inside one transaction; never edit one that has shipped, add another.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE scripts (
        id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
        owner TEXT NOT NULL,
        title TEXT NOT NULL,
        source TEXT NOT NULL,
        failure TEXT,
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE INDEX scripts_by_session ON scripts(session_id);
    CREATE INDEX scripts_by_owner ON scripts(owner);
    CREATE TABLE script_lines (
        script_id TEXT NOT NULL REFERENCES scripts(id) ON DELETE CASCADE,
        line INTEGER NOT NULL,
        status TEXT NOT NULL,
        take_id TEXT,
        seed INTEGER NOT NULL,
        n_frames INTEGER NOT NULL DEFAULT 0,
        text TEXT,
        instruction TEXT,
        attempts INTEGER NOT NULL DEFAULT 0,
        error TEXT,
        render TEXT,
        updated REAL NOT NULL,
        PRIMARY KEY (script_id, line)
    );
    """,
    # 2: the column named who posted the script by address; it is the client (sessions' owners are identities).
    """
    ALTER TABLE scripts RENAME COLUMN owner TO client;
    DROP INDEX scripts_by_owner;
    CREATE INDEX scripts_by_client ON scripts(client);
    """,
)

PENDING, DONE, FAILED = "pending", "done", "failed"


def new_script_id() -> str:
    return "sc_" + secrets.token_urlsafe(18)


def short_script_id(script_id: str) -> str:
    """A script id as logs show it (as sessions are, ``short_id``): enough to tell scripts apart, never to open one."""
    return script_id[:7] + "…"


@dataclass
class LineRow:
    line: int
    status: str
    seed: int
    take_id: str | None = None
    n_frames: int = 0
    text: str | None = None  # the accepted take's words when they differ from the script's (a retake's text)
    instruction: str | None = None  # the accepted take's whole instruction (None: the script's)
    attempts: int = 0
    error: str | None = None
    render: dict[str, Any] | None = None  # the render in progress (see the module docstring)


@dataclass
class ScriptRow:
    script_id: str
    session_id: str
    client: str  # the address that posted it (fair share, per-client caps)
    title: str
    source: dict[str, Any]
    failure: str | None
    created: float
    updated: float
    lines: list[LineRow] = field(default_factory=list)


def not_found() -> ProtocolError:
    return ProtocolError(ErrorCode.NOT_FOUND, "no such script (it may have been deleted)", field="script")


class ScriptStore:
    """The script tables of the database at ``path`` (the session store's ``sessions.sqlite3``)."""

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10.0)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a line acknowledged as done survives a power cut
        self._db.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @property
    def schema_version(self) -> int:
        with self._lock:
            row = self._db.execute("SELECT version FROM script_schema").fetchone()
        return int(row[0]) if row else 0

    def _migrate(self) -> None:
        with self._tx() as db:
            db.execute("CREATE TABLE IF NOT EXISTS script_schema (version INTEGER NOT NULL)")
            row = db.execute("SELECT version FROM script_schema").fetchone()
            if row is None:
                db.execute("INSERT INTO script_schema (version) VALUES (0)")
            version = int(row[0]) if row else 0
        for number, sql in enumerate(MIGRATIONS[version:], version + 1):
            with self._tx() as db:
                for statement in (s.strip() for s in sql.split(";")):
                    if statement:
                        db.execute(statement)
                db.execute("UPDATE script_schema SET version = ?", (number,))

    # ------------------------------------------------------------------ scripts
    def create(
        self, script_id: str, session_id: str, client: str, title: str, source: dict[str, Any], seeds: list[int]
    ) -> None:
        now = time.time()
        with self._tx() as db:
            db.execute(
                "INSERT INTO scripts (id, session_id, client, title, source, created, updated)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (script_id, session_id, client, title, json.dumps(source), now, now),
            )
            db.executemany(
                "INSERT INTO script_lines (script_id, line, status, seed, updated) VALUES (?, ?, ?, ?, ?)",
                [(script_id, n, PENDING, seed, now) for n, seed in enumerate(seeds, 1)],
            )

    def get(self, script_id: str) -> ScriptRow:
        with self._lock:
            row = self._db.execute("SELECT * FROM scripts WHERE id = ?", (script_id,)).fetchone()
            lines = self._db.execute(
                "SELECT * FROM script_lines WHERE script_id = ? ORDER BY line", (script_id,)
            ).fetchall()
        if row is None:
            raise not_found()
        return ScriptRow(
            script_id=row["id"],
            session_id=row["session_id"],
            client=row["client"],
            title=row["title"],
            source=json.loads(row["source"]),
            failure=row["failure"],
            created=row["created"],
            updated=row["updated"],
            lines=[_line_of(r) for r in lines],
        )

    def exists(self, script_id: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM scripts WHERE id = ?", (script_id,)).fetchone() is not None

    def unfinished(self) -> list[str]:
        """Scripts with a line still to render (pending, or a render under way when the server stopped), oldest
        first; a script that failed as a whole is not resumed."""
        with self._lock:
            rows = self._db.execute(
                "SELECT DISTINCT s.id, s.created FROM scripts s JOIN script_lines l ON l.script_id = s.id"
                " WHERE s.failure IS NULL AND (l.status = ? OR l.render IS NOT NULL) ORDER BY s.created",
                (PENDING,),
            ).fetchall()
        return [r[0] for r in rows]

    def of_session(self, session_id: str) -> list[ScriptRow]:
        with self._lock:
            ids = [r[0] for r in self._db.execute(
                "SELECT id FROM scripts WHERE session_id = ? ORDER BY created", (session_id,)
            )]  # fmt: skip
        out = []
        for script_id in ids:
            try:
                out.append(self.get(script_id))
            except ProtocolError:  # deleted meanwhile
                continue
        return out

    def delete(self, script_id: str) -> None:
        with self._tx() as db:
            if db.execute("DELETE FROM scripts WHERE id = ?", (script_id,)).rowcount == 0:
                raise not_found()

    def fail_script(self, script_id: str, failure: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE scripts SET failure = ?, updated = ? WHERE id = ?", (failure, time.time(), script_id))

    # ------------------------------------------------------------------ lines
    def start_render(self, script_id: str, line: int, render: dict[str, Any]) -> None:
        """A render of ``line`` is about to be asked of the engine (counted as an attempt)."""
        self._update_line(script_id, line, "render = ?, attempts = attempts + 1", (json.dumps(render),))

    def queue_render(self, script_id: str, line: int, render: dict[str, Any]) -> None:
        """A render of ``line`` is wanted (a retake): kept so that a restart still makes it."""
        self._update_line(script_id, line, "render = ?", (json.dumps(render),))

    def finish_line(
        self,
        script_id: str,
        line: int,
        *,
        take_id: str,
        seed: int,
        n_frames: int,
        text: str | None,
        instruction: str | None,
    ) -> None:
        self._update_line(
            script_id, line,
            "status = ?, take_id = ?, seed = ?, n_frames = ?, text = ?, instruction = ?, error = NULL, render = NULL",
            (DONE, take_id, seed, n_frames, text, instruction),
        )  # fmt: skip

    def fail_line(self, script_id: str, line: int, error: str, *, keep_take: bool) -> None:
        """The render failed for good: the line is failed, or (``keep_take``: a failed retake of a done line) keeps
        its take and says why the retake failed."""
        status = "status" if keep_take else "?"
        params: tuple[Any, ...] = (error,) if keep_take else (FAILED, error)
        self._update_line(script_id, line, f"status = {status}, error = ?, render = NULL", params)

    def _update_line(self, script_id: str, line: int, assignments: str, params: tuple[Any, ...]) -> None:
        now = time.time()
        with self._tx() as db:
            cursor = db.execute(
                f"UPDATE script_lines SET {assignments}, updated = ? WHERE script_id = ? AND line = ?",
                (*params, now, script_id, line),
            )
            if cursor.rowcount == 0:
                raise not_found()
            db.execute("UPDATE scripts SET updated = ? WHERE id = ?", (now, script_id))

    # ------------------------------------------------------------------ internals
    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")


def _line_of(row: sqlite3.Row) -> LineRow:
    return LineRow(
        line=row["line"],
        status=row["status"],
        seed=int(row["seed"]),
        take_id=row["take_id"],
        n_frames=row["n_frames"],
        text=row["text"],
        instruction=row["instruction"],
        attempts=row["attempts"],
        error=row["error"],
        render=json.loads(row["render"]) if row["render"] else None,
    )
