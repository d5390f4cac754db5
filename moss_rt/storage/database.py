"""The records' database, whichever it is: reads, transactions, rows, and errors that say what happened.

SQL is written once, with ``?`` placeholders and the subset of SQL both backends speak (``ON CONFLICT`` upserts,
``CAST(… AS BIGINT)`` sums); each backend translates what it must. Rows answer both ``row["name"]`` and
``row[0]``.

Blocking: every call waits on the disk or the network; callers run them on worker threads, never on the event
loop.

Transactions come in two kinds. A plain one is atomic; a ``serialized`` one also runs alone among the serialized
transactions of every process sharing the database (SQLite: every write transaction does; PostgreSQL: an
advisory lock held until it ends). Checks that count what all front ends stored (quotas, a session's take count)
run inside a serialized transaction, together with the write they allow, so two front ends cannot both pass the
last free place.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, ClassVar

from moss_rt.protocol import ErrorCode, ProtocolError

log = logging.getLogger(__name__)

Params = Sequence[Any]
SQLITE_BUSY_TIMEOUT_SEC = 10.0  # another process's write transaction is waited for this long


# A call made while the service shuts down (its front end's row, a render's lease given up) waits at most this long
# for a connection: the database may be why the service is stopping, and what those calls tidy up also runs out by
# itself. (With the database gone the shutdown waited the pool's whole wait, 5 s, for the first of them.)
CLOSING_WAIT_SEC = 1.0


class StoreUnavailable(ProtocolError):
    """The database cannot be reached (or stays locked): 503 ``busy`` with Retry-After; nothing was changed."""

    def __init__(self, why: str) -> None:
        super().__init__(
            ErrorCode.BUSY, f"the session store is unavailable ({why}); nothing was changed, try again shortly"
        )


class StoreConfigError(RuntimeError):
    """The ``--session-store`` setting cannot be used (unknown scheme, driver missing, schema too new)."""


def check_params(params: Params) -> None:
    """Text the databases would refuse or mangle (NUL, unpaired surrogates) is the caller's error, the same on
    both backends: SQLite would keep it, PostgreSQL refuses it."""
    for value in params:
        if isinstance(value, str):
            if "\x00" in value:
                raise ProtocolError(ErrorCode.INVALID_FIELD, "text may not contain NUL characters")
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ProtocolError(
                    ErrorCode.INVALID_FIELD, "text must be valid Unicode (no lone surrogates)"
                ) from None


class Reader(ABC):
    """Something that answers queries: the database itself (each query on its own) or a transaction."""

    @abstractmethod
    def query(self, sql: str, params: Params = ()) -> list[Any]: ...

    def one(self, sql: str, params: Params = ()) -> Any | None:
        rows = self.query(sql, params)
        return rows[0] if rows else None

    def scalar(self, sql: str, params: Params = ()) -> Any:
        row = self.one(sql, params)
        return None if row is None else row[0]


class Tx(Reader):
    """An open transaction: its statements commit together when the ``with`` block ends, or none do."""

    @abstractmethod
    def execute(self, sql: str, params: Params = ()) -> int:
        """Run one statement; how many rows it changed."""

    @abstractmethod
    def executemany(self, sql: str, rows: Sequence[Params]) -> None: ...


class Database(Reader):
    """The records of one session store: SQLite (:class:`SqliteDatabase`) or PostgreSQL
    (:class:`moss_rt.storage.postgres.PostgresDatabase`)."""

    dialect: ClassVar[str]
    # Whether front ends on other machines may share it (their files then live in a shared directory).
    shared: ClassVar[bool] = False

    @abstractmethod
    def transaction(self, *, serialized: bool = False, wait_sec: float | None = None) -> AbstractContextManager[Tx]:
        """A transaction (``serialized``: alone among the serialized ones of every process, see the module);
        ``wait_sec``: how long to wait for a connection at most, where the store has a pool (None: its own wait)."""

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def describe(self) -> str:
        """Where it is, for logs and errors (never a password)."""


# --------------------------------------------------------------------------- SQLite


class _SqliteTx(Tx):
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def query(self, sql: str, params: Params = ()) -> list[Any]:
        check_params(params)
        return self._db.execute(sql, params).fetchall()

    def execute(self, sql: str, params: Params = ()) -> int:
        check_params(params)
        return self._db.execute(sql, params).rowcount

    def executemany(self, sql: str, rows: Sequence[Params]) -> None:
        for row in rows:
            check_params(row)
        self._db.executemany(sql, rows)


@contextmanager
def _sqlite_errors() -> Iterator[None]:
    try:
        yield
    except sqlite3.OperationalError as exc:
        text = str(exc).lower()
        if "locked" in text or "busy" in text or "disk i/o" in text or "unable to open" in text:
            raise StoreUnavailable(f"SQLite: {exc}") from exc
        raise


class SqliteDatabase(Database):
    """One SQLite file (WAL, synchronous writes). One connection, shared by the worker threads under a lock;
    other processes on the same machine may open the same file (SQLite locks it for their write transactions)."""

    dialect = "sqlite"
    shared = False

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        with _sqlite_errors():
            self._db = sqlite3.connect(
                self.path, check_same_thread=False, isolation_level=None, timeout=SQLITE_BUSY_TIMEOUT_SEC
            )
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a committed take survives a power cut
            self._db.execute("PRAGMA foreign_keys=ON")

    def query(self, sql: str, params: Params = ()) -> list[Any]:
        check_params(params)
        with self._lock, _sqlite_errors():
            return self._db.execute(sql, params).fetchall()

    @contextmanager
    def transaction(self, *, serialized: bool = False, wait_sec: float | None = None) -> Iterator[Tx]:
        # Every SQLite write transaction is serialized: BEGIN IMMEDIATE takes the file's write lock at once. (No pool:
        # ``wait_sec`` has nothing to bound.)
        with self._lock, _sqlite_errors():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield _SqliteTx(self._db)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def describe(self) -> str:
        return f"SQLite {self.path}"
