"""Script render jobs on disk: two tables in the session store's database, with their own migrations.

A script belongs to a directing session (its lines' takes are that session's takes), so its rows live in the same
database (SQLite or PostgreSQL, :mod:`moss_rt.storage`), ``ON DELETE CASCADE`` from the session: deleting the
session deletes its scripts. The tables and every query on them are here, not in ``session_store.py``; they are
their own component (``scripts``) of the versioned migrations (moss_rt/storage/migrations.py).

    scripts       one row per script: its session, client (the address that posted it: the key of the fair share
                  and of the per-client caps), the script as parsed (canonical JSON), a job-level failure, and its
                  lease: the front end rendering it (``runner``) and until when (``lease_until``)
    script_lines  one row per spoken line: status (pending | done | failed), the accepted take and its seed and
                  length, attempts, the last error, and ``render``: the render in progress (its take id, request,
                  parent), written before the engine is asked, so a restart resumes it under the same take id

Leases: a script renders on one front end at a time. The front end that starts or directs it claims the lease and
renews it while it runs; another front end resumes it only once the lease has run out (its front end stopped or
lost the database), or takes it over when a director retakes a line there. Writes that end a render are made only
while the writer still holds the lease (:class:`LeaseLost` otherwise), so two front ends never both settle a line.

Blocking calls (the database): the service runs them on worker threads.

Who may reach a script is not recorded here: a script is its session's, so the web layer lets through whoever may
reach the session (its owner, or a share token's holder for reads; moss_rt/web/owners.py).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moss_rt.protocol import ErrorCode, ProtocolError
from moss_rt.storage.database import CLOSING_WAIT_SEC, Database, SqliteDatabase, Tx
from moss_rt.storage.migrations import Migration, MigrationContext, migrate, sqlite_has_table
from moss_rt.storage.migrations import version as schema_version

SCRIPT_ID_PATTERN = r"sc_[A-Za-z0-9_-]{16,64}"

COMPONENT = "scripts"

_V1 = """
CREATE TABLE scripts (
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    owner TEXT NOT NULL,
    title TEXT NOT NULL,
    source TEXT NOT NULL,
    failure TEXT,
    created {real} NOT NULL,
    updated {real} NOT NULL
);
CREATE INDEX scripts_by_session ON scripts(session_id);
CREATE INDEX scripts_by_owner ON scripts(owner);
CREATE TABLE script_lines (
    script_id TEXT NOT NULL REFERENCES scripts(id) ON DELETE CASCADE,
    line INTEGER NOT NULL,
    status TEXT NOT NULL,
    take_id TEXT,
    seed {bigint} NOT NULL,
    n_frames INTEGER NOT NULL DEFAULT 0,
    text TEXT,
    instruction TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    render TEXT,
    updated {real} NOT NULL,
    PRIMARY KEY (script_id, line)
)
"""

# 2: the column named who posted the script by address; it is the client (sessions' owners are identities).
_V2 = """
ALTER TABLE scripts RENAME COLUMN owner TO client;
DROP INDEX scripts_by_owner;
CREATE INDEX scripts_by_client ON scripts(client)
"""

_V3 = """
ALTER TABLE scripts ADD COLUMN runner TEXT;
ALTER TABLE scripts ADD COLUMN lease_until {real}
"""

_SQLITE = {"real": "REAL", "bigint": "INTEGER"}
_POSTGRESQL = {"real": "DOUBLE PRECISION", "bigint": "BIGINT"}

# Applied once each, in order (moss_rt/storage/migrations.py); never edit one that has shipped, add another.
MIGRATIONS: tuple[Migration, ...] = (
    Migration("scripts and their lines", _V1.format(**_SQLITE), _V1.format(**_POSTGRESQL)),
    Migration("the poster is the client", _V2, _V2),
    Migration("leases", _V3.format(**_SQLITE), _V3.format(**_POSTGRESQL)),
)


def _adopt_sqlite(tx: Tx) -> int:
    """A SQLite database from before the shared mechanism kept this component's version in ``script_schema``."""
    if not sqlite_has_table(tx, "script_schema"):
        return 0
    adopted = int(tx.scalar("SELECT version FROM script_schema") or 0)
    tx.execute("DROP TABLE script_schema")
    return adopted


