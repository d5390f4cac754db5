"""The session store's tables, as migrations (moss_rt/storage/migrations.py), for SQLite and PostgreSQL.

    sessions        id, owner, client, bytes (audio and codes on disk), created, updated (last use), next_number
    takes           one row per stored take: its request, seed, lineage, notes, stats, bytes, number, and for a
                    splice or comp its kind, parts and crossfade (has_codes 0: audio only)
    shares          a session's read-only share token
    take_words      word timings of stored takes (moss_rt.align)
    front_ends      the front ends using the store now (moss_rt/storage/front_ends.py)
    store_secrets   secrets every front end must agree on (the owner cookies' signing key)

The same numbers on both backends; timestamps are Unix seconds (REAL / DOUBLE PRECISION), seeds 64-bit text.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from moss_rt.storage.database import Tx
from moss_rt.storage.migrations import Migration, MigrationContext, run_sql, sqlite_columns, sqlite_has_table

log = logging.getLogger(__name__)

COMPONENT = "sessions"

_V1_SQLITE = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS takes (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    take_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    parent TEXT,
    branch_frame INTEGER NOT NULL,
    seed TEXT NOT NULL,
    request TEXT NOT NULL,
    reason TEXT,
    n_frames INTEGER NOT NULL,
    channels INTEGER NOT NULL,
    stats TEXT NOT NULL,
    title TEXT NOT NULL DEFAULT '',
    starred INTEGER NOT NULL DEFAULT 0,
    note TEXT NOT NULL DEFAULT '',
    markers TEXT NOT NULL DEFAULT '[]',
    created REAL NOT NULL,
    PRIMARY KEY (session_id, take_id)
)
"""

_V1_POSTGRESQL = """
CREATE TABLE sessions (
    id TEXT PRIMARY KEY,
    created DOUBLE PRECISION NOT NULL,
    updated DOUBLE PRECISION NOT NULL
);
CREATE TABLE takes (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    take_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    parent TEXT,
    branch_frame INTEGER NOT NULL,
    seed TEXT NOT NULL,
    request TEXT NOT NULL,
    reason TEXT,
    n_frames INTEGER NOT NULL,
    channels INTEGER NOT NULL,
    stats TEXT NOT NULL,
    title TEXT NOT NULL DEFAULT '',
    starred INTEGER NOT NULL DEFAULT 0,
    note TEXT NOT NULL DEFAULT '',
    markers TEXT NOT NULL DEFAULT '[]',
    created DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (session_id, take_id)
)
"""

_V2_TABLES = """
CREATE TABLE IF NOT EXISTS shares (
    token TEXT PRIMARY KEY,
    session_id TEXT NOT NULL UNIQUE REFERENCES sessions(id) ON DELETE CASCADE,
    created {real} NOT NULL
);
CREATE INDEX IF NOT EXISTS sessions_client ON sessions(client);
CREATE INDEX IF NOT EXISTS sessions_updated ON sessions(updated)
"""
_V2_COLUMNS = {
    "sessions": (("owner", "TEXT"), ("client", "TEXT"), ("bytes", "BIGINT NOT NULL DEFAULT 0")),
    "takes": (("bytes", "BIGINT NOT NULL DEFAULT 0"),),
}


def _v2_sqlite(tx: Tx, context: MigrationContext) -> None:
    """Owners, budgets, shares. A database from before it may have some of the columns (the earlier ad-hoc
    upgrade added them one by one); the takes' sizes are measured from their files."""
    for table, columns in _V2_COLUMNS.items():
        have = sqlite_columns(tx, table)
        for name, decl in columns:
            if name not in have:
                tx.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
    run_sql(tx, _V2_TABLES.format(real="REAL"))
    rows = tx.query("SELECT session_id, take_id FROM takes")
    root = context.files_root or Path(".")
    sizes = [(_size(root, s, t), s, t) for s, t in rows]
    tx.executemany("UPDATE takes SET bytes = ? WHERE session_id = ? AND take_id = ?", sizes)
    tx.execute("UPDATE sessions SET bytes = (SELECT COALESCE(SUM(bytes), 0) FROM takes WHERE session_id = sessions.id)")
    if rows:
        log.info("session store: %d takes measured for the budgets", len(rows))


