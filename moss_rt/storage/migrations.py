"""Versioned schema migrations: one mechanism for every table set and both backends.

Each component (``sessions``: sessions, takes, shares, words, front ends; ``scripts``: script renders) has an
ordered tuple of :class:`Migration`; its version is how many of them the database has applied, recorded one row
per migration in ``schema_migrations (component, version, name, applied)``. Opening a store applies the missing
ones in order, each in its own serialized transaction that first checks again that nobody applied it meanwhile
(front ends starting together migrate one after the other; PostgreSQL and SQLite both run DDL in transactions,
so a migration is applied whole or not at all).

Rules: a shipped migration is never edited, only followed by a new one; both backends get the same migrations
under the same numbers (each in its own dialect). A database whose version is *higher* than this code knows (a
newer moss_rt migrated it) is refused with a clear error rather than used half-understood.

SQLite databases made before this mechanism kept their version in ``PRAGMA user_version`` (sessions) and a
``script_schema`` table (scripts); they are adopted once: what those said is recorded here, then the rest runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moss_rt.storage.database import Database, StoreConfigError, Tx

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MigrationContext:
    """What a migration written in Python may need besides the transaction."""

    files_root: Path | None = None  # the takes' files (a migration may measure them)


Step = Callable[[Tx, MigrationContext], None]


@dataclass(frozen=True)
class Migration:
    name: str
    sqlite: str | Step
    postgresql: str | Step


_TABLE = {
    "sqlite": """CREATE TABLE IF NOT EXISTS schema_migrations (
        component TEXT NOT NULL, version INTEGER NOT NULL, name TEXT NOT NULL, applied REAL NOT NULL,
        PRIMARY KEY (component, version))""",
    "postgresql": """CREATE TABLE IF NOT EXISTS schema_migrations (
        component TEXT NOT NULL, version INTEGER NOT NULL, name TEXT NOT NULL, applied DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (component, version))""",
}


def run_sql(tx: Tx, script: str) -> None:
    """Statements separated by ``;`` (none of ours holds one in a literal), one by one inside ``tx``."""
    for statement in (s.strip() for s in script.split(";")):
        if statement:
            tx.execute(statement)


def version(db: Database | Tx, component: str) -> int:
    return int(db.scalar("SELECT COALESCE(MAX(version), 0) FROM schema_migrations WHERE component = ?", (component,)))


def migrate(
    db: Database,
    component: str,
    migrations: Sequence[Migration],
    context: MigrationContext,
    *,
    adopt: Callable[[Tx], int] | None = None,
) -> int:
    """Apply the missing migrations of ``component``; its version afterwards.

    ``adopt`` (SQLite's older databases): called once, when the component has no row yet, it returns how many of
    the migrations the database already has by its older bookkeeping; those are recorded, not run again."""
    known = len(migrations)
    with db.transaction(serialized=True) as tx:
        tx.execute(_TABLE[db.dialect])
        current = version(tx, component)
        if current == 0 and adopt is not None:
            adopted = min(adopt(tx), known)
            now = time.time()
            for number in range(1, adopted + 1):
                tx.execute(
                    "INSERT INTO schema_migrations (component, version, name, applied) VALUES (?, ?, ?, ?)",
                    (component, number, f"{migrations[number - 1].name} (adopted)", now),
                )
            current = adopted
    if current > known:
        raise StoreConfigError(
            f"the {component} tables of {db.describe()} are at schema version {current}, newer than this moss_rt "
            f"knows ({known}): a newer release migrated them; run that release (or a later one) here too"
        )
    for number in range(current + 1, known + 1):
        migration = migrations[number - 1]
        with db.transaction(serialized=True) as tx:
            if version(tx, component) >= number:  # another front end applied it meanwhile
                continue
            step: Any = getattr(migration, db.dialect)
            if isinstance(step, str):
                run_sql(tx, step)
            else:
                step(tx, context)
            tx.execute(
                "INSERT INTO schema_migrations (component, version, name, applied) VALUES (?, ?, ?, ?)",
                (component, number, migration.name, time.time()),
            )
        log.info("%s: %s schema migrated to version %d (%s)", db.describe(), component, number, migration.name)
    return known


# --------------------------------------------------------------------------- SQLite introspection (adoption)


def sqlite_has_table(tx: Tx, name: str) -> bool:
    return tx.one("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)) is not None


def sqlite_columns(tx: Tx, table: str) -> set[str]:
    return {row[1] for row in tx.query(f"PRAGMA table_info({table})")}  # table: our own names only