PENDING, DONE, FAILED = "pending", "done", "failed"
# A lease another front end may take (parameters: the runner asking, now): free, its own, run out, or held by a
# front end that is gone (no longer in the store's front_ends: one on this host whose process died is removed when
# the next front end opens the store, so a restart resumes at once).
_FREE = "(runner IS NULL OR runner = ? OR lease_until < ? OR runner NOT IN (SELECT id FROM front_ends))"


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
    runner: str | None = None  # the front end holding the lease (rendering it), if any
    lease_until: float | None = None


def not_found() -> ProtocolError:
    return ProtocolError(ErrorCode.NOT_FOUND, "no such script (it may have been deleted)", field="script")


class LeaseLost(Exception):
    """Another front end took the script over: this one's render results are not recorded (the take stays in
    the session, as any take does)."""


class ScriptStore:
    """The script tables of the session store's database: ``database`` (shared with the session store, which
    closes it), or the SQLite file at a path (opened here, closed by :meth:`close`)."""

    def __init__(self, database: Database | Path) -> None:
        self._owns = not isinstance(database, Database)
        self.db: Database = SqliteDatabase(Path(database)) if not isinstance(database, Database) else database
        try:
            migrate(
                self.db,
                COMPONENT,
                MIGRATIONS,
                MigrationContext(),
                adopt=_adopt_sqlite if self.db.dialect == "sqlite" else None,
            )
        except BaseException:
            if self._owns:
                self.db.close()
            raise

    def close(self) -> None:
        if self._owns:
            self.db.close()

    @property
    def schema_version(self) -> int:
        return schema_version(self.db, COMPONENT)

    # ------------------------------------------------------------------ scripts
    def create(
        self,
        script_id: str,
        session_id: str,
        client: str,
        title: str,
        source: dict[str, Any],
        seeds: list[int],
        *,
        runner: str | None = None,
        lease_sec: float = 0.0,
    ) -> None:
        """A new script, pending, its lease held by ``runner`` (if given) for ``lease_sec``."""
        now = time.time()
        with self.db.transaction() as tx:
            tx.execute(
                "INSERT INTO scripts (id, session_id, client, title, source, created, updated, runner, lease_until)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (script_id, session_id, client, title, json.dumps(source), now, now, runner,
                 now + lease_sec if runner else None),
            )  # fmt: skip
            tx.executemany(
                "INSERT INTO script_lines (script_id, line, status, seed, updated) VALUES (?, ?, ?, ?, ?)",
                [(script_id, n, PENDING, seed, now) for n, seed in enumerate(seeds, 1)],
            )

    def get(self, script_id: str) -> ScriptRow:
        row = self.db.one("SELECT * FROM scripts WHERE id = ?", (script_id,))
        lines = self.db.query("SELECT * FROM script_lines WHERE script_id = ? ORDER BY line", (script_id,))
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
            runner=row["runner"],
            lease_until=row["lease_until"],
        )

    def exists(self, script_id: str) -> bool:
        return self.db.one("SELECT 1 FROM scripts WHERE id = ?", (script_id,)) is not None

    def unfinished(self, runner: str | None = None) -> list[str]:
        """Scripts with a line still to render (pending, or a render under way when the server stopped), oldest
        first; a script that failed as a whole is not resumed. With ``runner``: only those it may run now (its own,
        unleased, or whose lease ran out)."""
        sql = (
            "SELECT DISTINCT s.id, s.created FROM scripts s JOIN script_lines l ON l.script_id = s.id"
            " WHERE s.failure IS NULL AND (l.status = ? OR l.render IS NOT NULL)"
        )
        params: list[Any] = [PENDING]
        if runner is not None:
            sql += f" AND {_FREE.replace('runner', 's.runner').replace('lease_until', 's.lease_until')}"
            params += [runner, time.time()]
        rows = self.db.query(sql + " ORDER BY s.created", params)
        return [r[0] for r in rows]

    def of_session(self, session_id: str) -> list[ScriptRow]:
        ids = [
            r[0] for r in self.db.query("SELECT id FROM scripts WHERE session_id = ? ORDER BY created", (session_id,))
        ]
        out = []
        for script_id in ids:
            try:
                out.append(self.get(script_id))
            except ProtocolError:  # deleted meanwhile
                continue
        return out

    def delete(self, script_id: str) -> None:
        with self.db.transaction() as tx:
            if tx.execute("DELETE FROM scripts WHERE id = ?", (script_id,)) == 0:
                raise not_found()

    def fail_script(self, script_id: str, failure: str) -> None:
        with self.db.transaction() as tx:
            tx.execute("UPDATE scripts SET failure = ?, updated = ? WHERE id = ?", (failure, time.time(), script_id))

    # ------------------------------------------------------------------ leases
    def claim(self, script_id: str, runner: str, lease_sec: float, *, take_over: bool = False) -> bool:
        """Hold the script's lease for ``lease_sec``: when it is free, already ``runner``'s, ran out, or its front
        end is gone (or, with ``take_over``, whoever held it). False when another front end holds it;
        ``not_found`` when the script is gone."""
        now = time.time()
        condition = "" if take_over else f" AND {_FREE}"
        params: tuple[Any, ...] = (runner, now + lease_sec, script_id) + (() if take_over else (runner, now))
        with self.db.transaction() as tx:
            if tx.execute(f"UPDATE scripts SET runner = ?, lease_until = ? WHERE id = ?{condition}", params):
                return True
            if tx.one("SELECT 1 FROM scripts WHERE id = ?", (script_id,)) is None:
                raise not_found()
        return False

    def renew(self, script_ids: list[str], runner: str, lease_sec: float) -> list[str]:
        """Extend ``runner``'s leases; the ids among ``script_ids`` it no longer holds (taken over, or deleted)."""
        until = time.time() + lease_sec
        lost = []
        with self.db.transaction() as tx:
            for script_id in script_ids:
                if not tx.execute(
                    "UPDATE scripts SET lease_until = ? WHERE id = ? AND runner = ?", (until, script_id, runner)
                ):
                    lost.append(script_id)
        return lost

    def release(self, script_id: str, runner: str) -> None:
        """Give the lease up (the render stopped here, the service is shutting down: another front end may resume it at
        once). A short wait for the database: the lease runs out by itself."""
        with self.db.transaction(wait_sec=CLOSING_WAIT_SEC) as tx:
            tx.execute(
                "UPDATE scripts SET runner = NULL, lease_until = NULL WHERE id = ? AND runner = ?", (script_id, runner)
            )

    # ------------------------------------------------------------------ lines
    def start_render(self, script_id: str, line: int, render: dict[str, Any], *, runner: str | None = None) -> None:
        """A render of ``line`` is about to be asked of the engine (counted as an attempt)."""
        self._update_line(script_id, line, "render = ?, attempts = attempts + 1", (json.dumps(render),), runner)

    def queue_render(self, script_id: str, line: int, render: dict[str, Any], *, runner: str | None = None) -> None:
        """A render of ``line`` is wanted (a retake): kept so that a restart still makes it."""
        self._update_line(script_id, line, "render = ?", (json.dumps(render),), runner)

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
        runner: str | None = None,
    ) -> None:
        self._update_line(
            script_id, line,
            "status = ?, take_id = ?, seed = ?, n_frames = ?, text = ?, instruction = ?, error = NULL, render = NULL",
            (DONE, take_id, seed, n_frames, text, instruction), runner,
        )  # fmt: skip

    def fail_line(self, script_id: str, line: int, error: str, *, keep_take: bool, runner: str | None = None) -> None:
        """The render failed for good: the line is failed, or (``keep_take``: a failed retake of a done line) keeps
        its take and says why the retake failed."""
        status = "status" if keep_take else "?"
        params: tuple[Any, ...] = (error,) if keep_take else (FAILED, error)
        self._update_line(script_id, line, f"status = {status}, error = ?, render = NULL", params, runner)

    def _update_line(
        self, script_id: str, line: int, assignments: str, params: tuple[Any, ...], runner: str | None
    ) -> None:
        """One line's update, made only while ``runner`` (when given) holds the script's lease."""
        now = time.time()
        held = "" if runner is None else " AND EXISTS (SELECT 1 FROM scripts WHERE id = ? AND runner = ?)"
        extra: tuple[Any, ...] = () if runner is None else (script_id, runner)
        with self.db.transaction() as tx:
            changed = tx.execute(
                f"UPDATE script_lines SET {assignments}, updated = ? WHERE script_id = ? AND line = ?{held}",
                (*params, now, script_id, line, *extra),
            )
            if changed == 0:
                if runner is not None and tx.one("SELECT 1 FROM scripts WHERE id = ?", (script_id,)) is not None:
                    raise LeaseLost(script_id)
                raise not_found()
            tx.execute("UPDATE scripts SET updated = ? WHERE id = ?", (now, script_id))


def _line_of(row: Any) -> LineRow:
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