def _v2_postgresql(tx: Tx, context: MigrationContext) -> None:
    for table, columns in _V2_COLUMNS.items():
        for name, decl in columns:
            tx.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
    run_sql(tx, _V2_TABLES.format(real="DOUBLE PRECISION"))


def _size(root: Path, session_id: str, take_id: str) -> int:
    total = 0
    for name in (f"{take_id}.pcm", f"{take_id}.codes.npy"):
        try:
            total += os.stat(root / session_id / name).st_size
        except OSError:
            pass
    return total


_V3 = """
CREATE TABLE IF NOT EXISTS take_words (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    take_id TEXT NOT NULL,
    aligner TEXT NOT NULL,
    words TEXT NOT NULL,
    created {real} NOT NULL,
    PRIMARY KEY (session_id, take_id)
)
"""

_V4 = """
CREATE TABLE front_ends (
    id TEXT PRIMARY KEY,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    started {real} NOT NULL,
    seen {real} NOT NULL
);
CREATE TABLE store_secrets (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    created {real} NOT NULL
);
CREATE INDEX IF NOT EXISTS sessions_owner ON sessions(owner)
"""

_V5_COLUMNS = {
    "sessions": (("next_number", "INTEGER NOT NULL DEFAULT 1"),),
    "takes": (
        ("number", "INTEGER NOT NULL DEFAULT 0"),
        ("kind", "TEXT NOT NULL DEFAULT 'take'"),
        ("parts", "TEXT NOT NULL DEFAULT '[]'"),
        ("crossfade", "INTEGER NOT NULL DEFAULT 0"),
        ("has_codes", "INTEGER NOT NULL DEFAULT 1"),
    ),
}


def _v5(tx: Tx, context: MigrationContext) -> None:
    """Take numbers that are never reused, and splices and comps (the same on both backends).

    The takes stored before get the numbers a reload showed them under (their place in the session, oldest
    first), and each session numbers its next take after its last."""
    for table, columns in _V5_COLUMNS.items():
        for name, decl in columns:
            tx.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
    rows = tx.query("SELECT session_id, take_id FROM takes ORDER BY session_id, seq")
    numbers: list[tuple[int, str, str]] = []
    place: dict[str, int] = {}
    for session_id, take_id in rows:
        place[session_id] = place.get(session_id, 0) + 1
        numbers.append((place[session_id], session_id, take_id))
    tx.executemany("UPDATE takes SET number = ? WHERE session_id = ? AND take_id = ?", numbers)
    tx.execute(
        "UPDATE sessions SET next_number = 1 + (SELECT COALESCE(MAX(number), 0) FROM takes"
        " WHERE takes.session_id = sessions.id)"
    )
    if rows:
        log.info("session store: %d stored takes numbered", len(rows))


MIGRATIONS: tuple[Migration, ...] = (
    Migration("sessions and takes", _V1_SQLITE, _V1_POSTGRESQL),
    Migration("owners, budgets and shares", _v2_sqlite, _v2_postgresql),
    Migration("word timings", _V3.format(real="REAL"), _V3.format(real="DOUBLE PRECISION")),
    Migration("front ends and shared secrets", _V4.format(real="REAL"), _V4.format(real="DOUBLE PRECISION")),
    Migration("take numbers, splices and comps", _v5, _v5),
)


def adopt_sqlite(tx: Tx) -> int:
    """How many of :data:`MIGRATIONS` a SQLite database made before ``schema_migrations`` has, by its older
    bookkeeping (``PRAGMA user_version`` 1: owners and budgets were in). Below that nothing is taken for granted:
    the first migrations are written to run over whatever part of their tables exists."""
    if not sqlite_has_table(tx, "sessions") or int(tx.scalar("PRAGMA user_version") or 0) < 1:
        return 0
    return 3 if sqlite_has_table(tx, "take_words") else 2
