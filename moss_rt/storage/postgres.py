"""The PostgreSQL backend: the records of every front end in one database (``--session-store postgresql://…``).

The driver is psycopg 3 with its connection pool (``pip install -r requirements-cluster.txt``, or the
``postgresql`` extra); it is imported when this backend is chosen, never by the default SQLite store.

- A small pool of connections per front end (worker threads take one per call); a connection is checked when it
  is taken, so after the database comes back the next call works instead of failing on a dead socket.
- Queries run in autocommit; :meth:`PostgresDatabase.transaction` opens a transaction, and a ``serialized`` one
  first takes a transaction-level advisory lock (``pg_advisory_xact_lock``), held until it commits: the
  serialized transactions of every front end run one at a time, as SQLite's ``BEGIN IMMEDIATE`` does.
- The database being unreachable (down, restarting, the network) is :class:`StoreUnavailable` (503 ``busy``),
  never a traceback; what was in flight was not committed. A call waits at most :data:`POOL_WAIT_SEC` for a
  connection; after a failure, calls fail at once for :data:`RETRY_AFTER_SEC` (no pile of waiting threads while
  the database is away), then the next one tries again; the pool reconnects in the background meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from moss_rt.storage.database import (
    Database,
    Params,
    StoreConfigError,
    StoreUnavailable,
    Tx,
    check_params,
)
from moss_rt.storage.url import redact_url

log = logging.getLogger(__name__)

# pg_advisory_xact_lock(key1, key2): the first key names moss_rt's locks ("moss"), the second which one.
LOCK_SPACE = 0x6D6F7373
SERIAL_LOCK = 1
POOL_WAIT_SEC = 5.0  # a call's wait for a connection (a free one, or a new one while the database is away)
RETRY_AFTER_SEC = 2.0  # after a call found the database away, the next ones fail at once for this long
DRIVER_HINT = (
    "pip install -r requirements-cluster.txt (or the package's 'postgresql' extra: pip install 'moss-rt[postgresql]')"
)


def load_driver() -> tuple[Any, Any]:
    """psycopg and psycopg_pool, or a clear :class:`StoreConfigError` when they are not installed."""
    try:
        import psycopg
        import psycopg_pool
    except ImportError as exc:
        raise StoreConfigError(
            f"--session-store asks for PostgreSQL but its driver is not installed ({exc.name}): {DRIVER_HINT}"
        ) from None
    return psycopg, psycopg_pool


class _Row(tuple[Any, ...]):
    """A row that answers ``row["name"]`` as well as ``row[0]`` (as SQLite's rows do)."""

    _names: dict[str, int]

    def __new__(cls, values: Sequence[Any], names: dict[str, int]) -> _Row:
        row = super().__new__(cls, values)
        row._names = names
        return row

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return tuple.__getitem__(self, self._names[key])
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        return list(self._names)


def _row_factory(cursor: Any) -> Any:
    names = {column.name: i for i, column in enumerate(cursor.description or ())}
    return lambda values: _Row(values, names)


def _sql(sql: str) -> str:
    """``?`` placeholders as psycopg's ``%s`` (the SQL here never holds a literal ``?`` or ``%``)."""
    return sql.replace("%", "%%").replace("?", "%s")


class _PgTx(Tx):
    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def query(self, sql: str, params: Params = ()) -> list[Any]:
        check_params(params)
        return list(self._conn.execute(_sql(sql), params).fetchall())

    def execute(self, sql: str, params: Params = ()) -> int:
        check_params(params)
        return int(self._conn.execute(_sql(sql), params).rowcount)

    def executemany(self, sql: str, rows: Sequence[Params]) -> None:
        for row in rows:
            check_params(row)
        with self._conn.cursor() as cursor:
            cursor.executemany(_sql(sql), rows)


class PostgresDatabase(Database):
    dialect = "postgresql"
    shared = True

    def __init__(
        self,
        url: str,
        *,
        max_connections: int = 16,
        connect_timeout_sec: float = 5.0,
        wait_sec: float | None = None,
    ) -> None:
        psycopg, pool = load_driver()
        wait_sec = POOL_WAIT_SEC if wait_sec is None else wait_sec
        self._where = redact_url(url)
        self._down_lock = threading.Lock()
        self._down_until = 0.0  # monotonic time until which calls fail at once (the database was away)
        # Errors that mean "cannot reach the database now", as opposed to a bad statement (a bug).
        self._unavailable: tuple[type[BaseException], ...] = (
            psycopg.OperationalError,
            psycopg.InterfaceError,
            pool.PoolTimeout,
            pool.PoolClosed,
        )
        self._pool = pool.ConnectionPool(
            url,
            min_size=1,
            max_size=max(1, max_connections),
            open=False,
            timeout=wait_sec,  # how long a call waits for a free (or new) connection
            kwargs={
                "autocommit": True,
                "row_factory": _row_factory,
                "connect_timeout": max(1, round(connect_timeout_sec)),
            },
            check=pool.ConnectionPool.check_connection,
            name="moss_rt-sessions",
        )
        try:
            self._pool.open(wait=True, timeout=wait_sec)
        except self._unavailable as exc:
            self._pool.close(timeout=1.0)
            raise StoreUnavailable(f"cannot connect to {self._where}: {exc}") from None

    @contextmanager
    def _errors(self) -> Iterator[None]:
        if time.monotonic() < self._down_until:
            raise StoreUnavailable(f"PostgreSQL at {self._where} was unreachable a moment ago")
        try:
            yield
        except self._unavailable as exc:
            with self._down_lock:
                first = time.monotonic() >= self._down_until
                self._down_until = time.monotonic() + RETRY_AFTER_SEC
            if first:
                log.warning("session store %s unavailable: %s", self._where, exc)
            raise StoreUnavailable(f"PostgreSQL at {self._where}: {type(exc).__name__}") from exc

    def query(self, sql: str, params: Params = ()) -> list[Any]:
        check_params(params)
        with self._errors(), self._pool.connection() as conn:
            return list(conn.execute(_sql(sql), params).fetchall())

    @contextmanager
    def transaction(self, *, serialized: bool = False, wait_sec: float | None = None) -> Iterator[Tx]:
        with self._errors(), self._pool.connection(timeout=wait_sec) as conn, conn.transaction():
            if serialized:
                conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (LOCK_SPACE, SERIAL_LOCK))
            yield _PgTx(conn)

    def close(self) -> None:
        self._pool.close(timeout=5.0)

    def describe(self) -> str:
        return f"PostgreSQL {self._where}"
